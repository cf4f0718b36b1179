#!/usr/bin/env bash
# Records, read-only, every output pvegpu's facts read on a GPU host, into a folder
# (one file per output, with the two header lines tests/fixtures/ uses).
# Usage: scripts/record-gpu-host.sh <out-dir> "<machine description>"
# Each command is a single-quoted string on purpose: rec runs it with `bash -c` on the GPU host.
# shellcheck disable=SC2016
set -u
out=${1:?out dir}; machine=${2:-unknown}
mkdir -p "$out"
rec() {  # rec <file> <command...>
  local f=$out/$1; shift
  { echo "# source: recorded by pvegpu scripts/record-gpu-host.sh on $(date -u +%Y-%m-%d): $*"
    echo "# machine: $machine"
    bash -c "$*" 2>&1; } >"$f"
}
rec topo-m.txt 'nvidia-smi topo -m'
for k in r w n a p; do rec "topo-p2p-$k.txt" "nvidia-smi topo -p2p $k"; done
rec nvidia-smi-L.txt 'nvidia-smi -L'
rec nvidia-smi.txt 'nvidia-smi'
rec nvidia-smi-q.txt 'nvidia-smi -q'
rec query-gpu.txt 'nvidia-smi --query-gpu=index,name,pci.bus_id,uuid,driver_version,memory.total,serial,vbios_version --format=csv'
rec query-gpu-noheader.txt 'nvidia-smi --query-gpu=index,pci.bus_id,uuid --format=csv,noheader,nounits'
rec query-compute-apps.txt 'nvidia-smi --query-compute-apps=gpu_bus_id,pid,process_name --format=csv,noheader'
rec driver-version.txt 'cat /proc/driver/nvidia/version'
rec driver-gpus-information.txt 'for f in /proc/driver/nvidia/gpus/*/information; do echo "== $f"; cat "$f"; done'
rec driver-params.txt 'cat /proc/driver/nvidia/params'
rec proc-devices.txt 'cat /proc/devices'
rec ls-dev-nvidia.txt 'ls -l /dev/nvidia* /dev/nvidia-caps 2>&1'
# what facts.devices NvidiaDeviceNodes runs (stat's own format: no locale or TIME_STYLE in it), in the
# session's environment and in a German one with another time style (issue 43 item 2)
rec stat-dev-nvidia.txt "stat -c '%f %t %T %n' -- /dev/nvidia* /dev/nvidia*/* 2>/dev/null; true"
rec stat-dev-nvidia-de.txt "LANG=de_DE.UTF-8 LC_ALL=de_DE.UTF-8 TIME_STYLE=long-iso stat -c '%f %t %T %n' -- /dev/nvidia* /dev/nvidia*/* 2>/dev/null; true"
rec secure-boot.txt 'mokutil --sb-state 2>&1; bootctl status 2>&1 | head -20; ls /sys/firmware/efi/efivars 2>&1 | head -5'
rec proc-cmdline.txt 'cat /proc/cmdline'
rec proc-version.txt 'cat /proc/version'
rec cpuinfo-first.txt "awk 'BEGIN{RS=\"\"} NR==1' /proc/cpuinfo"
rec meminfo.txt 'cat /proc/meminfo'
rec uname.txt 'uname -a; cat /etc/os-release'
rec proc-modules.txt 'cat /proc/modules'
rec uvm-params.txt 'grep -H . /sys/module/nvidia_uvm/parameters/* 2>&1'
rec nvidia-module-params.txt 'grep -H . /sys/module/nvidia/parameters/* 2>&1 | head -100'
rec iommu-groups.txt 'ls -la /sys/kernel/iommu_groups 2>&1; for t in /sys/kernel/iommu_groups/*/type; do echo "$t: $(cat $t)"; done 2>&1'
rec sev.txt 'grep -H . /sys/module/kvm_amd/parameters/sev* 2>&1; grep -o -w -E "sev|sev_es|sev_snp" /proc/cpuinfo | sort | uniq -c'
rec lspci-vvv.txt 'lspci -vvv 2>&1 | head -400'
rec modinfo-nvidia.txt 'modinfo nvidia 2>&1 | head -40'
# sysfs: every PCI device, attributes and links, in one listing
rec sysfs-pci.txt 'for d in /sys/bus/pci/devices/*; do echo "== $(basename $d) -> $(readlink -f $d)"; for a in vendor device subsystem_vendor subsystem_device class revision numa_node local_cpulist current_link_speed current_link_width max_link_speed max_link_width enable irq; do [ -r $d/$a ] && echo "$a: $(cat $d/$a 2>&1)"; done; for l in driver iommu_group physfn; do [ -e $d/$l ] && echo "$l -> $(readlink $d/$l)"; done; echo "resource:"; cat $d/resource 2>&1; done'
rec sysfs-pci-tree.txt 'ls -l /sys/bus/pci/devices/; ls /sys/devices/ | grep pci; find /sys/devices/pci* -maxdepth 3 -name "0000:*" 2>/dev/null'
rec torch-peer.txt "python3 -c 'import torch; n=torch.cuda.device_count(); print(\"devices\", n); [print(i, j, torch.cuda.can_device_access_peer(i, j)) for i in range(n) for j in range(n) if i != j]'"
