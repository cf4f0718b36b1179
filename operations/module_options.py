"""Stage 4 — module options and device nodes at boot (DESIGN.md §2.4; incidents 3, 5).

Writes, from templates:
    /etc/modprobe.d/pvegpu-nvidia.conf            `options nvidia_uvm uvm_disable_hmm=1` (spec, or
                                                   auto: on for Blackwell), `options nvidia NVreg_…`
    /etc/systemd/system/pvegpu-nvidia-nodes.service  oneshot `nvidia-modprobe -u -c=0` + `nvidia-smi -L`,
                                                   ordered before pve-guests.service, enabled by its
                                                   multi-user.target wants link
Then: the initramfs is rebuilt once at the end of the run when the options file changed
(`operations.handlers`, INITRAMFS), and a reboot reason when
the loaded modules run with other values than the file sets (the reboot stage decides; a module
reload is left to a person because it needs every GPU client stopped).

No-change cost: the shared HardwareProbe and one ManagedFiles (files + the wants link).
"""

from __future__ import annotations

from pyinfra.api import deploy

from facts.files import ManagedFiles
from facts.hardware import HardwareProbe
from facts.once import fact_once
from facts.run_state import need_reboot
from operations import handlers
from operations.files import file_current, link_unit, managed_file
from plan import nvidia as nvplan

MODPROBE_CONF = "/etc/modprobe.d/pvegpu-nvidia.conf"
NODES_UNIT_NAME = "pvegpu-nvidia-nodes.service"
NODES_UNIT = f"/etc/systemd/system/{NODES_UNIT_NAME}"
NODES_WANTS_LINK = f"/etc/systemd/system/multi-user.target.wants/{NODES_UNIT_NAME}"
# read in one fact: the stage's files and the unit's wants link
STAGE_FILES = [MODPROBE_CONF, NODES_UNIT, NODES_WANTS_LINK]


def loaded_differences(disable_hmm: bool, nvreg: dict, uvm_params: dict, nvidia_params: dict) -> list[str]:
    """Options the loaded modules run with that differ from the file (empty when not loaded).

    uvm_params: /sys/module/nvidia_uvm/parameters ({"uvm_disable_hmm": "N", …});
    nvidia_params: /proc/driver/nvidia/params, names without the NVreg_ prefix.
    """
    differences = []
    current = uvm_params.get("uvm_disable_hmm")
    want = "Y" if disable_hmm else "N"
    if current is not None and current != want:
        differences.append(f"nvidia_uvm runs with uvm_disable_hmm={current}, {MODPROBE_CONF} sets {want}")
    for key, value in sorted(nvreg.items()):
        loaded = nvidia_params.get(key[len("NVreg_"):])
        if loaded is not None and loaded.strip('"') != str(value):
            differences.append(f"nvidia runs with {key}={loaded}, {MODPROBE_CONF} sets {value}")
    return differences


def desired(spec, hardware: dict) -> dict:
    """The files and reasons for this host: {"conf", "unit", "disable_hmm", "hmm_reason"}."""
    nv = spec.nvidia
    gpu_ids = nvplan.nvidia_gpu_ids(hardware.get("pci_devices") or {})
    models = {bdf: gpu.get("model") or "" for bdf, gpu in (hardware.get("nvidia_gpus") or {}).items()}
    disable_hmm, reason = nvplan.uvm_disable_hmm(nv.uvm_disable_hmm, gpu_ids, models)
    return {
        "conf": nvplan.render_modprobe_conf(disable_hmm, reason, dict(nv.nvreg)),
        "unit": nvplan.render_nodes_unit(),
        "disable_hmm": disable_hmm,
        "hmm_reason": reason,
    }


def prefetch(spec) -> list:
    """The facts this stage reads (deploy.py reads every stage's in one command)."""
    if spec.nvidia is None:
        return []
    return [(HardwareProbe, {}), (ManagedFiles, {"paths": STAGE_FILES})]


def preflight(spec) -> list[str]:
    if spec.nvidia is None:
        return []
    refusals = []
    for key, value in spec.nvidia.nvreg.items():
        try:
            nvplan.modprobe_value(value)
        except ValueError as error:
            refusals.append(f"nvidia.nvreg.{key}: {error}")
    return refusals


@deploy("Module options")
def apply(spec) -> None:
    if spec.nvidia is None:
        return
    hardware = fact_once(HardwareProbe)
    want = desired(spec, hardware)
    # one command for the stage's files and the unit's wants link
    files = fact_once(ManagedFiles, paths=STAGE_FILES)
    conf_state = files.get(MODPROBE_CONF)
    conf_changed = not file_current(conf_state, want["conf"], "644")
    managed_file(name=f"NVIDIA module options ({want['hmm_reason']})", path=MODPROBE_CONF,
                 content=want["conf"], mode="644", state=conf_state)
    managed_file(name="Unit creating /dev/nvidia-uvm* before guests", path=NODES_UNIT,
                 content=want["unit"], mode="644", state=files.get(NODES_UNIT))
    handlers.depends_on(handlers.DAEMON_RELOAD, NODES_UNIT, want["unit"], "644",
                        changed=not file_current(files.get(NODES_UNIT), want["unit"], "644"),
                        why=f"{NODES_UNIT_NAME} changed")
    link_unit(name=f"Enable {NODES_UNIT_NAME}", link=NODES_WANTS_LINK, target=NODES_UNIT,
              current=(files.get(NODES_WANTS_LINK) or {}).get("link"))
    handlers.depends_on(handlers.INITRAMFS, MODPROBE_CONF, want["conf"], "644", changed=conf_changed,
                        why=f"{MODPROBE_CONF} changed (module options)")
    for detail in loaded_differences(want["disable_hmm"], dict(spec.nvidia.nvreg),
                                     hardware.get("uvm_params") or {}, hardware.get("nvidia_params") or {}):
        need_reboot("module options", detail)
