"""Stage 1, host kernel & IOMMU: the kernel command line in the file the boot loader really
reads, vfio modules loaded early, nouveau blacklisted; the initramfs and the boot entries are
refreshed once at the end of the run when those changed (`operations.handlers`).

Boot loaders (incident 13: editing /etc/default/grub on a systemd-boot/ZFS host does nothing):
- systemd-boot (proxmox-boot-tool, UEFI): /etc/kernel/cmdline, one line; `proxmox-boot-tool refresh`
  (run by the BOOT_REFRESH handler, after the initramfs handler).
- GRUB: a drop-in /etc/default/grub.d/pvegpu.cfg that grub-mkconfig sources after
  /etc/default/grub, then `update-grub` (or `proxmox-boot-tool refresh` on ESPs it manages).
  A drop-in, not an edit of /etc/default/grub: that file is the admin's (and dpkg/ucf's), and a
  file of our own can be compared, replaced atomically and removed without parsing shell.
  Its value is recomputed every run from the files sourced *before* it, so an admin's edit
  of /etc/default/grub still counts.

Facts: one batched remote command (`BootStageFacts`) for the whole stage.
"""

from __future__ import annotations

from pyinfra import host
from pyinfra.api import StringCommand, deploy, operation

from facts.boot import KERNEL_CMDLINE, NOUVEAU_CONF, VFIO_CONF, BootStageFacts
from facts.loader import LoaderState
from facts.once import fact_once
from facts.run_state import need_reboot
from facts.shell import word
from operations import handlers
from operations.files import file_current, write_file_command
from plan import boot as plan
from plan import loader as loader_plan
from plan.render import render_template
from spec.models import HostSpec


def stage_facts() -> dict:
    """The stage's facts, read once per host per run (preflight and apply share them); on hosts
    with more than one proxmox-boot-tool ESP also what their loader reads (facts.loader.LoaderState:
    each ESP's mode, for the mixed-mode refusal; one ESP has one mode, and costs no extra read)."""
    facts = fact_once(BootStageFacts)
    if len((facts.get("boot_loader") or {}).get("esps") or []) > 1:
        facts = {**facts, "loader_state": fact_once(LoaderState)}
    return facts


def prefetch(spec: HostSpec) -> list:
    """The facts this stage reads (deploy.py reads every stage's in one command)."""
    return [(BootStageFacts, {})]


def boot_plan(spec: HostSpec, facts: dict) -> dict:
    """Files to write and what the next boot will change (pure given facts).

    .. code:: python

        {"loader": "systemd-boot", "cmdline_path": "/etc/kernel/cmdline",
         "cmdline_content": "root=ZFS=… amd_iommu=on\\n", "refresh_command": "proxmox-boot-tool refresh",
         "configured": "root=ZFS=… amd_iommu=on", "difference": {"missing": [...], "extra": [...]},
         "modules": {"/etc/modules-load.d/pvegpu-vfio.conf": "…", "/etc/modprobe.d/…": "…"},
         "modules_pending": ["vfio_pci is not loaded", …]}
    """
    loader_fact = facts["boot_loader"] or {}
    loader = loader_fact.get("loader")
    desired = plan.desired_params(spec, facts["cpu"])
    pve_major = (facts["pve_version"] or {}).get("major")  # on 9 the legacy cgroup switch is dropped
    grub_default = None
    if loader == "grub":
        grub_files = [(path, lines) for path, lines in facts["grub_files"]]
        values = plan.grub_dropin_values(grub_files, desired, spec, pve_major)
        configured = plan.grub_configured_cmdline(values, grub_files)
        path = plan.GRUB_DROPIN
        # GRUB on proxmox-boot-tool's ESPs (issue 38 2.4) reads the ESP's grubenv, not the root's
        # /boot/grub/grubenv that grub-set-default writes: GRUB_DEFAULT stays the host's there, and
        # Proxmox's pin (/etc/default/grub.d/proxmox-kernel-pin.cfg, written by refresh) chooses
        saved = loader_plan.loader_of_boot_fact(loader_fact) == loader_plan.GRUB
        content = render_template(
            "grub-pvegpu.cfg.j2", values={k: plan.sh_double_quoted(v) for k, v in values.items()}, saved=saved
        )
        # our drop-in sets GRUB_DEFAULT=saved; the default the files before it configured (a
        # Proxmox pin snippet included) becomes saved_entry, where grubenv has none yet
        if saved:
            grub_default = plan.grub_base_values(grub_files).get("GRUB_DEFAULT", "0")
    else:
        configured = plan.merge_cmdline(loader_fact.get("kernel_cmdline") or "", desired, spec, pve_major)
        path = KERNEL_CMDLINE
        content = render_template("kernel-cmdline.j2", cmdline=configured)
    booted = (facts["cmdline"] or {}).get("raw")
    modules = plan.vfio_modules(pve_major)
    loaded = set(facts["modules"] or [])
    pending = [f"{m} is not loaded yet" for m in modules if m not in loaded]
    if "nouveau" in loaded:
        pending.append("nouveau is loaded")
    return {
        "loader": loader,
        "cmdline_path": path,
        "cmdline_content": content,
        "grub_default": grub_default,
        "refresh_command": loader_fact.get("refresh_command") or ("update-grub" if loader == "grub" else "proxmox-boot-tool refresh"),
        "configured": configured,
        "difference": plan.cmdline_difference(configured, booted, loader or "systemd-boot"),
        "modules": {
            VFIO_CONF: render_template("modules-load-vfio.conf.j2", modules=modules),
            NOUVEAU_CONF: render_template("blacklist-nouveau.conf.j2"),
        },
        "modules_pending": pending,
    }


