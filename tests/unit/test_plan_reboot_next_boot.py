"""plan.reboot.next_boot_without_modules over real LoaderState readings (tests/unit/facts/loader.LoaderState):
a reboot must not come up on a kernel without nvidia.version's modules (the GPUs would be stranded)."""
from __future__ import annotations

from pathlib import Path

import yaml

from plan.reboot import next_boot_without_modules, no_modules_warning

CASES = Path(__file__).resolve().parent / "facts" / "loader.LoaderState"
V = "595.45.04"


def reading(name: str) -> dict:
    return yaml.safe_load((CASES / f"{name}.yaml").read_text())["fact"]


def nv_state(**modules: str | None) -> dict:
    """An NvidiaHostState reading with the nvidia module `modinfo -k` finds per release (its version)."""
    return {"running": "6.1.0-57-amd64", "releases": {
        r: {"headers": True, "module": None if v is None else {"version": v, "vermagic": f"{r} SMP mod_unload",
                                                                "filename": f"/lib/modules/{r}/updates/nvidia.ko"}}
        for r, v in modules.items()}}


def test_explicit_releases_without_the_grub_next_boot_kernel_strand_it():
    # /boot/grub boots 6.8.12-11-pve first; the spec builds only for 6.1.0-57-amd64
    missing = next_boot_without_modules(V, ["6.1.0-57-amd64"], nv_state(**{"6.1.0-57-amd64": V}),
                                        reading("intel2-grub-first-entry"))
    assert missing == [("/boot/grub", "6.8.12-11-pve")]
    assert no_modules_warning("n1", V, ["6.1.0-57-amd64"], missing) == (
        "n1: not rebooted: the next boot (/boot/grub: 6.8.12-11-pve) has no nvidia 595.45.04 modules "
        "(nvidia.releases: [6.1.0-57-amd64]); add 6.8.12-11-pve to nvidia.releases or leave it out")


def test_systemd_boot_one_shot_is_what_boots_next():
    # kpro6: LoaderEntryOneShot names 6.8.12-11-pve, the default 6.14.8-2-pve
    state = reading("kpro6-oneshot-and-default")
    assert next_boot_without_modules(V, ["6.14.8-2-pve"], nv_state(), state) == [("ESP 5A1C-9E27", "6.8.12-11-pve")]
    assert next_boot_without_modules(V, ["6.8.12-11-pve"], nv_state(), state) == []


def test_default_releases_that_hold_the_next_boot_kernel_reboot():
    # default releases: the running kernel and the kernel stage's (plan.nvidia.target_releases)
    from plan.nvidia import target_releases

    releases = target_releases("6.8.12-11-pve", [])
    assert next_boot_without_modules(V, releases, nv_state(), reading("intel2-grub-first-entry")) == []
    missing = next_boot_without_modules(V, target_releases("6.8.12-9-pve"), nv_state(),
                                        reading("intel2-grub-first-entry"))
    assert missing == [("/boot/grub", "6.8.12-11-pve")]
    assert "add 6.8.12-11-pve to nvidia.releases" in no_modules_warning("n1", V, None, missing)


def test_an_armed_trial_is_the_next_boot():
    state = reading("intel2-grub-first-entry")
    # the trial kernel is among the releases built this run: fine, whatever the loader's default
    assert next_boot_without_modules(V, ["6.14.8-2-pve"], nv_state(), state, "6.14.8-2-pve") == []
    # the trial kernel without modules: refused, even where the loader's default has them
    assert next_boot_without_modules(V, ["6.8.12-11-pve"], nv_state(), state, "6.14.8-2-pve") == [
        ("the kernel trial's one-shot entry", "6.14.8-2-pve")]


def test_modules_installed_for_the_next_boot_kernel_are_enough():
    state = reading("kpro6-pin-and-entry-without-kernel")  # boots 6.14.8-2-pve
    assert next_boot_without_modules(V, ["6.1.0-57-amd64"], nv_state(**{"6.14.8-2-pve": V}), state) == []
    # another version there, or none: stranded
    assert next_boot_without_modules(V, ["6.1.0-57-amd64"], nv_state(**{"6.14.8-2-pve": "580.95.05"}), state) == [
        ("ESP 5A1C-9E27", "6.14.8-2-pve")]
    assert next_boot_without_modules(V, ["6.1.0-57-amd64"], nv_state(**{"6.14.8-2-pve": None}), state) == [
        ("ESP 5A1C-9E27", "6.14.8-2-pve")]


def test_no_loader_to_read_is_no_refusal():
    assert next_boot_without_modules(V, ["6.1.0-57-amd64"], nv_state(), {"firmware": "bios", "grub_cfg": None}) == []
    assert next_boot_without_modules(V, ["6.1.0-57-amd64"], nv_state(), None) == []
