"""Stage 9, reboot policy (last): the one place that decides whether the host reboots.

Stages report reasons with `facts.run_state.need_reboot` while their operations are generated.
Here: no reasons → nothing. Reasons and `spec.reboot.allowed` → one `server.reboot`, then,
when the kernel stage set a trial boot, pin the new release for good if it is the one
running (else say so; the old kernel stays pinned). Reasons without permission → a
"reboot pending" summary (logged as a warning, `--dry` included).
"""

from __future__ import annotations

from pyinfra import host, logger
from pyinfra.api import StringCommand, deploy, operation
from pyinfra.operations import server

from facts.run_state import reboot_reasons, trial_boot_of
from plan.kernel import pin_for_good_command
from plan.reboot import pending_summary
from spec.models import HostSpec

REBOOT_TIMEOUT_S = 900  # a many-GPU host takes minutes through firmware and POST


@operation()
def pin_trial_kernel(release: str, pin_tool: str, esps: bool = False):
    """After the reboot: pin `release` for good if the host came up on it, else fail saying so.

    + release: the kernel release the trial boot selected
    + pin_tool: "proxmox-boot-tool" or "grub"
    + esps: ESPs are listed (/etc/kernel/proxmox-boot-uuids): the pin is followed by a refresh
    """
    yield StringCommand(pin_for_good_command(release, pin_tool, esps))


@deploy("pvegpu: reboot policy")
def apply(spec: HostSpec) -> None:
    reasons = reboot_reasons()
    summary = pending_summary(host.name, reasons)
    if not reasons:
        logger.info(summary[0])
        return
    if not spec.reboot.allowed:
        for line in summary + [f"{host.name}: reboot.allowed is false in the spec; reboot the host to apply"]:
            logger.warning(line)
        return
    for line in summary:
        logger.info(line)
    server.reboot(
        # the reasons themselves are logged above; the name stays one readable line
        name=f"Reboot for {len(reasons)} reason(s): " + ", ".join(sorted({kind for kind, _ in reasons})),
        delay=5,
        interval=2,
        reboot_timeout=REBOOT_TIMEOUT_S,
    )
    trial = trial_boot_of()
    if trial:
        pin_trial_kernel(
            name=f"Pin kernel {trial['release']} for good if it came up",
            release=trial["release"],
            pin_tool=trial["pin_tool"],
            esps=trial.get("esps", False),
        )
