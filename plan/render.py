"""Render the templates in templates/ (every file pvegpu writes on a host, and every long shell
script it runs there, is one of them).

Shell templates (`templates/*.sh.j2`) take plain values and quote each one where it lands with
the `q` filter (`{{ release | q }}`: shlex.quote, so a space, `;`, `$(…)` or a quote in a spec
value stays one literal word); the operands of a command that takes options go through the
`operands` filter (`git clone {{ [url, 'src'] | operands }}`: `--`, then each one quoted), so
a value starting with '-' is never an option. Python command builders use the same two
functions. `python -m plan.render --check-shell` renders each of them with
the representative values in SHELL_EXAMPLES (every branch a caller can take) and runs
shellcheck on the result; scripts/lint.sh runs it.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import jinja2

from facts import shell

TEMPLATES = Path(__file__).resolve().parent.parent / "templates"


def quote(value: object) -> str:
    """The `q` filter: one shell word that is `value` literally (shlex.quote of its str)."""
    if isinstance(value, jinja2.Undefined):
        raise ValueError("the q filter got no value (None); a shell word needs one")
    return shell.word(value)


# The operands helper lives with the facts (facts/shell.py: the facts' own commands use it and
# facts/ imports nothing of plan/); the templates get it as the `operands` filter.
END_OF_OPTIONS = shell.END_OF_OPTIONS
operands = shell.operands


def shell_pattern(pattern: str) -> str:
    """A name pattern with `{variable}` places (plan/nvidia.py CC_CANDIDATES: `gcc-{major}`) as one
    shell word: each literal part quoted (`quote`), each place the shell variable's value:
    `gcc-"${major}"`."""
    parts = re.split(r"\{([a-z_]+)\}", pattern)
    return "".join((f'"${{{part}}}"' if i % 2 else quote(part)) for i, part in enumerate(parts) if part)


def environment(*search: Path) -> jinja2.Environment:
    """The jinja environment every template renders with; `search`: dirs looked in before templates/."""
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader([str(p) for p in (*search, TEMPLATES)]),
        undefined=jinja2.StrictUndefined,  # a missing variable is a bug, not an empty string
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
        autoescape=False,
    )
    env.filters["q"] = quote
    env.filters["operands"] = operands
    env.filters["sh_pattern"] = shell_pattern
    return env


_env = environment()


def template_environment() -> jinja2.Environment:
    """The environment `render_template` renders with (deploy.py gives it a cache of compiled
    templates: compat/jinja_cache.py)."""
    return _env


def render_template(name: str, **context) -> str:
    return _env.get_template(name).render(**context)


# Modes of the directories pvegpu writes as root (docs/SECURITY.md "Paths pvegpu writes as root"):
# trees that hold build output, logs, keys or records only root reads are 0700; caches and records
# other tools read stay 0755. Each is made and checked by templates/root-dir.sh.j2 before use.
PRIVATE = "700"
PUBLIC = "755"


def root_dir_function() -> str:
    """templates/root-dir.sh.j2: the shell function `pvegpu_dir DIR MODE` (for a command that calls it itself)."""
    return render_template("root-dir.sh.j2")


def root_dirs(*dirs: tuple[str, str]) -> str:
    """Shell that makes and checks each (dir, mode) of `dirs` with templates/root-dir.sh.j2's
    `pvegpu_dir` (every component root's, no symlink, not group/other writable; the mode set whatever
    the umask) and exits 1 naming the first refusal; the one helper every root-written path goes
    through (the shell templates include the same function)."""
    calls = " && ".join(f"pvegpu_dir {shell.word(d)} {shell.word(m)}" for d, m in dirs)
    return root_dir_function() + f"{calls} || exit 1\n"


# -- shellcheck of the shell templates ----------------------------------------------------------

# Representative values for each templates/*.sh.j2: one context per branch its callers can take
# (the callers' contexts have exactly these keys: tests/unit/test_shell_templates.py).
_BUILD = dict(archive="/var/cache/pvegpu/sources/" + "a" * 64 + "-595.45.04.tar.gz", version="595.45.04",
              release="6.14.11-4-pve", cc="gcc-12", cxx=None, jobs=4, ccache=True, conftest_cache=True,
              signing=None, sig_hash="sha256", build_root="/var/cache/pvegpu/nvidia-build",
              build_parent="/var/cache/pvegpu/nvidia-build/595.45.04",
              src_dir="/var/cache/pvegpu/nvidia-build/595.45.04/tree-gcc-12-none",
              ccache_dir="/var/cache/pvegpu/ccache", ccache_masquerade="/usr/lib/ccache",
              ccache_ignore_options='-DKBUILD_BASENAME="#conftest* -DKBUILD_MODNAME="#conftest*',
              conftest_cache_dir="/var/cache/pvegpu/nvidia-conftest", conftest_cache_keep=16,
              sign_file="scripts/sign-file", modules_dir="/lib/modules", kernel_dirs=False, share_key=None,
              share_inputs=None, share_by="converge", share_root="/var/cache/pvegpu/nvidia-share")
_KERNEL = dict(build_dir="/var/lib/pvegpu/kernel-build/6.14.11-4-pve-0123456789ab", version="6.14.11-4-pve",
               kind="proxmox-git", jobs=4, ccache=True, base_config="running",
               fragments=[], url="https://git.proxmox.com/git/pve-kernel.git", sha256="", ref="ad58d1445425ea4742e3470b2edbee35df0657e9",
               localversion="-4-pve", pkgversion="1", local_suffix="-pvegpu",
               ccache_dir="/var/cache/pvegpu/ccache-kernel", ccache_max_size="12G")
# the kernel hook's compilers: none rendered (the caller's $CC/$CXX), the rule's candidates (plan/nvidia.py)
_HOOK_CC = dict(cc=None, cxx=None, src_dir=None, cc_candidates=("{program}", "gcc-{major}", "gcc"),
                cxx_candidates=("g++{suffix}", "g++", "g++-{major}"))
# the kernel hook's build key (issue 41): plan.build_share.hook_key_parts("595.45.04", "a" * 64, False)
# (tests/unit/test_hook_share_key.py checks it is), the values read on the host
_HOOK_KEY = dict(share_by="kernel-hook", compiler_dir="/usr/bin",
                 key_parts=[("text", '{"cc":["'), ("var", "cc"), ("text", '","'), ("var", "cc_tail"),
                            ("text", '"],"cxx":null,"flags":"CC='), ("var", "cc"), ("text", " KERNEL_UNAME="),
                            ("var", "release"), ("text", '; strip --strip-debug","headers_package":"'),
                            ("var", "headers"), ("text", '","kernel_compiler":"'), ("var", "kernel_compiler"),
                            ("text", '","machine":"'), ("var", "machine"), ("text", '","release":"'),
                            ("var", "release"),
                            ("text", '","source_sha256":"' + "a" * 64 + '","version":"595.45.04"}')])
_NV_WHAT = "nvidia 595.45.04 for 6.14.11-4-pve"
_COPY = dict(key="b" * 64, source="kpro5", via={"node": "kpro5", "ip": "10.0.0.5"}, local=None, incoming=False,
             remote="tar -C /var/cache/pvegpu/kernel-share/" + "b" * 64 + " -cf - .",
             recv_root="/var/cache/pvegpu/kernel-received", what="kernel 6.14.11-4-pvegpu-pve")
_KERNEL_RECEIVE = dict(release="6.14.11-4-pvegpu-pve", build_root="/var/lib/pvegpu/kernel-build",
                       build_dir=_KERNEL["build_dir"], packages=["proxmox-kernel-6.14.11-4-pvegpu-pve",
                                                                 "proxmox-headers-6.14.11-4-pvegpu-pve"],
                       pkg_version=None, **_COPY)
SHELL_EXAMPLES: dict[str, list[dict]] = {
    # issue 41: the kernel's kept build and its copies (node to node, through the controller, its own)
    "kernel-publish.sh.j2": [
        dict(build_dir=_KERNEL["build_dir"], release="6.1.192-pvegpu", key="b" * 64,
             share_root="/var/cache/pvegpu/kernel-share",
             packages=["linux-image-6.1.192-pvegpu", "linux-headers-6.1.192-pvegpu"]),
    ],
    "kernel-receive.sh.j2": [
        _KERNEL_RECEIVE,
        {**_KERNEL_RECEIVE, "via": None, "incoming": True, "pkg_version": "1", "release": "6.1.192-pvegpu",
         "packages": ["linux-image-6.1.192-pvegpu", "linux-headers-6.1.192-pvegpu"]},
        {**_KERNEL_RECEIVE, "via": None, "local": "/var/cache/pvegpu/kernel-share/" + "b" * 64},
    ],
    "share-copy.sh.j2": [_COPY, {**_COPY, "via": None, "incoming": True}],
    "nvidia-fetch-source.sh.j2": [
        dict(url="https://github.com/NVIDIA/open-gpu-kernel-modules/archive/refs/tags/595.45.04.tar.gz",
             local=None, sha256="a" * 64, dest="/var/cache/pvegpu/sources/" + "a" * 64 + "-595.45.04.tar.gz"),
        dict(url="file:///srv/NVIDIA-Linux-x86_64-595.45.04.run", local="/srv/NVIDIA-Linux-x86_64-595.45.04.run",
             sha256="b" * 64, dest="/var/cache/pvegpu/sources/" + "b" * 64 + "-NVIDIA-Linux-x86_64-595.45.04.run"),
    ],
    "nvidia-conftest-key.sh.j2": [
        dict(archive=_BUILD["archive"], cc="gcc-12", make_args="modules CC=gcc-12", modules_dir="/lib/modules"),
    ],
    "nvidia-build.sh.j2": [
        _BUILD,
        {**_BUILD, "cxx": "g++-12", "ccache": False, "conftest_cache": False,
         "signing": ("/root/mok.key", "/root/mok.der"), "sig_hash": "sha512"},
        {**_BUILD, "release": None},  # the kernel hook's: the release in $R, set from its $1
        {**_BUILD, "release": None, "kernel_dirs": True, "conftest_cache": False},  # the kernel stage's gate
        {**_BUILD, "cxx": "g++-12", "signing": ("/root/mok.key", "/root/mok.der"), "share_key": "b" * 64,
         "share_inputs": '{"version":"595.45.04"}'},  # issue 41
    ],
    "nvidia-receive.sh.j2": [
        dict(version="595.45.04", release="6.14.11-4-pve", key="b" * 64, source="kpro5", what=_NV_WHAT,
             via={"node": "kpro5", "ip": "10.0.0.5"}, local=None, incoming=None,
             remote="tar -C /var/cache/pvegpu/nvidia-share/" + "b" * 64 + " -cf - .",
             recv_root="/var/cache/pvegpu/nvidia-received", build_root="/var/cache/pvegpu/nvidia-build",
             build_parent="/var/cache/pvegpu/nvidia-build/595.45.04", signing=("/root/mok.key", "/root/mok.der"),
             sig_hash="sha512", modules_dir="/lib/modules", sign_file="scripts/sign-file"),
        dict(version="595.45.04", release="6.14.11-4-pve", key="b" * 64, source="kpro5", what=_NV_WHAT, via=None,
             local=None,
             incoming=True, remote="tar -C /x -cf - .",
             recv_root="/var/cache/pvegpu/nvidia-received", build_root="/var/cache/pvegpu/nvidia-build",
             build_parent="/var/cache/pvegpu/nvidia-build/595.45.04", signing=None, sig_hash="sha256",
             modules_dir="/lib/modules", sign_file="scripts/sign-file"),
        dict(version="595.45.04", release="6.14.11-4-pve", key="b" * 64, source="kpro6", what=_NV_WHAT, via=None,
             local="/var/cache/pvegpu/nvidia-share/" + "b" * 64, incoming=False, remote="tar -C /x -cf - .",
             recv_root="/var/cache/pvegpu/nvidia-received", build_root="/var/cache/pvegpu/nvidia-build",
             build_parent="/var/cache/pvegpu/nvidia-build/595.45.04", signing=None, sig_hash="sha256",
             modules_dir="/lib/modules", sign_file="scripts/sign-file"),
    ],
    "kernel-postinst-nvidia.sh.j2": [
        {**_BUILD, "release": None, "sha256": "a" * 64, "state_dir": "/var/lib/pvegpu/kernel-hook",
         "pin_file": "/etc/kernel/proxmox-boot-pin", "motd_dir": "/etc/motd.d", "motd_file": "/etc/motd.d/pvegpu-kernel",
         "module_subdir": "updates/pvegpu-nvidia", "boot_dir": "/boot", "grub_cfg": "/boot/grub/grub.cfg",
         "loader_entry_prefix": "proxmox-", "grubenv": "/boot/grub/grubenv",
         "trial_pending": "/var/lib/pvegpu/kernel/trial-pending",
         "auto_removal": "/etc/kernel/postinst.d/proxmox-auto-removal",
         "esp_list": "/etc/kernel/proxmox-boot-uuids", **_HOOK_CC, "need_cxx": False, **_HOOK_KEY},
        {**_BUILD, "release": None, **_HOOK_CC, "need_cxx": True, "signing": ("/root/mok.key", "/root/mok.der"), "sha256": "a" * 64,
         "state_dir": "/var/lib/pvegpu/kernel-hook", "pin_file": "/etc/kernel/proxmox-boot-pin", "motd_dir": "/etc/motd.d",
         "motd_file": "/etc/motd.d/pvegpu-kernel", "module_subdir": "updates/pvegpu-nvidia", "boot_dir": "/boot",
         "grub_cfg": "/boot/grub/grub.cfg", "loader_entry_prefix": "proxmox-", "grubenv": "/boot/grub/grubenv",
         "trial_pending": "/var/lib/pvegpu/kernel/trial-pending",
         "auto_removal": "/etc/kernel/postinst.d/proxmox-auto-removal",
         "esp_list": "/etc/kernel/proxmox-boot-uuids", **_HOOK_KEY},
    ],
    "nvidia-share-key.sh.j2": [dict(key_parts=_HOOK_KEY["key_parts"], compiler_dir="/usr/bin", modules_dir="/lib/modules")],
    "nvidia-toolchain-pick.sh.j2": [dict(_HOOK_CC, need_cxx=True), dict(_HOOK_CC, need_cxx=False)],
    "nvidia-install.sh.j2": [
        dict(release="6.14.11-4-pve", build_parent=_BUILD["build_parent"], modules_dir="/lib/modules",
             module_subdir="updates/pvegpu-nvidia"),
        dict(release=None, build_parent=_BUILD["build_parent"], modules_dir="/lib/modules",
             module_subdir="updates/pvegpu-nvidia"),
    ],
    "nvidia-verify.sh.j2": [
        dict(version="595.45.04", releases=["6.14.11-4-pve", "6.1.0-57-amd64"], firmware=True,
             firmware_files=["gsp_ga10x.bin", "gsp_tu10x.bin"], lib_dirs=["/usr/lib/x86_64-linux-gnu", "/usr/lib"]),
        dict(version="595.45.04", releases=[], firmware=True, firmware_files=[], lib_dirs=["/usr/lib"]),
        dict(version="595.45.04", releases=["6.14.11-4-pve"], firmware=False, firmware_files=[], lib_dirs=["/usr/lib"]),
    ],
    "kernel-build.sh.j2": [
        _KERNEL,
        {**_KERNEL, "ccache": False},
        {**_KERNEL, "kind": "tarball", "url": "https://cdn.kernel.org/pub/linux/kernel/v6.x/linux-6.1.192.tar.xz",
         "sha256": "c" * 64, "ref": "", "version": "6.1.192-pvegpu", "localversion": "-pvegpu",
         "fragments": ["CONFIG_VFIO=m", "# CONFIG_DEBUG_INFO is not set"]},
        {**_KERNEL, "kind": "tarball", "url": "file:///srv/linux.tar.xz", "sha256": "c" * 64, "ccache": False,
         "base_config": "tinyconfig"},
        {**_KERNEL, "kind": "tarball", "url": "/srv/linux.tar.xz", "sha256": "c" * 64, "base_config": "/root/kconfig"},
    ],
    "rebind.sh.j2": [
        # plan.rebind.runner_script: two functions moving, guests shut down by the runner, one HA
        # resource waited for, one guest carried from an earlier transaction; then with the API
        dict(txid="2026-12-03T184001Z-kpro6", journal="/var/lib/pvegpu/rebind/journal", sysfs="/sys",
             bdfs="0000:01:00.0 0000:81:00.0",
             moves=[dict(index=0, bdf="0000:01:00.0", current="nvidia", wanted="vfio-pci", current_module="nvidia",
                         wanted_module="vfio_pci"),
                    dict(index=1, bdf="0000:81:00.0", current="vfio-pci", wanted=None, current_module="vfio_pci",
                         wanted_module="")],
             nodes=["/dev/nvidia0"], timeout_s=30,
             shutdowns=[dict(kind="lxc", gid=200, shell="pct shutdown 200 --timeout 120 || pct stop 200")],
             ha_waits=[dict(kind="qemu", gid=300, sid="vm:300", shell="qm status 300 | grep -q stopped",
                            message="VM 300 is still running: HA resource vm:300 did not stop it")],
             api_stopped=[], carried=[("lxc", 201)]),
        dict(txid="t", journal="/var/lib/pvegpu/rebind/journal", sysfs="/sys", bdfs="0000:01:00.0",
             moves=[dict(index=0, bdf="0000:01:00.0", current=None, wanted="nvidia", current_module="",
                         wanted_module="nvidia")],
             nodes=[], timeout_s=30, shutdowns=[], ha_waits=[], api_stopped=[("qemu", 300)], carried=[]),
    ],
    "kernel-zfs-guard.sh.j2": [dict(release="6.14.11-9-bpo12-pvegpu-pve")],
    "nvidia-first-error.sh.j2": [dict()],
    "root-dir.sh.j2": [dict()],
    "signing-key-check.sh.j2": [dict(key="/root/mok.pem", field="nvidia.signing.key")],
    "nvidia-toolchain-check.sh.j2": [dict(cc="gcc-12", cxx="g++-12"), dict(cc="gcc", cxx=None)],
    "kernel-nvidia-gate.sh.j2": [
        {**_BUILD, "release": None, "kernel_release": "6.14.11-9-bpo12-pvegpu-pve", "cc": "gcc", "cxx": "g++", "ccache": False,
         "conftest_cache": False, "kernel_dirs": True, "sha256": "a" * 64, "build_id": "b" * 64,
         "state_dir": "/var/lib/pvegpu/kernel/nvidia-gate", "debs_dir": _KERNEL["build_dir"],
         "headers_prefix": "proxmox-headers-6.14.11-9-bpo12-pvegpu-pve",
         "headers_root": f"{_KERNEL['build_dir']}/nvidia-gate-headers"},
        {**_BUILD, "release": None, "kernel_release": "6.1.192-pvegpu", "cc": "gcc", "cxx": None, "ccache": True,
         "conftest_cache": False, "kernel_dirs": True, "sha256": "a" * 64, "build_id": "b" * 64,
         "state_dir": "/var/lib/pvegpu/kernel/nvidia-gate", "debs_dir": _KERNEL["build_dir"],
         "headers_prefix": "linux-headers-6.1.192-pvegpu", "headers_root": f"{_KERNEL['build_dir']}/nvidia-gate-headers"},
    ],  # a function of its log alone (included by the hook and the gate)
    "kernel-sign.sh.j2": [dict(release="6.14.11-9-bpo12-pvegpu-pve", key="/root/mok.pem", cert="/root/mok.der")],
    "grub-trial-entry.sh.j2": [dict(release="6.14.11-9-bpo12-pvegpu-pve", panic_s=10)],
    "grub-esp-oneshot.sh.j2": [
        dict(mode="arm", entry="pvegpu-trial-6.14.11-9-bpo12-pve",
             keep_id="gnulinux-advanced-7f3c>gnulinux-6.14.8-2-pve-advanced-7f3c"),
        dict(mode="clear", entry="pvegpu-trial-6.14.11-9-bpo12-pve", keep_id=None),
    ],
    "mapping-merge.sh.j2": [
        dict(cfg="/etc/pve/mapping/pci.cfg", id="rtx6000", node="kpro6", tries=10, description="pvegpu-gpu-pool",
             maps=["id=10de:2bb5,iommugroup=3,node=kpro6,path=0000:81:00,subsystem-id=10de:204e"]),
        dict(cfg="/etc/pve/mapping/pci.cfg", id="pvegpu-kpro6-0000-81-00-0", node="kpro6", tries=10,
             description="", maps=[]),
    ],
    "kernel-trial-entry.sh.j2": [
        dict(release="6.14.11-9-bpo12-pve", mode="arm", entry="pvegpu-trial-6.14.11-9-bpo12-pve.conf", panic_s=10,
             keep="6.14.8-2-pve", loader_entry_prefix="proxmox-"),
        dict(release="6.14.11-9-bpo12-pve", mode="arm", entry="pvegpu-trial-6.14.11-9-bpo12-pve.conf", panic_s=10,
             keep=None, loader_entry_prefix="proxmox-"),
        dict(release="6.14.11-9-bpo12-pve", mode="clear", entry="pvegpu-trial-6.14.11-9-bpo12-pve.conf", panic_s=0,
             keep=None, loader_entry_prefix="proxmox-"),
    ],
    "host-checks-loop.sh.j2": [dict()],
    "kernel-trial-up.sh.j2": [
        dict(marker="/var/lib/pvegpu/kernel/trial-boot", up="/var/lib/pvegpu/kernel/trial-up",
             checks_file="/var/lib/pvegpu/kernel/trial-checks"),
    ],
    "kernel-build-start.sh.j2": [
        dict(build_dir=_KERNEL["build_dir"], systemd=True, unit="pvegpu-kernel-build", memory_max_kib=66 * 1024 * 1024),
        dict(build_dir=_KERNEL["build_dir"], systemd=True, unit="pvegpu-kernel-build", memory_max_kib=None),
        dict(build_dir=_KERNEL["build_dir"], systemd=False, unit="pvegpu-kernel-build", memory_max_kib=None),
    ],
    # issue 40 item 1: the 8 -> 9 upgrade job and its start (operations/upgrade.py)
    "pve-upgrade.sh.j2": [
        dict(state_dir="/var/lib/pvegpu/upgrade", unpin=True, efi_default=True,
             unset_saved=True),
        dict(state_dir="/var/lib/pvegpu/upgrade", unpin=False, efi_default=False,
             unset_saved=False),
    ],
    "pve-upgrade-start.sh.j2": [
        dict(state_dir="/var/lib/pvegpu/upgrade", lock="/var/lib/pvegpu/upgrade/lock",
             script="/var/lib/pvegpu/upgrade/upgrade.sh", unit="pvegpu-upgrade"),
    ],
}


def shell_of(script: str) -> str:
    """The dialect a rendered script names (`#!/bin/bash`, `# shellcheck shell=bash`); sh otherwise."""
    for line in script.splitlines()[:3]:
        for prefix in ("#!/bin/", "#!/usr/bin/env ", "# shellcheck shell="):
            if line.startswith(prefix):
                return "bash" if line[len(prefix):].split()[0] == "bash" else "sh"
    return "sh"


def check_shell(templates: Path = TEMPLATES, examples: dict[str, list[dict]] | None = None) -> list[str]:
    """Render every `*.sh.j2` in `templates` with its SHELL_EXAMPLES and shellcheck each result.

    Returns the findings (empty: clean); a template with no examples is a finding too."""
    examples = SHELL_EXAMPLES if examples is None else examples
    env = environment(templates)
    problems = []
    names = sorted(p.name for p in templates.glob("*.sh.j2"))
    with tempfile.TemporaryDirectory(prefix="pvegpu-shellcheck-") as tmp:
        for name in names:
            contexts = examples.get(name)
            if not contexts:
                problems.append(f"{templates / name}: no representative values in plan/render.py SHELL_EXAMPLES")
                continue
            for i, context in enumerate(contexts):
                try:
                    script = env.get_template(name).render(**context)
                except jinja2.TemplateError as err:
                    problems.append(f"{templates / name} (example {i}): does not render: {err}")
                    continue
                rendered = Path(tmp) / f"{name.removesuffix('.j2')}.{i}"
                rendered.write_text(script)
                run = subprocess.run(["shellcheck", "-s", shell_of(script), "-f", "gcc", str(rendered)],
                                     capture_output=True, text=True)
                if run.returncode != 0:
                    out = (run.stdout + run.stderr).replace(str(rendered), f"{templates / name} (example {i}, rendered)")
                    problems.append(out.rstrip())
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m plan.render", description=__doc__.split("\n\n")[0])
    parser.add_argument("--check-shell", action="store_true",
                        help="render every templates/*.sh.j2 with representative values and shellcheck it")
    parser.add_argument("--templates", type=Path, default=TEMPLATES, help="the templates dir (default: the repo's)")
    args = parser.parse_args(argv)
    if not args.check_shell:
        parser.print_help()
        return 2
    if shutil.which("shellcheck") is None:
        print("pvegpu: shellcheck is missing; run `make debs`", file=sys.stderr)
        return 1
    problems = check_shell(args.templates)
    for problem in problems:
        print(problem)
    count = len(list(args.templates.glob("*.sh.j2")))
    print(f"pvegpu: {count} shell templates in {os.path.relpath(args.templates)}: "
          + ("clean" if not problems else f"{len(problems)} finding(s)"), file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
