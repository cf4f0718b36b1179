"""A deploy that runs only some stages (for stage end-to-end tests on twins).

    PVEGPU_STAGES=operations.boot,operations.reboot pyinfra -y inventories/twin.py tests/e2e/stage_deploy.py

Same protocol as deploy.py (all preflights, then the applies, in the given order). The handlers
stage (operations.handlers: the initramfs and boot-loader refresh the stages asked for, once)
runs as in deploy.py: before operations.reboot, else last, unless the list names it.
PVEGPU_E2E_KERNEL (JSON of a KernelSpec, e.g. with base_config "tinyconfig") replaces the host
spec's kernel: CI builds a tiny config of Debian's 6.1 source instead of a Proxmox kernel.
PVEGPU_E2E_IOMMU_PT=1 turns on iommu.passthrough (to see the SEV-SNP refusal);
PVEGPU_E2E_NO_REBOOT=1 turns reboot.allowed off (to see the state before the reboot).
"""

import importlib
import json
import os

from pyinfra import host
from pyinfra.api.exceptions import DeployError

from facts.run_state import run_state
from spec.models import KernelSpec

spec = host.data.get("pvegpu_spec")
kernel_json = os.environ.get("PVEGPU_E2E_KERNEL")
if kernel_json:
    spec = spec.model_copy(update={"kernel": KernelSpec(**json.loads(kernel_json))})

if os.environ.get("PVEGPU_E2E_NO_REBOOT"):
    spec = spec.model_copy(update={"reboot": spec.reboot.model_copy(update={"allowed": False})})
if os.environ.get("PVEGPU_E2E_IOMMU_PT"):
    spec = spec.model_copy(update={"iommu": spec.iommu.model_copy(update={"passthrough": True})})

names = [m for m in os.environ["PVEGPU_STAGES"].split(",") if m]
if "operations.handlers" not in names:
    names.insert(names.index("operations.reboot") if "operations.reboot" in names else len(names), "operations.handlers")
modules = [importlib.import_module(m) for m in names]
refusals = [r for m in modules if hasattr(m, "preflight") for r in m.preflight(spec)]
if refusals:
    raise DeployError("preflight refused:\n  - " + "\n  - ".join(refusals))
for m in modules:
    m.apply(spec)
if run_state().rebooting:  # as deploy.py: the stages with an after_reboot plan again once it is back
    for m in modules:
        if hasattr(m, "after_reboot"):
            m.after_reboot(spec)
