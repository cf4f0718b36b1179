"""Issue 41: the shared build's scripts run for real (fake make/modinfo/strip, real sha256sum and
tar): the builder keeps the unsigned modules and a manifest; a receiver verifies a copy before it
takes it, and refuses one that does not match, saying why (operations/build_share.py,
templates/nvidia-build.sh.j2, templates/nvidia-receive.sh.j2)."""

from __future__ import annotations

import hashlib
import subprocess
from pathlib import Path

import pytest

from operations import build_share
from operations import nvidia as ops
from tests.unit.operations.test_nvidia_ops import fake_build_tools
from tests.unit.test_shell_templates import nvidia_kernel_archive

REL, VER = "6.1.0-57-amd64", "535.309.01"
INPUTS = '{"release":"6.1.0-57-amd64","version":"535.309.01"}'  # what the key hashes (plan.build_share.inputs_text)
KEY = hashlib.sha256(INPUTS.encode()).hexdigest()


@pytest.fixture
def shared(tmp_path, monkeypatch):
    """A build published under a tmp share root: (env, share dir of KEY, tmp_path)."""
    archive = nvidia_kernel_archive(tmp_path, monkeypatch)
    env = fake_build_tools(tmp_path)
    monkeypatch.setattr(ops, "SHARE_ROOT", str(tmp_path / "share"))
    monkeypatch.setattr(build_share, "RECV_ROOT", str(tmp_path / "received"))
    (tmp_path / "tools/make").write_text("#!/bin/sh\ncd \"$2\"\nprintf 'elf %s\\n' nvidia > nvidia.ko\n"
                                         "printf 'elf %s\\n' uvm > nvidia-uvm.ko\n")
    command = ops.build_command(str(archive), VER, REL, "gcc-12", 2, ccache=False, conftest_cache=False, share_key=KEY,
                              share_inputs=INPUTS)
    done = subprocess.run(["sh", "-c", command], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr
    return env, tmp_path / "share" / KEY, tmp_path


def receive(env, tmp_path, local: Path, key: str = KEY) -> subprocess.CompletedProcess:
    command = build_share.receive_command(VER, REL, key, "kpro5", local=str(local))
    return subprocess.run(["sh", "-c", command], capture_output=True, text=True, env=env)


def test_the_builder_keeps_the_unsigned_modules_with_their_manifest(shared):
    _, share, tmp_path = shared
    manifest = (share / "manifest").read_text().splitlines()
    sums = {n: hashlib.sha256((share / n).read_bytes()).hexdigest() for n in ("nvidia.ko", "nvidia-uvm.ko")}
    assert manifest == [f"key {KEY}", "built-by converge", f"version {VER}", f"release {REL}",
                        f"vermagic {REL} SMP preempt mod_unload modversions ",  # modinfo prints the trailing space
                        f"inputs {INPUTS}",
                        f"{sums['nvidia-uvm.ko']}  nvidia-uvm.ko", f"{sums['nvidia.ko']}  nvidia.ko"]
    assert oct((share).stat().st_mode & 0o777) == "0o700" and oct((tmp_path / "share").stat().st_mode & 0o777) == "0o700"


def test_a_verified_copy_lands_where_the_install_reads_it(shared):
    env, share, tmp_path = shared
    subprocess.run(["sh", "-c", ops.cleanup_command(VER)], check=True)
    done = receive(env, tmp_path, share)
    assert done.returncode == 0, done.stderr
    assert f"nvidia {VER} for {REL} received from kpro5 and verified (key {KEY[:12]})" in done.stdout
    out = tmp_path / "build" / VER / REL / "out"
    assert {p.name: p.read_bytes() for p in out.iterdir()} == {n: (share / n).read_bytes() for n in ("nvidia.ko", "nvidia-uvm.ko")}
    assert list((tmp_path / "received").iterdir()) == []  # the scratch copy is gone


def test_node_to_node_the_copy_is_what_the_builder_keeps(shared, monkeypatch):
    """The receiver's ssh (a stand-in that runs the remote command here, as sshd would on the
    builder) gets Proxmox's options and a command that packs the kept build."""
    env, share, tmp_path = shared
    monkeypatch.setattr(build_share, "SHARE_ROOT", str(tmp_path / "share"))
    (tmp_path / "tools/ssh").write_text('#!/bin/sh\necho "$*" > "$LOG.ssh"\nfor a; do last=$a; done\nexec sh -c "$last"\n')
    (tmp_path / "tools/ssh").chmod(0o755)
    subprocess.run(["sh", "-c", ops.cleanup_command(VER)], check=True)
    command = build_share.receive_command(VER, REL, KEY, "kpro5", via={"node": "kpro5", "ip": "10.0.0.5"})
    done = subprocess.run(["sh", "-c", command], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "conftest.log.ssh").read_text().startswith(
        f"-e none -o BatchMode=yes -o HostKeyAlias=kpro5 root@10.0.0.5 tar -C {tmp_path}/share/{KEY} -cf - .")
    out = tmp_path / "build" / VER / REL / "out"
    assert sorted(p.name for p in out.iterdir()) == ["nvidia-uvm.ko", "nvidia.ko"]


@pytest.mark.parametrize("tamper, why", [
    (lambda d: (d / "nvidia-uvm.ko").write_bytes(b"elf evil\n"), "sha256 differs from its manifest: nvidia-uvm.ko: FAILED"),
    (lambda d: (d / "extra.ko").write_bytes(b"x"), "extra.ko is not in its manifest"),
    (lambda d: (d / "nvidia.ko").unlink(), "sha256 differs from its manifest: sha256sum: nvidia.ko: No such file"),
    (lambda d: (d / "manifest").write_text((d / "manifest").read_text().replace(f"version {VER}", "version 1.0")),
     f"its manifest says version '1.0', not {VER}"),
    (lambda d: (d / "manifest").unlink(), "it has no manifest"),
])
def test_a_copy_that_does_not_verify_is_refused(shared, tamper, why):
    env, share, tmp_path = shared
    tamper(share)
    done = receive(env, tmp_path, share)
    assert done.returncode == 3, (done.stdout, done.stderr)
    assert f"pvegpu: refused the copy of nvidia {VER} for {REL} from kpro5: {why}" in done.stderr


def test_a_copy_of_other_inputs_or_another_kernel_is_refused(shared):
    env, share, tmp_path = shared
    done = receive(env, tmp_path, share, key="cd" * 32)
    assert done.returncode == 3 and f"names the build key '{KEY}', not {'cd' * 32} (other inputs)" in done.stderr
    done = receive({**env, "REL": "6.12.1"}, tmp_path, share)  # modinfo says another kernel
    assert done.returncode == 3 and f"has vermagic '6.12.1 SMP preempt mod_unload modversions ', not {REL}" in done.stderr


class FakeOutput:
    def __init__(self, stdout: list[str], stderr: list[str] | None = None):
        self.stdout_lines, self.stderr_lines = stdout, stderr or []


class FakeHost:
    """A host of the run: its files by path, the shell commands it was sent."""

    def __init__(self, name: str, files: dict[str, bytes] | None = None):
        self.name, self.files = name, dict(files or {})
        self.commands: list[str] = []

    def run_shell_command(self, command):
        self.commands.append(command.get_raw_value())
        return True, FakeOutput([])

    def get_file(self, path, io):
        if path not in self.files:
            return False
        io.write(self.files[path])
        return True

    def put_file(self, io, path):
        self.files[path] = io.read()
        return True


def test_through_the_controller_only_the_manifest_and_the_modules_it_names_travel():
    share = f"/var/cache/pvegpu/nvidia-share/{KEY}"
    manifest = f"key {KEY}\nversion {VER}\nrelease {REL}\n{'1' * 64}  nvidia.ko\n{'2' * 64}  ../evil\n".encode()
    source = FakeHost("a", {f"{share}/manifest": manifest, f"{share}/nvidia.ko": b"elf", f"{share}/other": b"x"})
    target = FakeHost("b")
    incoming, why = build_share._through_controller(target, source, KEY)
    assert incoming == f"/var/cache/pvegpu/nvidia-received/{KEY}" and why == ""
    assert target.files == {f"{incoming}/manifest": manifest, f"{incoming}/nvidia.ko": b"elf"}
    assert "pvegpu_dir /var/cache/pvegpu/nvidia-received 700" in target.commands[0]
    assert target.commands[0].endswith(f"rm -rf -- {incoming} && mkdir -m 700 -- {incoming}")
    missing, why = build_share._through_controller(FakeHost("c"), FakeHost("d"), KEY)
    assert missing is None and why == f"d has no {share}/manifest"


def test_the_roles_are_decided_once_every_host_of_the_run_registered(monkeypatch):
    """`_if` conditions read the plan at execution: the builder builds, the others receive, and a
    host whose copy was refused builds after all."""
    from pyinfra.context import ctx_state

    from tests.unit.test_plan_build_share import host as plan_host

    class State:
        active_hosts = [FakeHost("a"), FakeHost("b")]

    state = State()
    monkeypatch.setattr(build_share.logger, "info", lambda line: None)
    with ctx_state.use(state):
        run = build_share._run()
        run.hosts = {"a": plan_host("a", cores=8), "b": plan_host("b")}
        assert build_share.build_if("a", REL)() and not build_share.receive_if("a", REL)()
        assert not build_share.build_if("b", REL)() and build_share.receive_if("b", REL)()
        assert not build_share.fallback_if("b", REL)()
        assert build_share.receive(state, FakeHost("b"), "595.45.04", REL, None, "sha256") is False  # a's build failed
        build_share._refuse(state, FakeHost("b"), REL, "refused")
        assert build_share.fallback_if("b", REL)()


def kept_fact(tmp_path, monkeypatch) -> dict:
    """BuildShareState's command run here over the tmp share root, parsed as the converge parses it."""
    from facts import build_share as facts_share

    monkeypatch.setattr(facts_share, "SHARE_ROOT", str(tmp_path / "share"))
    out = subprocess.run(["sh", "-c", facts_share.BuildShareState().command([REL])], capture_output=True, text=True)
    return facts_share.parse_share_state(out.stdout.splitlines())


def test_the_fact_trusts_a_kept_build_whose_key_and_modules_check(shared, monkeypatch):
    _, _, tmp_path = shared
    state = kept_fact(tmp_path, monkeypatch)
    assert state["published"] == {KEY: [REL]}
    assert state["kept"] == {KEY: {"kind": "nvidia", "version": VER, "release": REL, "built_by": "converge",
                                   "trusted": True, "why": None}}


@pytest.mark.parametrize("tamper, why", [
    (lambda d: (d / "nvidia-uvm.ko").write_bytes(b"elf evil\n"),
     "the sha256 of nvidia-uvm.ko differs from its manifest (a module was changed)"),
    (lambda d: (d / "nvidia.ko").unlink(), "the sha256 of nvidia.ko differs from its manifest (a module was changed)"),
    (lambda d: (d / "manifest").write_text((d / "manifest").read_text().replace('"535.309.01"', '"535.309.02"')),
     "its key is not the sha256 of the inputs its manifest records (the manifest was changed)"),
    (lambda d: (d / "manifest").write_text("".join(line + "\n" for line in (d / "manifest").read_text().splitlines()
                                                   if not line.startswith("inputs "))),
     "its manifest records no inputs to check its key against (kept by an older pvegpu)"),
])
def test_the_fact_does_not_trust_a_changed_kept_build(shared, monkeypatch, tamper, why):
    _, share, tmp_path = shared
    tamper(share)
    state = kept_fact(tmp_path, monkeypatch)
    assert state["published"] == {}
    assert state["kept"][KEY]["trusted"] is False and state["kept"][KEY]["why"] == why
