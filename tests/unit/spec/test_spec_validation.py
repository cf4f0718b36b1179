"""Spec validation: every refused input gives a message naming file, host and field path."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from spec.load import SpecError, load_spec_file, validate_spec

REPO = Path(__file__).resolve().parents[3]
KPRO6 = REPO / "inventories" / "kpro6.yml"


def kpro6() -> dict:
    return yaml.safe_load(KPRO6.read_text())


def errors_of(data: dict, tmp_path: Path) -> str:
    f = tmp_path / "site.yml"
    f.write_text(yaml.safe_dump(data))
    with pytest.raises(SpecError) as exc:
        load_spec_file(f)
    msg = str(exc.value)
    assert str(f) in msg, "the message names the file"
    return msg


def test_reference_spec_is_valid():
    hosts = load_spec_file(KPRO6)
    spec = hosts["kpro6"]
    assert len(spec.gpus) == 8
    assert [g.driver for g in spec.gpus.values()].count("vfio-pci") == 4
    assert spec.containers[200].gpus == sorted(b for b, g in spec.gpus.items() if g.role == "lxc")
    assert spec.nvidia is not None
    assert spec.nvidia.version == "595.71.05" and spec.nvidia.uvm_disable_hmm is True


def test_defaults_come_from_group_data(tmp_path):
    from group_data.all import PVEGPU_DEFAULTS

    hosts = validate_spec({"hosts": {"h1": {}}}, tmp_path / "x.yml")
    assert list(hosts["h1"].iommu.params) == PVEGPU_DEFAULTS["iommu"]["params"]
    assert hosts["h1"].reboot.allowed is PVEGPU_DEFAULTS["reboot"]["allowed"]


@pytest.mark.parametrize(
    "mutate, path, words",
    [
        # malformed BDF (as a GPU key and inside a container list)
        (lambda d: d["gpus"].update({"0000:1:00.0": "lxc"}), 'hosts.kpro6.gpus["0000:1:00.0"]', "not a PCI address"),
        (lambda d: d["gpus"].update({"0000:0A:00.0": "unused"}), 'hosts.kpro6.gpus["0000:0A:00.0"]', "lowercase"),
        (lambda d: d["containers"][200]["gpus"].append("01:00.0"), "hosts.kpro6.containers[200].gpus[4]", "not a PCI address"),
        # one GPU in two containers
        (lambda d: d["containers"].update({201: {"gpus": ["0000:01:00.0"]}}), "hosts.kpro6.containers[201].gpus",
         "already given to container 200"),
        # one GPU given to a VM and to a container (two roles)
        (lambda d: d["containers"][200]["gpus"].append("0000:81:00.0"), "hosts.kpro6.containers[200].gpus",
         "has role 'vm:300'"),
        # a VM naming a GPU whose role is not its own
        (lambda d: d["vms"][300]["gpus"].append("0000:01:00.0"), "hosts.kpro6.vms[300].gpus",
         'can only use GPUs with role "vm:300"'),
        # a role naming a VM that is not declared
        (lambda d: d["gpus"].update({"0000:e1:00.0": "vm:999"}), 'hosts.kpro6.gpus["0000:e1:00.0"].role',
         "VM 999 is not declared"),
        (lambda d: d["gpus"].update({"0000:e1:00.0": "gpu-pool"}), 'hosts.kpro6.gpus["0000:e1:00.0"].role',
         "allowed: 'lxc', 'vm:<vmid>', 'host', 'unused'"),
        # CTID / VMID range
        (lambda d: d["containers"].update({99: {}}), "hosts.kpro6.containers[99]", "outside Proxmox's guest ID range 100-999999999"),
        (lambda d: d["vms"].update({1000000000: {}}), "hosts.kpro6.vms[1000000000]", "outside Proxmox's guest ID range"),
        (lambda d: d["containers"].update({300: {}}), "hosts.kpro6.vms[300]", "used by a container and a VM"),
        # more GPUs than a VM has hostpci lines (qemu-server PCI.pm: 16, hostpci0-hostpci15)
        (lambda d: (d["gpus"].update({f"0000:{b:02x}:00.0": "vm:300" for b in range(0xd0, 0xdd)}),
                    d["vms"][300]["gpus"].extend(f"0000:{b:02x}:00.0" for b in range(0xd0, 0xdd))),
         "hosts.kpro6.vms[300].gpus", "at most 16 PCI passthrough lines (hostpci0-hostpci15)"),
        # versions
        (lambda d: d["nvidia"].update(version="595.71.05-1"), "hosts.kpro6.nvidia.version", "not an NVIDIA driver version"),
        (lambda d: d["nvidia"].update(version="latest"), "hosts.kpro6.nvidia.version", "like '595.71.05'"),
        (lambda d: d["kernel"].update(version="6.14 pve"), "hosts.kpro6.kernel.version", "not a kernel release"),
        # NCCL keys
        (lambda d: d["nccl"]["overrides"].update({"P2P_DISABLE": "1"}), "hosts.kpro6.nccl.overrides", "not an NCCL variable"),
        (lambda d: d["containers"][200].update(nccl={"nccl_debug": "INFO"}), "hosts.kpro6.containers[200].nccl",
         "NCCL_* in upper case"),
        # newline / NUL (injection) anywhere a string goes
        (lambda d: d["nccl"]["overrides"].update({"NCCL_DEBUG": "INFO\nrm -rf /"}), 'hosts.kpro6.nccl.overrides["NCCL_DEBUG"]',
         "newline or NUL"),
        (lambda d: d["iommu"]["params"].append("quiet\x00x"), "hosts.kpro6.iommu.params[1]", "newline or NUL"),
        (lambda d: d["kernel"]["source"].update(ref="v1\nv2"), "hosts.kpro6.kernel.source.ref", "newline or NUL"),
        (lambda d: d["ssh"].update(hostname="kpro6\n"), "hosts.kpro6.ssh.hostname", "newline or NUL"),
        # unknown keys (typos), with what is allowed
        (lambda d: d.update(gpu={}), "hosts.kpro6.gpu", "unknown key 'gpu' (a typo?); allowed here: ssh, node"),
        (lambda d: d["nvidia"].update(uvm_disable_hmn=True), "hosts.kpro6.nvidia.uvm_disable_hmn", "allowed here: version, open"),
        (lambda d: d["gpus"].update({"0000:e1:00.0": {"role": "vm:300", "rol": "x"}}), 'hosts.kpro6.gpus["0000:e1:00.0"].rol',
         "unknown key"),
        # other things a person gets wrong
        (lambda d: d["nvidia"].update(nvreg={"EnableGpuFirmware": 1}), "hosts.kpro6.nvidia.nvreg", "NVreg_* names"),
        (lambda d: d["nvidia"]["installer"].update(sha256="abc"), "hosts.kpro6.nvidia.installer.sha256", "64 lowercase hex"),
        (lambda d: d["nvidia"]["installer"].update(sha256=0), "hosts.kpro6.nvidia.installer.sha256", "in quotes"),
        # placeholders where a digest goes (issue 28 part 5): refused at load, not at the stage-3 download
        (lambda d: d["nvidia"]["installer"].update(sha256="0" * 64), "hosts.kpro6.nvidia.installer.sha256", "is a placeholder"),
        (lambda d: d["nvidia"].update(modules_source={"url": "/root/m.tar.gz", "sha256": "deadbeef" * 8}),
         "hosts.kpro6.nvidia.modules_source.sha256", "is a placeholder"),
        (lambda d: d["nvidia"]["installer"].update(sha256="0123456789abcdef" * 4), "hosts.kpro6.nvidia.installer.sha256",
         "is a placeholder"),
        (lambda d: d["nvidia"]["installer"].update(sha256="e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"),
         "hosts.kpro6.nvidia.installer.sha256", "the sha256 of an empty file"),
        (lambda d: d.update(boot_loader="lilo"), "hosts.kpro6.boot_loader", "'auto', 'grub' or 'systemd-boot'"),
        (lambda d: d["kernel"]["source"].pop("ref"), "hosts.kpro6.kernel.source", "needs 'ref'"),
        (lambda d: d["iommu"]["params"].append("pci=realloc quiet"), "hosts.kpro6.iommu.params", "one word without spaces"),
        (lambda d: d.update(proxmox_api={"host": "127.0.0.1", "token_name": "tk"}), "hosts.kpro6.proxmox_api",
         "exactly one of 'token_env'"),
        # extra device nodes of a CT (issue 39 item 7): known names, each once, only with GPUs
        (lambda d: d["containers"][200].update(extra_devices=["nvidia-caps"]), "hosts.kpro6.containers[200].extra_devices.0",
         "'uvm-tools', 'mig-config' or 'mig-monitor'"),
        (lambda d: d["containers"][200].update(extra_devices=["uvm-tools", "uvm-tools"]),
         "hosts.kpro6.containers[200].extra_devices", "uvm-tools listed twice"),
        (lambda d: d["containers"].update({201: {"extra_devices": ["mig-config"]}}), "hosts.kpro6.containers[201]",
         "extra_devices without gpus"),
        # CT user space asked for explicitly, but nothing to install it from
        (lambda d: d["nvidia"].pop("installer"), "hosts.kpro6.containers[200].userspace_driver",
         "needs nvidia.installer"),
    ],
)
def test_invalid_input_is_refused_with_path(tmp_path, mutate, path, words):
    data = kpro6()
    mutate(data["hosts"]["kpro6"])
    msg = errors_of(data, tmp_path)
    assert "host kpro6" in msg
    lines = [line for line in msg.splitlines() if path + ":" in line]
    assert lines, f"no error for {path} in:\n{msg}"
    assert any(words in line for line in lines), f"{words!r} not in {lines}"


def test_duplicate_gpu_key_is_refused(tmp_path):
    text = KPRO6.read_text().replace('"0000:21:00.0": lxc', '"0000:01:00.0": unused', 1)
    f = tmp_path / "dup.yml"
    f.write_text(text)
    with pytest.raises(SpecError, match=r"'0000:01:00.0' appears twice \(first on line \d+\)"):
        load_spec_file(f)


def test_token_is_secret_and_never_printed(tmp_path, monkeypatch):
    data = kpro6()
    data["hosts"]["kpro6"]["proxmox_api"] = {"host": "127.0.0.1", "token_name": "pvegpu", "token_env": "PVEGPU_TEST_TOKEN"}
    monkeypatch.setenv("PVEGPU_TEST_TOKEN", "s3cr3t-token-value")
    spec = validate_spec(data, tmp_path / "x.yml")["kpro6"]
    assert spec.proxmox_api is not None
    token = spec.proxmox_api.token()
    assert token.get_secret_value() == "s3cr3t-token-value"
    assert "s3cr3t" not in repr(spec) and "s3cr3t" not in str(token) and "s3cr3t" not in spec.model_dump_json()


def _unused_loopback_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_pyinfra(tmp_path: Path, data: dict, name: str = "site") -> subprocess.CompletedProcess:
    port = _unused_loopback_port()  # nothing listens here: a connection attempt would fail loudly
    data["hosts"]["kpro6"]["ssh"] = {"hostname": "127.0.0.1", "port": port, "user": "root"}
    (tmp_path / f"{name}.yml").write_text(yaml.safe_dump(data))
    (tmp_path / f"{name}.py").write_text(
        "from pathlib import Path\nfrom spec.load import inventory_hosts\n"
        "gpu_hosts = inventory_hosts(Path(__file__).with_suffix('.yml'))\n"
    )
    pyinfra = Path(sys.executable).with_name("pyinfra")
    return subprocess.run(
        [str(pyinfra), "-y", str(tmp_path / f"{name}.py"), str(REPO / "deploy.py"), "--dry"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )


def test_invalid_spec_stops_pyinfra_before_any_connection(tmp_path):
    data = kpro6()
    data["hosts"]["kpro6"]["gpus"]["0000:01:00.0"] = "vm:300"  # role conflicts with CT 200
    proc = _run_pyinfra(tmp_path, data)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out
    assert 'hosts.kpro6.containers[200].gpus: GPU "0000:01:00.0" has role \'vm:300\'' in out
    assert "Connecting to hosts" not in out and "Could not connect" not in out and "Connection refused" not in out


def test_valid_spec_fails_on_connection_not_on_spec(tmp_path):
    proc = _run_pyinfra(tmp_path, kpro6())
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "invalid host spec" not in out
    assert "Connecting to hosts" in out and ("Could not connect" in out or "Connection refused" in out or "No hosts remaining" in out)


def test_kernel_base_config_is_a_known_target_or_a_path(tmp_path):
    data = kpro6()
    data["hosts"]["kpro6"]["kernel"]["base_config"] = "tinyconfig"
    kernel = validate_spec(data, tmp_path / "x.yml")["kpro6"].kernel
    assert kernel is not None and kernel.base_config == "tinyconfig"
    data["hosts"]["kpro6"]["kernel"]["base_config"] = "config-6.14"
    msg = errors_of(data, tmp_path)
    assert "hosts.kpro6.kernel.base_config: 'config-6.14': use 'running', 'tinyconfig'" in msg


def test_container_userspace_unset_follows_the_installer(tmp_path):
    data = kpro6()
    h = data["hosts"]["kpro6"]
    h["containers"][200].pop("userspace_driver")
    h["nvidia"].pop("installer")
    hosts = validate_spec(data, tmp_path / "x.yml")  # unset + no installer: valid, not managed
    assert hosts["kpro6"].containers[200].userspace_driver is None
