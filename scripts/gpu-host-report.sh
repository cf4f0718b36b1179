#!/usr/bin/env bash
# Runs pvegpu's read-only side on the machine it runs on, as a plain GPU host: every fact
# through `pyinfra @local fact`, the batched probe's command count, the host checks for the
# given inventory, and the topology report. Changes nothing on the host.
# Usage: scripts/gpu-host-report.sh OUT_DIR [INVENTORY]   (default inventory: inventories/h200-vm.py)
set -u
out=${1:?out dir}; inv=${2:-inventories/h200-vm.py}
mkdir -p "$out"
PY=${PYTHON:-python3}
pyinfra() { "$PY" -m pyinfra "$@"; }
facts="facts.gpu.GpuTopology facts.gpu.GpuP2P kind=r facts.gpu.GpuP2P kind=w facts.nvidia.NvidiaDriver
 facts.nvidia.NvidiaGpus facts.nvidia.NvidiaDriverParams facts.devices.CharDeviceMajors facts.devices.NvidiaDeviceNodes
 facts.pci.PciDevices facts.pci.PciAcs facts.kernel.KernelCmdline facts.kernel.BootLoader facts.kernel.KernelToolchain
 facts.kernel.ProxmoxKernels facts.kernel.IommuState facts.kernel.SevSnp facts.kernel.ModuleParameters module=nvidia_uvm
 facts.cpu.CpuInfo facts.proxmox.PveVersion facts.proxmox.LxcConfigs facts.hardware.HardwareProbe"
# shellcheck disable=SC2086
pyinfra -y @local fact $facts >"$out/facts.txt" 2>&1; echo "facts rc=$?"
"$PY" bench/facts_commands.py --local >"$out/facts-commands.txt" 2>&1; echo "facts_commands rc=$?"; tail -3 "$out/facts-commands.txt"
"$PY" -m pytest -q -p no:cacheprovider tests/host --inventory "$inv" -rA >"$out/host-checks.txt" 2>&1; echo "host checks rc=$?"
tail -25 "$out/host-checks.txt"
PVEGPU_TOPOLOGY_OUT="$out" pyinfra -y @local topology.py >"$out/topology-run.txt" 2>&1; echo "topology rc=$?"
ls "$out"
