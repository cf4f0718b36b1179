"""GPU topology report, read-only:

    pyinfra inventories/kpro6.py topology.py      # hosts of an inventory (their spec gives GPU roles)
    pyinfra @local topology.py                    # this machine

For each host: reads the hardware facts (one batched remote command, plus the list of RDMA
devices, plus, when a GPU is not on the host's NVIDIA driver, its name in the host's PCI ID
database), and writes on this machine, under out/topology/, `<host>.txt` (root complexes,
bridges, GPUs, NICs, links, BAR1, the P2P verdict per GPU pair with its reasons, the NCCL
variables pvegpu would set) and `<host>.svg` (the same as a diagram: the PCI tree with each
GPU's name, driver, role, NUMA node and CPUs, and under it the P2P matrix, a cell per GPU pair
coloured by verdict, the reasons as its tooltip), then prints the text.
PVEGPU_TOPOLOGY_OUT=<dir> writes elsewhere.
It queues no operation: nothing on the host changes.
"""

import os
import re
from pathlib import Path

import graphviz
from pyinfra import host
from pyinfra.facts.files import FindLinks

from facts.hardware import HardwareProbe
from facts.once import read_fact
from facts.pci import PciIdNames
from plan.nccl import nccl_environment, nccl_plan_for_spec
from plan.topology_report import topology_dot, topology_text, verdict_from_hardware

OUT = Path(os.environ.get("PVEGPU_TOPOLOGY_OUT") or Path(__file__).resolve().parent / "out" / "topology")

hardware = read_fact(HardwareProbe)
# GPUs the driver does not name (bound to vfio-pci, or to none): their IDs in the host's pci.ids
unnamed = sorted({f"{dev['vendor']}:{dev['device']}" for bdf, dev in (hardware.get("pci_devices") or {}).items()
                  if dev.get("vendor") == "10de" and (dev.get("class") or "").startswith("03") and dev.get("device")
                  and bdf not in (hardware.get("nvidia_gpus") or {})})
if unnamed:
    hardware = {**hardware, "pci_names": read_fact(PciIdNames, ids=unnamed)}
rdma_devices = sorted(Path(link).name for link in read_fact(FindLinks, path="/sys/class/infiniband", maxdepth=1) or [])
spec = host.data.get("pvegpu_spec")
roles = {bdf: gpu.role for bdf, gpu in spec.gpus.items()} if spec else None
verdict = verdict_from_hardware(hardware, roles)
topology_nics = (hardware.get("topology") or {}).get("nics")
if spec:
    nccl_env = nccl_plan_for_spec(verdict, spec, rdma_devices=rdma_devices, topology_nics=topology_nics)["host"]
else:
    nccl_env = nccl_environment(verdict, rdma_devices=rdma_devices, topology_nics=topology_nics)

# Plain file writes: a deploy file runs inside the pyinfra process, on this machine.
OUT.mkdir(parents=True, exist_ok=True)
stem = re.sub(r"[^0-9A-Za-z@._-]", "_", host.name)
text = topology_text(host.name, hardware, verdict, nccl_env)
(OUT / f"{stem}.txt").write_text(text)
dot_source = topology_dot(host.name, hardware, verdict)
try:
    (OUT / f"{stem}.svg").write_bytes(graphviz.Source(dot_source).pipe(format="svg"))
    diagram = f"{OUT / stem}.svg"
except graphviz.ExecutableNotFound:  # no Graphviz `dot` here (seen on the GPU machine): keep the source
    (OUT / f"{stem}.dot").write_text(dot_source)
    diagram = f"{OUT / stem}.dot (Graphviz `dot` is not installed; render it with: dot -Tsvg -O {OUT / stem}.dot)"
print(text)
print(f"Written: {OUT / stem}.txt and {diagram}")