@operation()
def kernel_cmdline(path: str, content: str, state: dict | None = None, grub_default: str | None = None):
    """Write the boot loader's cmdline file, only when it changed (the boot entries are
    refreshed once at the end of the run: `operations.handlers`, BOOT_REFRESH).

    + path: /etc/kernel/cmdline (systemd-boot) or /etc/default/grub.d/pvegpu.cfg (GRUB)
    + content: the full file (templates/kernel-cmdline.j2 or grub-pvegpu.cfg.j2)
    + state: the path's entry of `ManagedFiles` (None: missing)
    + grub_default: GRUB: the GRUB_DEFAULT configured before our drop-in (GRUB_DEFAULT=saved):
      made grubenv's saved_entry first where it has none, so the default entry stays the same
    """
    mode = cmdline_mode(state)
    if file_current(state, content, mode):
        host.noop(f"{path} already has the kernel command line")
        return
    if grub_default is not None and grub_default != "saved":
        yield StringCommand(grub_keep_default_command(grub_default))
    yield StringCommand(write_file_command(path, content, mode))


def grub_keep_default_command(grub_default: str) -> str:
    """grub-set-default <the old GRUB_DEFAULT> unless grubenv has a saved_entry (saved_entry
    takes what GRUB_DEFAULT takes: an index, a title or an id path; grub util/grub-set-default.in
    writes it with grub-editenv)."""
    # GRUB_DEFAULT is the host's, not the spec's; grub-set-default has no '--' and fails on a '-*' word
    return (f"if ! grub-editenv /boot/grub/grubenv list 2>/dev/null | grep -q '^saved_entry='; then "
            f"grub-set-default {word(grub_default)}; fi")


def cmdline_mode(state: dict | None) -> str:
    return (state or {}).get("mode") or "644"  # keep the admin's mode on /etc/kernel/cmdline


def changed_modules(files: dict[str, str], states: dict[str, dict | None]) -> list[str]:
    """The module files whose content or mode differ from the host's."""
    return [p for p, c in files.items() if not file_current(states.get(p), c, "644")]


@operation()
def early_modules(files: dict[str, str], states: dict[str, dict | None]):
    """Write the modules-load.d / modprobe.d files that changed, in one command (the initramfs
    is regenerated once at the end of the run: `operations.handlers`, INITRAMFS).

    + files: {path: content}
    + states: `ManagedFiles` entries by path
    """
    changed = changed_modules(files, states)
    if not changed:
        host.noop("vfio early load and the nouveau blacklist are up to date")
        return
    yield StringCommand(" && ".join(write_file_command(p, files[p], "644") for p in changed))


def preflight(spec: HostSpec) -> list[str]:
    facts = stage_facts()
    refusals = plan.preflight_refusals(spec, facts["boot_loader"], facts["cpu"], facts["sev_snp"])
    # ESPs of both loaders (issue 38): what refresh writes to each depends on their order in
    # /etc/kernel/proxmox-boot-uuids (plan.loader.refresh_modes); refused before any change
    mixed = loader_plan.mixed_esps_refusal(facts.get("loader_state"))
    if mixed:
        refusals.append(mixed)
    return refusals


@deploy("pvegpu: host kernel & IOMMU")
def apply(spec: HostSpec) -> None:
    facts = stage_facts()
    p = boot_plan(spec, facts)
    states = facts["files"] or {}
    kernel_cmdline(
        name=f"Kernel cmdline in {p['cmdline_path']} ({p['loader']})",
        path=p["cmdline_path"],
        content=p["cmdline_content"],
        state=states.get(p["cmdline_path"]),
        grub_default=p["grub_default"],
    )
    cmdline_state = states.get(p["cmdline_path"])
    handlers.depends_on(
        handlers.BOOT_REFRESH, p["cmdline_path"], p["cmdline_content"], cmdline_mode(cmdline_state),
        changed=not file_current(cmdline_state, p["cmdline_content"], cmdline_mode(cmdline_state)),
        why=f"kernel command line changed in {p['cmdline_path']}", command=p["refresh_command"],
    )
    early_modules(
        name="vfio early load, nouveau blacklist",
        files=p["modules"],
        states=states,
    )
    changed = changed_modules(p["modules"], states)
    for path, content in p["modules"].items():
        handlers.depends_on(handlers.INITRAMFS, path, content, "644", changed=path in changed,
                            why=f"{path} changed (boot stage)")
    described = plan.describe_difference(p["difference"])
    if described:
        need_reboot("cmdline", f"{described} (configured in {p['cmdline_path']})")
    if p["modules_pending"]:
        need_reboot("initramfs", "; ".join(p["modules_pending"]) + f" ({VFIO_CONF}, {NOUVEAU_CONF})")

