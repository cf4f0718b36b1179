"""Each fact's command run for real through pyinfra on this machine (`pyinfra @local fact …`):
no crash, and the data equals what the fact's parser makes of its own command's output. On a
machine without a GPU driver the GPU facts give their empty default."""

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from facts import cpu, devices, gpu, hardware, kernel, nvidia, pci, proxmox

ROOT = Path(__file__).parents[2]
PYINFRA = Path(sys.executable).parent / "pyinfra"

# (fact class, pyinfra CLI arguments)
FACTS = [
    (gpu.GpuTopology, {}), (gpu.GpuP2P, {"kind": "r"}), (gpu.GpuP2P, {"kind": "w"}),
    (nvidia.NvidiaDriver, {}), (nvidia.NvidiaGpus, {}), (nvidia.NvidiaDriverParams, {}),
    (devices.CharDeviceMajors, {}), (devices.NvidiaDeviceNodes, {}),
    (pci.PciDevices, {}), (pci.PciAcs, {}),
    (kernel.KernelCmdline, {}), (kernel.BootLoader, {}), (kernel.KernelToolchain, {}),
    (kernel.ProxmoxKernels, {}), (kernel.IommuState, {}), (kernel.SevSnp, {}),
    (kernel.ModuleParameters, {"module": "nvidia_uvm"}), (cpu.CpuInfo, {}),
    (proxmox.PveVersion, {}), (proxmox.LxcConfigs, {}), (proxmox.QemuConfigs, {}), (proxmox.PciMappings, {}),
    (hardware.HardwareProbe, {}), (hardware.HostConfigProbe, {}),
]
NO_GPU_DEFAULTS = [gpu.GpuTopology, gpu.GpuP2P, nvidia.NvidiaGpus, nvidia.NvidiaDriverParams]


def _name(fact_class) -> str:
    return f"{fact_class.__module__}.{fact_class.__name__}"


def _label(fact_class, kwargs) -> str:
    args = ", ".join(f"{k}={v}" for k, v in kwargs.items())
    return _name(fact_class) + (f" ({args})" if args else "")


@pytest.fixture(scope="module")
def local_facts() -> dict:
    """All facts in one `pyinfra @local fact` run: {"facts.gpu.GpuP2P (kind=r)": data}."""
    argv = [str(PYINFRA), "@local", "fact"]
    for fact_class, kwargs in FACTS:
        argv += [_name(fact_class)] + [f"{k}={v}" for k, v in kwargs.items()]
    run = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    results = {}
    for block in (run.stdout + run.stderr).split("--> Fact data for: ")[1:]:  # pyinfra logs to stderr
        label, _, rest = block.partition("\n")
        body = rest.split("\n--> ", 1)[0]
        results[label.strip()] = json.loads(body)["@local"]
    return results


def test_every_fact_ran(local_facts):
    assert set(local_facts) == {_label(f, k) for f, k in FACTS}


@pytest.mark.parametrize("fact_class,kwargs", FACTS, ids=lambda v: v.__name__ if isinstance(v, type) else str(v))
def test_fact_through_pyinfra_equals_its_parser_on_its_own_output(local_facts, fact_class, kwargs):
    fact = fact_class()
    command = fact.command(**kwargs) if callable(fact.command) else fact.command
    required = fact.requires_command(**kwargs)
    if required and not shutil.which(required):
        expected = fact.default()
    else:
        lines = subprocess.run(["sh", "-c", str(command)], capture_output=True, text=True).stdout.splitlines()
        expected = fact.process(lines) if lines else fact.default()
    assert local_facts[_label(fact_class, kwargs)] == json.loads(json.dumps(expected))


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None or Path("/proc/driver/nvidia").exists(),
                    reason="this machine has an NVIDIA driver")
@pytest.mark.parametrize("fact_class", NO_GPU_DEFAULTS, ids=lambda c: c.__name__)
def test_gpu_facts_give_their_empty_default_without_a_driver(local_facts, fact_class):
    for label, data in local_facts.items():
        if re.match(re.escape(_name(fact_class)) + r"( \(|$)", label):
            assert data == json.loads(json.dumps(fact_class().default()))
    assert local_facts[_name(nvidia.NvidiaDriver)] is None
