"""Stage 9, reboot policy (last): the one place that decides whether the host reboots.

Stages report reasons with `facts.run_state.need_reboot` while their operations are generated.
Here: no reasons → nothing. Reasons and `spec.reboot.allowed` → one `server.reboot`, then,
when the kernel stage set a trial boot, make the new release the default for good if it is
the one running (else record the failed trial and say so; the default stays on the old kernel). Reasons without permission → a
"reboot pending" summary (logged as a warning, `--dry` included).
"""

from __future__ import annotations

from pyinfra import host, logger
from pyinfra.api import StringCommand, deploy, operation
from pyinfra.operations import server

from facts.run_state import reboot_reasons, trial_boot_of
from plan.kernel import finish_trial_command
from plan.reboot import pending_summary
from spec.models import HostSpec

REBOOT_TIMEOUT_S = 900  # a many-GPU host takes minutes through firmware and POST


@operation()
def pin_trial_kernel(release: str, loader: str, build_id: str, advanced_id: str | None = None):
    """After the reboot: make `release` the default for good if the host came up on it, else
    record the failed trial and fail saying so (plan.kernel.finish_trial_command).

    + release: the kernel release the trial boot selected
    + loader: plan.kernel.SYSTEMD_BOOT or GRUB
    + build_id, advanced_id: as the kernel stage recorded them (facts.run_state.record_trial_boot)
    """
    yield StringCommand(finish_trial_command(release, loader, build_id, advanced_id, fail=True))


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
            loader=trial["pin_tool"],
            build_id=trial.get("build_id", ""),
            advanced_id=trial.get("advanced_id"),
        )
