"""Issue 41, the kernel half: the kernel stage's shared build runs for real (real dpkg-deb .debs,
sha256sum, tar): the builder keeps the .debs it installs with the build's manifest.json and a
manifest of their sha256 (templates/kernel-publish.sh.j2); a receiver verifies a copy before it puts
it where its own build would leave it (templates/kernel-receive.sh.j2, share-copy.sh.j2), and refuses
one that does not match, saying why (operations/kernel.py publish_command, receive_command)."""

from __future__ import annotations

import hashlib
import subprocess
from pathlib import Path

import pytest

from operations import build_share
from operations import kernel as ops
from plan import kernel as plan

REL = "6.1.192-pvegpu-ci"
KEY = "cd" * 32
IMAGE, HEADERS = f"linux-image-{REL}_1_amd64.deb", f"linux-headers-{REL}_1_amd64.deb"


def deb(directory: Path, package: str, version: str = "1", file_name: str | None = None) -> Path:
    """A real .deb (dpkg-deb --build) of `package` at `version`, named as bindeb-pkg names its own."""
    tree = directory / f"tree-{package}"
    (tree / "DEBIAN").mkdir(parents=True)
    (tree / "DEBIAN/control").write_text(f"Package: {package}\nVersion: {version}\nArchitecture: amd64\n"
                                         "Maintainer: t <t@t>\nDescription: t\n")
    (tree / "boot").mkdir()
    (tree / "boot" / package).write_text(f"{package} {version}\n")
    out = directory / (file_name or f"{package}_{version}_amd64.deb")
    subprocess.run(["dpkg-deb", "--root-owner-group", "-Zgzip", "--build", str(tree), str(out)], check=True,
                   capture_output=True)
    subprocess.run(["rm", "-rf", str(tree)], check=True)
    return out


