"""Issue 39 item 1 on a twin: a local user cannot turn the NVIDIA build, which runs as root, into
root code, a deleted tree or a write into a root file.

The NVIDIA stage runs alone (tests/e2e/stage_deploy.py, the tiny driver sources of test_faults.py)
against Debian's headers in the twin. Before it, an unprivileged user (`setpriv --reuid 65534
--regid 65534 --clear-groups`, as www-data after a web-proxy bug would be) plants what the old build
root /var/tmp/pvegpu (in the 1777 /var/tmp) let anyone plant:

- /var/tmp/pvegpu/nvidia-build.log -> a root file: the build's `tee -a` of its notes appended to it;
- /var/tmp/pvegpu/nvidia-build/<version> -> a root dir: the build's `rm -rf "$B"` of
  <version>/<release> deleted that dir's <release> tree (e.g. /lib/modules/<release>).

The build must not use (nor remove through) that tree: it builds in /var/cache/pvegpu/nvidia-build
(root's alone), the planted tree stays as it was, and the root file and dir are untouched. And where
the new build root itself is not root's alone (another owner, a symlink: only root could have put
them there, e.g. a restored backup), the build refuses, naming it, and changes nothing.
"""

from __future__ import annotations

import os

import pytest

from tests.e2e.test_faults import DRIVER, DriverTwin, twin_sh, working_source

pytestmark = [pytest.mark.twin]

NOBODY = "setpriv --reuid 65534 --regid 65534 --clear-groups"


@pytest.fixture
def driver_twin(twin_factory, tmp_path) -> DriverTwin:
    return DriverTwin(twin_factory("kpro6", name=f"rootp-{os.getpid() % 10000}"), tmp_path)


def victims(d: DriverTwin) -> str:
    """A root file and a root dir holding a <release> tree, and their state (sha256s, listing)."""
    twin_sh(d.twin, f"umask 022; printf 'root only\\n' > /etc/pvegpu-victim && mkdir -p /srv/victim/{d.release} "
                    f"&& echo keep > /srv/victim/{d.release}/keep-me")
    return victim_state(d)


def victim_state(d: DriverTwin) -> str:
    return twin_sh(d.twin, "sha256sum /etc/pvegpu-victim; find /srv/victim -printf '%p %u %m\\n' | sort")


def test_a_build_root_planted_in_var_tmp_by_a_local_user_is_never_used(driver_twin):
    d = driver_twin
    before = victims(d)
    # the unprivileged user's plant (fails on the old build script: the log line lands in the root
    # file, the <release> tree under /srv/victim is deleted)
    twin_sh(d.twin, f"{NOBODY} sh -c 'umask 022; mkdir -p /var/tmp/pvegpu/nvidia-build "
                    "&& ln -s /etc/pvegpu-victim /var/tmp/pvegpu/nvidia-build.log "
                    f"&& ln -s /srv/victim /var/tmp/pvegpu/nvidia-build/{DRIVER}'")
    planted = twin_sh(d.twin, "find /var/tmp/pvegpu -printf '%p %u %l\\n' | sort")
    assert "nobody" in planted

    path, sha = d.put("tiny-nvidia.tar.gz", working_source(d.release))
    run = d.run(path, sha)
    assert run.rc == 0, run.output[-3000:]
    assert twin_sh(d.twin, f"modinfo -k {d.release} -F version nvidia").strip() == DRIVER
    assert victim_state(d) == before, "the build wrote or removed through the planted /var/tmp/pvegpu tree"
    assert twin_sh(d.twin, "find /var/tmp/pvegpu -printf '%p %u %l\\n' | sort") == planted
    # it built in root's own tree: the notes are there, the tree is 0700 and root's
    notes = twin_sh(d.twin, "cat /var/cache/pvegpu/nvidia-build/builds.log")
    assert f"pvegpu: building nvidia {DRIVER} for {d.release}" in notes
    assert twin_sh(d.twin, "stat -c '%U %a' /var/cache/pvegpu /var/cache/pvegpu/nvidia-build").split("\n")[:2] == \
        ["root 755", "root 700"]


@pytest.mark.parametrize("plant, refused, why", [
    ("mkdir -p /var/cache/pvegpu/nvidia-build && chown 65534:65534 /var/cache/pvegpu/nvidia-build",
     "/var/cache/pvegpu/nvidia-build", "/var/cache/pvegpu/nvidia-build is owned by uid 65534, not root"),
    ("mkdir -p /var/cache/pvegpu && ln -s /srv/victim /var/cache/pvegpu/nvidia-build",
     "/var/cache/pvegpu/nvidia-build", "/var/cache/pvegpu/nvidia-build is a symlink"),
    # the fetch, first, refuses its archive dir below it
    ("mkdir -p /var/cache/pvegpu && chmod 1777 /var/cache/pvegpu",
     "/var/cache/pvegpu/sources", "/var/cache/pvegpu (mode 1777) is writable by group or others"),
])
def test_a_build_root_that_is_not_roots_alone_is_refused(driver_twin, plant, refused, why):
    d = driver_twin
    before = victims(d)
    installed = d.installed()
    twin_sh(d.twin, f"umask 022; {plant}")
    path, sha = d.put("tiny-nvidia.tar.gz", working_source(d.release))
    run = d.run(path, sha)
    assert run.rc != 0
    assert f"pvegpu: refusing {refused} as a root directory: {why}" in run.output, \
        run.output[-3000:]
    assert d.installed() == installed, "a refused build changed the installed modules"
    assert victim_state(d) == before