@pytest.fixture
def kept(tmp_path, monkeypatch):
    """A finished build published under a tmp share root: (its build dir, the kept dir of KEY)."""
    tmp_path.chmod(0o755)
    monkeypatch.setattr(ops, "KERNEL_SHARE_ROOT", str(tmp_path / "share"))
    monkeypatch.setattr(build_share, "KERNEL_SHARE_ROOT", str(tmp_path / "share"))
    monkeypatch.setattr(build_share, "KERNEL_RECV_ROOT", str(tmp_path / "received"))
    monkeypatch.setattr(plan, "BUILD_ROOT", str(tmp_path / "build"))
    built = tmp_path / "builder"
    built.mkdir(mode=0o700)
    deb(built, f"linux-image-{REL}")
    deb(built, f"linux-headers-{REL}")
    deb(built, "linux-libc-dev")  # bindeb-pkg makes it too; the stage installs it nowhere
    (built / "manifest.json").write_text('{"build_id": "x", "compiler": "gcc (Debian 12.2.0-14) 12.2.0"}\n')
    (built / "build.rc").write_text("0\n")
    done = subprocess.run(["sh", "-c", ops.publish_command(str(built), "tarball", REL, KEY)], capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stderr
    return built, tmp_path / "share" / KEY


def flip(path: Path) -> None:
    """One byte of the file changed (as the e2e tampers with a kept copy)."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def receive(tmp_path: Path, local: Path | None = None, key: str = KEY, via: dict | None = None,
            env: dict | None = None) -> subprocess.CompletedProcess:
    command = ops.receive_command("tarball", REL, str(tmp_path / "build" / "mine"), key, "kpro5",
                                  local=str(local) if local else None, via=via)
    return subprocess.run(["sh", "-c", command], capture_output=True, text=True, env=env)


def test_the_builder_keeps_the_debs_it_installs_with_their_sha256(kept):
    built, share = kept
    sums = {n: hashlib.sha256((built / n).read_bytes()).hexdigest() for n in (HEADERS, IMAGE, "manifest.json")}
    assert (share / "manifest").read_text().splitlines() == [
        f"key {KEY}", f"release {REL}", f"{sums[HEADERS]}  {HEADERS}", f"{sums[IMAGE]}  {IMAGE}",
        f"{sums['manifest.json']}  manifest.json"]
    assert sorted(p.name for p in share.iterdir()) == sorted([HEADERS, IMAGE, "manifest", "manifest.json"])
    assert oct(share.stat().st_mode & 0o777) == "0o700" and oct(share.parent.stat().st_mode & 0o777) == "0o700"


def test_a_build_that_did_not_finish_is_not_kept(kept, tmp_path):
    built, _ = kept
    (built / "build.rc").write_text("2\n")
    done = subprocess.run(["sh", "-c", ops.publish_command(str(built), "tarball", REL, "ef" * 32)],
                          capture_output=True, text=True)
    assert done.returncode == 1 and f"no finished build of kernel {REL}" in done.stderr
    assert not (tmp_path / "share" / ("ef" * 32)).exists()


def test_a_verified_copy_lands_where_the_stage_installs_its_own_build(kept, tmp_path):
    built, share = kept
    done = receive(tmp_path, share)
    assert done.returncode == 0, done.stderr
    assert f"pvegpu: kernel {REL} received from kpro5 and verified (key {KEY[:12]})" in done.stdout
    mine = tmp_path / "build" / "mine"
    assert {p.name: p.read_bytes() for p in mine.iterdir()} == {
        **{n: (built / n).read_bytes() for n in (IMAGE, HEADERS, "manifest.json")}, "build.rc": b"0\n"}
    assert oct(mine.stat().st_mode & 0o777) == "0o700"
    assert list((tmp_path / "received").iterdir()) == []  # the scratch copy is gone
    # the stage's install reads them by its own globs
    assert all(list(mine.glob(g)) for g in plan.package_globs("tarball", REL))


@pytest.mark.parametrize("change, why", [
    (lambda s: flip(s / IMAGE),
     f"sha256 differs from its manifest: {IMAGE}: FAILED"),
    (lambda s: s.joinpath("extra.deb").write_text("x"), "extra.deb is not in its manifest"),
    (lambda s: s.joinpath("manifest").write_text(s.joinpath("manifest").read_text().replace(f"release {REL}",
                                                                                          "release 6.1.0-1-amd64")),
     f"its manifest says release '6.1.0-1-amd64', not {REL}"),
    (lambda s: s.joinpath("manifest").write_text(s.joinpath("manifest").read_text().replace(f"key {KEY}",
                                                                                          f"key {'ef' * 32}")),
     f"its manifest names the build key '{'ef' * 32}', not {KEY} (other inputs)"),
])
def test_a_copy_that_does_not_verify_is_refused_and_nothing_lands(kept, tmp_path, change, why):
    _, share = kept
    change(share)
    done = receive(tmp_path, share)
    assert done.returncode == 3, done.stderr
    assert done.stderr.startswith(f"pvegpu: refused the copy of kernel {REL} from kpro5: {why}"), done.stderr
    assert not any((tmp_path / "build" / "mine").glob("*.deb"))


def resign(share: Path, drop: str | None = None) -> None:
    """Rewrite the kept manifest over what the dir holds now (a builder whose manifest agrees with
    bad packages: only the packages' own checks can refuse them)."""
    names = sorted(p.name for p in share.iterdir() if p.name not in ("manifest", drop))
    if drop:
        share.joinpath(drop).unlink()
    sums = [f"{hashlib.sha256(share.joinpath(n).read_bytes()).hexdigest()}  {n}" for n in names]
    share.joinpath("manifest").write_text("\n".join([f"key {KEY}", f"release {REL}", *sums]) + "\n")


def test_packages_the_key_does_not_imply_are_refused(kept, tmp_path):
    _, share = kept
    resign(share, drop=HEADERS)
    done = receive(tmp_path, share)
    assert done.returncode == 3 and f"it has no linux-headers-{REL}_*.deb" in done.stderr
    # another version than the build's KDEB_PKGVERSION, its manifest agreeing
    deb(share, f"linux-headers-{REL}", version="2")
    resign(share)
    done = receive(tmp_path, share)
    assert done.returncode == 3 and f"linux-headers-{REL}_2_amd64.deb is version '2', not 1" in done.stderr
    # a .deb whose name is not the package it holds
    share.joinpath(f"linux-headers-{REL}_2_amd64.deb").unlink()
    deb(share, "openssh-server", file_name=HEADERS)
    resign(share)
    done = receive(tmp_path, share)
    assert done.returncode == 3 and f"{HEADERS} holds package 'openssh-server'" in done.stderr


def test_node_to_node_the_copy_is_what_the_builder_keeps(kept, tmp_path):
    """The receiver's ssh (a stand-in running the remote command here, as sshd would on the
    builder) gets Proxmox's options and a command that packs the kept build."""
    _, share = kept
    tools = tmp_path / "tools"
    tools.mkdir()
    (tools / "ssh").write_text(f'#!/bin/sh\necho "$*" > {tmp_path}/ssh.log\nfor a; do last=$a; done\nexec sh -c "$last"\n')
    (tools / "ssh").chmod(0o755)
    import os
    env = {**os.environ, "PATH": f"{tools}:{os.environ['PATH']}"}
    done = receive(tmp_path, via={"node": "kpro5", "ip": "10.0.0.5"}, env=env)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "ssh.log").read_text().startswith(
        f"-e none -o BatchMode=yes -o HostKeyAlias=kpro5 root@10.0.0.5 tar -C {share} -cf - .")
    assert sorted(p.name for p in (tmp_path / "build" / "mine").iterdir()) == sorted(
        [HEADERS, IMAGE, "build.rc", "manifest.json"])


def test_the_kernel_and_nvidia_sharing_of_one_run_are_kept_apart():
    """Both stages share builds of one release (the new kernel's .debs, the modules for it): the
    run's registry is one per kind, or a receiver of one would take the other's step."""
    state = object()
    assert build_share._run(state, "kernel") is not build_share._run(state, "nvidia")
    assert build_share._run(state, "kernel") is build_share._run(state, "kernel")


def test_the_share_fact_reads_the_kernel_builds_compiler_and_base_config(tmp_path):
    """BuildShareState with kernel_base, run here: gcc's first --version line (what the build's
    manifest records) and the base config file's sha256; a make target has none; without
    kernel_base neither is read (the NVIDIA stage's fact as before)."""
    from facts.build_share import BuildShareState, parse_share_state

    config = tmp_path / "kconfig"
    config.write_text("CONFIG_64BIT=y\n")
    gcc = subprocess.run(["sh", "-c", "gcc --version | head -n 1"], capture_output=True, text=True).stdout.strip()

    def read(*args) -> dict:
        out = subprocess.run(["sh", "-c", BuildShareState().command(*args)], capture_output=True, text=True).stdout
        return parse_share_state(out.splitlines())

    state = read([], str(config))
    assert state["gcc"] == (gcc or None)
    assert state["base_config_sha256"] == hashlib.sha256(config.read_bytes()).hexdigest()
    assert read([], "tinyconfig")["base_config_sha256"] is None
    assert "gcc" not in read(["6.1.0-57-amd64"]) and "base_config_sha256" not in read(["6.1.0-57-amd64"])


def test_through_the_controller_the_manifest_and_the_debs_it_names_travel():
    from tests.unit.operations.test_build_share_ops import FakeHost

    share = f"/var/cache/pvegpu/kernel-share/{KEY}"
    manifest = (f"key {KEY}\nrelease {REL}\n{'1' * 64}  {IMAGE}\n{'2' * 64}  manifest.json\n{'3' * 64}  ../evil.deb\n"
                f"{'4' * 64}  nvidia.ko\n").encode()
    source = FakeHost("a", {f"{share}/manifest": manifest, f"{share}/{IMAGE}": b"deb", f"{share}/manifest.json": b"{}",
                            f"{share}/other.deb": b"x"})
    target = FakeHost("b")
    incoming, why = build_share._through_controller(target, source, KEY, "kernel")
    assert incoming == f"/var/cache/pvegpu/kernel-received/{KEY}" and why == ""
    assert target.files == {f"{incoming}/manifest": manifest, f"{incoming}/{IMAGE}": b"deb",
                            f"{incoming}/manifest.json": b"{}"}
    assert "pvegpu_dir /var/cache/pvegpu/kernel-received 700" in target.commands[0]


def test_the_kernel_roles_are_decided_at_execution_and_a_refusal_builds_here(monkeypatch):
    """The kernel stage's `_if` conditions: the builder builds, the other receives (the NVIDIA
    registry of the same run untouched); a failed build fails its receiver; a refused copy builds."""
    from pyinfra.context import ctx_state

    from tests.unit.operations.test_build_share_ops import FakeHost
    from tests.unit.test_plan_build_share import KREL, k_host

    class State:
        active_hosts = [FakeHost("a"), FakeHost("b")]

    state = State()
    monkeypatch.setattr(build_share.logger, "info", lambda line: None)
    monkeypatch.setattr(build_share.logger, "error", lambda line: None)
    with ctx_state.use(state):
        run = build_share._run(kind="kernel")
        run.hosts = {"a": k_host("a", cores=8), "b": k_host("b")}
        assert build_share.build_if("a", KREL, "kernel")() and not build_share.receive_if("a", KREL, "kernel")()
        assert not build_share.build_if("b", KREL, "kernel")() and build_share.receive_if("b", KREL, "kernel")()
        assert build_share.build_if("b", KREL)()  # no NVIDIA step for it: the NVIDIA stage builds as alone
        assert ops.receive(state, FakeHost("b"), "tarball", KREL, "/x") is False  # a's build did not succeed
        build_share.mark_built(state, FakeHost("a"), run.hosts["a"]["builds"][KREL]["key"], "kernel")
        target = FakeHost("b")
        assert ops.receive(state, target, "tarball", KREL, "/x") is True  # the copy ran (the fake host says ok)
        assert f"root@10.0.0.1 'tar -C /var/cache/pvegpu/kernel-share/{run.hosts['a']['builds'][KREL]['key']}" \
            in target.commands[0]
        build_share._refuse(state, FakeHost("b"), KREL, "refused", "kernel")
        assert build_share.fallback_if("b", KREL, "kernel")() and not build_share.fallback_if("b", KREL)()
