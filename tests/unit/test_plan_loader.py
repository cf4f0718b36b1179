"""plan.loader: what the boot loader boots next, from what it reads (facts.loader.LoaderState
recorded on the twins: the real bootctl and proxmox-boot-tool, Debian's grub-editenv)."""

from __future__ import annotations

import copy
import itertools
import subprocess
from pathlib import Path

import pytest
import yaml

from plan import loader as plan

CASES = Path(__file__).resolve().parent / "facts" / "loader.LoaderState"


def reading(name: str) -> dict:
    return yaml.safe_load((CASES / f"{name}.yaml").read_text())["fact"]


def test_versions_sort_as_systemd_documents_them():
    # string-util-fundamental.c strverscmp_improved's own example order, oldest first
    order = ["122.1", "123~rc1-1", "123", "123-a", "123-a.1", "123-1", "123-1.1", "123^post1", "123.a-1",
             "123.1-1", "123a-1", "124-1"]
    for older, newer in zip(order, order[1:], strict=False):
        assert plan.strverscmp_improved(older, newer) < 0 < plan.strverscmp_improved(newer, older), (older, newer)
    assert plan.strverscmp_improved("proxmox-6.14.8-2-pve.conf", "proxmox-6.8.12-11-pve.conf") > 0
    assert plan.strverscmp_improved("proxmox-6.8.12-10-pve.conf", "proxmox-6.8.12-9-pve.conf") > 0
    assert plan.strverscmp_improved("00123", "123") == 0


# entry ids and versions as ESPs hold them, and the corners of the order (separators, '~', leading
# zeros, letter against digit runs, characters outside the version alphabet)
VERSIONS = ["proxmox-6.14.8-2-pve.conf", "proxmox-6.14.11-9-bpo12-pve.conf", "proxmox-6.8.12-11-pve.conf",
            "proxmox-6.8.12-9-pve.conf", "proxmox-6.1.0-57-amd64.conf", "proxmox-6.12.118+deb12-amd64.conf",
            "proxmox-7.0.14-14-pve.conf", "proxmox-6.14.11-1-pvegpu-pve.conf", "proxmox-6.14.0-1-pve.conf",
            "123a", "123.a", "123-a", "123^a", "123~a", "123", "00123", "0", "a", "1.0", "1.a", "1_a", "1a",
            "6.8", "6.8.0", "6.8-0", "6.8~rc1", "abc", "abcde", "A", "Z9", "1.2.3.4", "1..2", "1-.2", "~", "-"]


def test_version_order_is_systemds_own():
    """plan.loader's comparison against systemd's: `systemd-analyze compare-versions` (systemd >= 252,
    src/analyze/analyze-compare-versions.c, strverscmp_improved; exit 0 equal, 11 newer, 12 older)
    on every pair above. The twin's firmware model asks its root's systemd the same way
    (tests/twin/hardware.py strverscmp_improved), so neither is a copy of the other."""
    wrong = []
    for a, b in itertools.combinations_with_replacement(VERSIONS, 2):
        done = subprocess.run(["systemd-analyze", "compare-versions", "--", a, b], capture_output=True,
                              text=True, timeout=30)
        assert done.returncode in (0, 11, 12), (a, b, done.returncode, done.stderr)
        real = {0: 0, 11: 1, 12: -1}[done.returncode]
        ours, back = plan.strverscmp_improved(a, b), plan.strverscmp_improved(b, a)
        if (ours > 0) - (ours < 0) != real or (back > 0) - (back < 0) != -real:
            wrong.append(f"{a} vs {b}: systemd {real}, plan.loader {ours} (and {back} the other way)")
    assert not wrong, "\n".join(wrong)


def test_systemd_boot_takes_the_one_shot_first():
    state = reading("kpro6-oneshot-and-default")
    assert plan.loader_of_state(state) == plan.SYSTEMD_BOOT
    (choice,) = plan.next_boot(state)
    assert (choice["release"], choice["why"]) == ("6.8.12-11-pve", "LoaderEntryOneShot proxmox-6.8.12-11-pve.conf")
    assert choice["where"] == "ESP 5A1C-9E27"


def test_then_the_efi_default_over_loader_conf():
    state = reading("kpro6-oneshot-and-default")
    del state["efivars"]["LoaderEntryOneShot"]
    assert plan.next_boot_releases(state) == ["6.14.8-2-pve"]
    state["efivars"]["LoaderEntryDefault"] = "proxmox-6.8.12-11-pve.conf"
    assert plan.next_boot(state)[0]["why"] == "LoaderEntryDefault proxmox-6.8.12-11-pve.conf"
    assert plan.next_boot_releases(state) == ["6.8.12-11-pve"]


def test_then_loader_conf_default_glob_over_the_entries_in_systemd_boots_order():
    state = reading("kpro6-oneshot-and-default")
    state["efivars"] = {"LoaderInfo": "systemd-boot 252.39-1~deb12u2"}
    # default proxmox-*: the first match in boot.c's order, the newest by id (6.14 after 6.8 as text)
    assert plan.next_boot(state)[0]["why"] == "loader.conf default proxmox-*"
    assert plan.next_boot_releases(state) == ["6.14.8-2-pve"]
    state["esps"][0]["loader_conf"] = ["timeout 3", "default PROXMOX-6.8*"]  # ids and patterns case folded
    assert plan.next_boot_releases(state) == ["6.8.12-11-pve"]
    state["esps"][0]["loader_conf"] = ["timeout 3", "default nothing-matches-*"]  # else the first entry
    assert plan.next_boot(state)[0]["why"].startswith("the first entry")
    assert plan.next_boot_releases(state) == ["6.14.8-2-pve"]


def test_an_entry_whose_kernel_is_not_on_the_esp_is_not_booted():
    state = reading("kpro6-pin-and-entry-without-kernel")
    assert plan.next_boot(state)[0]["why"] == "loader.conf default proxmox-6.14.8-2-pve.conf"
    state["esps"][0]["loader_conf"] = ["default proxmox-*"]
    # proxmox-6.15.0-1-pve.conf would sort first, but its linux file is missing (boot.c drops it)
    assert plan.next_boot_releases(state) == ["6.14.8-2-pve"]
    state["efivars"]["LoaderEntryOneShot"] = "proxmox-6.15.0-1-pve.conf"
    assert plan.next_boot_releases(state) == ["6.14.8-2-pve"]


def test_sort_key_entries_come_first():
    entries = [plan._entry({"file": f, "lines": lines}) for f, lines in (
        ("proxmox-6.14.8-2-pve.conf", ["linux /a/vmlinuz-6.14.8-2-pve"]),
        ("debian-6.1.conf", ["sort-key debian", "version 6.1.0-57-amd64", "linux /b/vmlinuz-6.1.0-57-amd64"]),
        ("debian-6.12.conf", ["sort-key debian", "version 6.12.118", "linux /b/vmlinuz-6.12.118"]),
    )]
    assert [e["file"] for e in plan.systemd_boot_order(entries)] == [
        "debian-6.12.conf", "debian-6.1.conf", "proxmox-6.14.8-2-pve.conf"]


def test_grub_boots_its_first_entry_without_a_saved_default():
    state = reading("intel2-grub-first-entry")
    assert plan.loader_of_state(state) == plan.GRUB
    (choice,) = plan.next_boot(state)
    assert choice["where"] == "/boot/grub" and choice["release"] == "6.8.12-11-pve"
    assert choice["why"] == "default 0"


def test_grub_next_entry_then_saved_entry():
    state = reading("intel2-grub-saved-and-next-entry")
    assert plan.next_boot(state)[0]["why"].startswith("next_entry ")
    assert plan.next_boot_releases(state) == ["6.8.12-9-pve"]
    state["grubenv"] = [line for line in state["grubenv"] if not line.startswith("next_entry=")]
    assert plan.next_boot(state)[0]["why"].startswith("saved_entry ")
    assert plan.next_boot_releases(state) == ["6.8.12-11-pve"]
    # a saved_entry that names no entry: GRUB boots the first one
    state["grubenv"] = ["saved_entry=gnulinux-advanced-x>gnulinux-5.15.0-1-pve-advanced-x"]
    assert plan.next_boot_releases(state) == ["6.8.12-11-pve"]
    assert plan.next_boot(state)[0]["why"].startswith("the first entry")


def grub_esp_state() -> dict:
    """A legacy-BIOS ZFS host in proxmox-boot-tool's grub mode: the ESP's grub.cfg (written by
    update-grub with the ESP bound on /boot, the pin as GRUB_DEFAULT) and the root's grubenv."""
    base = reading("intel2-grub-saved-and-next-entry")
    adv = "gnulinux-advanced-00488686-51ee-d592-e56e-2e584a7333d0"
    esp_cfg = [line.replace('set default="${saved_entry}"',
                            f'set default="{adv}>gnulinux-6.8.12-9-pve-advanced-00488686-51ee-d592-e56e-2e584a7333d0"')
               for line in base["grub_cfg"]]
    return {"firmware": "bios", "efivars": {}, "esp_list": ["2A4C-77E1"],
            "esps": [{"uuid": "2A4C-77E1", "mounted": True, "has": ["grub"], "loader_conf": None, "entries": [],
                      "grub_cfg": esp_cfg, "grubenv": None}],
            "grub_cfg": copy.deepcopy(base["grub_cfg"]), "grubenv": copy.deepcopy(base["grubenv"])}


def test_grub_on_esps_reads_the_esps_grub_cfg_and_grubenv_not_the_roots():
    state = grub_esp_state()
    assert plan.loader_of_state(state) == plan.GRUB_ESP
    (choice,) = plan.next_boot(state)
    # the root's grubenv (next_entry 6.8.12-9, saved_entry 6.8.12-11) is not what this GRUB reads
    assert choice["where"] == "ESP 2A4C-77E1" and choice["loader"] == plan.GRUB_ESP
    assert choice["release"] == "6.8.12-9-pve" and choice["why"].startswith("default gnulinux-advanced-")
    state["esps"][0]["grubenv"] = ["# GRUB Environment Block", "next_entry=1>2"]
    assert plan.next_boot_releases(state) == ["6.8.12-9-pve"]  # index path: submenu 1, its third item


@pytest.mark.parametrize("firmware, has, mode", [
    ("uefi", ["loader/loader.conf"], plan.SYSTEMD_BOOT),
    # `init <part> grub` over a systemd-boot ESP (loader.conf left; the installer formats first:
    # pve-installer Proxmox/Install.pm prepare_proxmox_boot_esp): refresh's mode is GRUB's
    ("uefi", ["EFI/proxmox/grubx64.efi", "loader/loader.conf", "grub"], plan.GRUB_ESP),
    ("bios", ["grub"], plan.GRUB_ESP),
    ("bios", ["loader/loader.conf", "grub"], plan.GRUB_ESP),
    ("bios", ["loader/loader.conf"], None),
    ("uefi", ["grub"], None),
])
def test_the_esp_loader_is_the_one_refresh_sets_up(firmware, has, mode):
    assert plan.esp_loader({"has": has}, firmware) == mode


def test_one_loader_decision():
    assert plan.host_loader("uefi", [plan.SYSTEMD_BOOT]) == plan.SYSTEMD_BOOT
    assert plan.host_loader("bios", [plan.GRUB_ESP, plan.GRUB_ESP]) == plan.GRUB_ESP
    assert plan.host_loader("uefi", [plan.SYSTEMD_BOOT, plan.GRUB_ESP]) == plan.GRUB_ESP
    assert plan.host_loader("bios", []) == plan.GRUB
    assert plan.host_loader("bios", [None], esp_listed=True) == plan.GRUB_ESP


def test_no_loader_to_read():
    assert plan.next_boot({"firmware": "bios", "efivars": {}, "esp_list": [], "esps": [], "grub_cfg": None}) == []
    unmounted: dict = {"firmware": "uefi", "efivars": {}, "esp_list": ["AAAA-BBBB"],
                 "esps": [{"uuid": "AAAA-BBBB", "mounted": False}], "grub_cfg": None}
    assert plan.next_boot(unmounted)[0]["release"] is None


def test_the_kernel_stages_default_is_the_pin_only_where_the_loader_boots_it():
    """plan.kernel.default_release on ESPs: the pin counts where the loader's own default (one-shots
    left out) boots it; a `bootctl set-default` to another kernel is no default (the stage pins again)."""
    from plan import kernel as kplan

    state = reading("kpro6-oneshot-and-default")  # one-shot 6.8.12-11, EFI default 6.14.8-2
    kernels = {"pinned": "6.14.8-2-pve"}
    assert plan.next_boot_releases(state, once=False) == ["6.14.8-2-pve"]
    assert kplan.default_release(kernels, {}, kplan.SYSTEMD_BOOT, state) == "6.14.8-2-pve"
    state["efivars"]["LoaderEntryDefault"] = "proxmox-6.8.12-11-pve.conf"
    assert kplan.default_release(kernels, {}, kplan.SYSTEMD_BOOT, state) is None
    assert kplan.default_release(kernels, {}, kplan.SYSTEMD_BOOT) == "6.14.8-2-pve"  # no reading: the pin
    grub = reading("intel2-grub-saved-and-next-entry")
    assert plan.next_boot_releases(grub, once=False) == ["6.8.12-11-pve"]  # next_entry left out


# -- ESPs of both loaders (issue 38): proxmox-kernel-helper zz-proxmox-boot update_esp_func's grub
# flag is set by the first ESP holding EFI/proxmox/grubx64.efi and holds for every ESP after it

SD_ESP = {"uuid": "7B2D-1F30", "mounted": True, "has": ["loader/loader.conf"]}
GRUB_ESP_UEFI = {"uuid": "5A1C-9E27", "mounted": True, "has": ["EFI/proxmox/grubx64.efi", "grub"]}


def test_refresh_keeps_grub_mode_for_the_esps_after_a_grub_one():
    rows = plan.refresh_modes([GRUB_ESP_UEFI, SD_ESP], "uefi")
    assert [(r["uuid"], r["own"], r["refreshed"]) for r in rows] == [
        ("5A1C-9E27", plan.GRUB_ESP, plan.GRUB_ESP), ("7B2D-1F30", plan.SYSTEMD_BOOT, None)]
    assert rows[1]["skipped"].startswith("contains no grub directory")
    # a systemd-boot ESP that also holds grub/ is refreshed as GRUB's (kernels at its top, update-grub)
    both = {**SD_ESP, "has": ["loader/loader.conf", "grub"]}
    assert [r["refreshed"] for r in plan.refresh_modes([GRUB_ESP_UEFI, both], "uefi")] == [plan.GRUB_ESP, plan.GRUB_ESP]


def test_refresh_takes_each_esp_in_its_own_mode_up_to_the_first_grub_one():
    rows = plan.refresh_modes([SD_ESP, GRUB_ESP_UEFI, SD_ESP], "uefi")
    assert [r["refreshed"] for r in rows] == [plan.SYSTEMD_BOOT, plan.GRUB_ESP, None]
    assert [r["refreshed"] for r in plan.refresh_modes([SD_ESP, SD_ESP], "uefi")] == [plan.SYSTEMD_BOOT] * 2
    bios = plan.refresh_modes([{"uuid": "A", "has": ["grub"]}, {"uuid": "B", "has": ["loader/loader.conf"]},
                               {"uuid": "C", "mounted": False}], "bios")
    assert [(r["refreshed"], r["skipped"]) for r in bios] == [
        (plan.GRUB_ESP, None), (None, "contains no grub directory"), (None, "mount failed")]
    assert plan.refresh_modes([{"uuid": "A", "mounted": True, "has": ["grub"]}], "uefi")[0]["skipped"] \
        == "contains no loader.conf"


def _state(*esps, firmware="uefi"):
    return {"firmware": firmware, "efivars": {}, "esp_list": [e["uuid"] for e in esps], "esps": list(esps),
            "grub_cfg": None, "grubenv": None}


@pytest.mark.parametrize("order", [(GRUB_ESP_UEFI, SD_ESP), (SD_ESP, GRUB_ESP_UEFI)])
def test_esps_of_both_loaders_are_refused_in_either_order(order):
    why = plan.mixed_esps_refusal(_state(*order))
    assert why is not None
    assert "5A1C-9E27 (grub)" in why and "7B2D-1F30 (systemd-boot)" in why
    assert "proxmox-boot-tool init /dev/disk/by-uuid/7B2D-1F30 grub" in why
    assert "proxmox-boot-tool format <its partition> --force" in why and "Nothing was changed" in why
    if order[0] is GRUB_ESP_UEFI:
        assert "7B2D-1F30 skipped: contains no grub directory" in why
    else:
        assert "7B2D-1F30 in systemd-boot mode; 5A1C-9E27 in grub mode" in why


def test_the_fix_with_fewer_esps_to_redo_comes_first():
    other = {**SD_ESP, "uuid": "8C3E-2041"}
    why = plan.mixed_esps_refusal(_state(GRUB_ESP_UEFI, SD_ESP, other)) or ""
    assert why.index("to systemd-boot: for 5A1C-9E27") < why.index("to GRUB")
    why = plan.mixed_esps_refusal(_state(GRUB_ESP_UEFI, {**GRUB_ESP_UEFI, "uuid": "9D4F-3152"}, SD_ESP)) or ""
    assert why.index("to GRUB") < why.index("to systemd-boot")


@pytest.mark.parametrize("state", [
    _state(SD_ESP, {**SD_ESP, "uuid": "8C3E-2041"}),
    _state(GRUB_ESP_UEFI, {**GRUB_ESP_UEFI, "uuid": "9D4F-3152"}),
    _state({"uuid": "A", "mounted": True, "has": ["grub"]}, {"uuid": "B", "mounted": True, "has": ["loader/loader.conf", "grub"]},
           firmware="bios"),  # legacy BIOS: GRUB on every ESP
    _state(GRUB_ESP_UEFI, {"uuid": "C", "mounted": False}),
    _state(),
    None,
])
def test_esps_of_one_loader_are_not_refused(state):
    assert plan.mixed_esps_refusal(state) is None


def test_the_recorded_readings_of_one_mode_are_not_refused():
    for case in sorted(CASES.glob("*.yaml")):
        fact = yaml.safe_load(case.read_text())["fact"]
        if "mixed" not in case.stem:
            assert plan.mixed_esps_refusal(fact) is None, case.stem


def test_recorded_esps_of_both_loaders_follow_the_real_refresh_and_are_refused():
    """Readings of the kpro6-grubesp twin with a second ESP set up by the real `proxmox-boot-tool
    init` (systemd-boot): GRUB's ESP first, the real refresh skipped the other ("contains no grub
    directory": no entries there); systemd-boot's first, it wrote each in its own mode."""
    grub_first = reading("kpro6-grubesp-mixed-grub-esp-first")
    assert [(r["uuid"], r["refreshed"]) for r in plan.refresh_modes(grub_first["esps"], "uefi")] == [
        ("5A1C-9E27", plan.GRUB_ESP), ("7B2D-1F30", None)]
    assert grub_first["esps"][1]["entries"] == []  # what the real refresh left: nothing
    sd_first = reading("kpro6-grubesp-mixed-systemd-boot-esp-first")
    assert [(r["uuid"], r["refreshed"]) for r in plan.refresh_modes(sd_first["esps"], "uefi")] == [
        ("7B2D-1F30", plan.SYSTEMD_BOOT), ("5A1C-9E27", plan.GRUB_ESP)]
    assert {e["file"] for e in sd_first["esps"][0]["entries"]} == {"proxmox-6.14.8-2-pve.conf",
                                                                   "proxmox-6.8.12-11-pve.conf"}
    for state in (grub_first, sd_first):
        why = plan.mixed_esps_refusal(state) or ""
        assert "5A1C-9E27 (grub)" in why and "7B2D-1F30 (systemd-boot)" in why, why
        assert "proxmox-boot-tool init /dev/disk/by-uuid/7B2D-1F30 grub" in why


# -- a loader mode that changed under the host (issue 38): proxmox-kernel-helper master after 9.2.0
# (b4954f3, bin/proxmox-boot-tool init_bootloader) tests `[ -e "$esp_mp/EFI/proxmox/grub*.efi" ]`,
# the glob quoted (never expanded), so its reinit installs systemd-boot over a GRUB ESP while
# zz-proxmox-boot update_esp_func keeps refreshing it as GRUB's

def reinit_over_grub_esp() -> dict:
    """The recorded GRUB ESP of the kpro6-grubesp twin after such a reinit: loader/loader.conf as
    init_bootloader writes it (timeout 3, default proxmox-*), no entries (refresh writes GRUB's)."""
    state = reading("kpro6-grubesp-mixed-grub-esp-first")
    state["esp_list"] = state["esp_list"][:1]
    esp = state["esps"][0]
    state["esps"] = [{**esp, "has": ["EFI/proxmox/grubx64.efi", "loader/loader.conf", "grub"],
                      "loader_conf": ["timeout 3", "default proxmox-*"], "entries": []}]
    return state


def test_an_esp_that_holds_both_loaders_is_named_with_the_fix():
    state = reinit_over_grub_esp()
    assert plan.mixed_esps_refusal(state) is None  # one ESP, one mode by refresh's test: main saw nothing
    (why,) = plan.esp_mode_problems(state)
    assert why.startswith("ESP 5A1C-9E27 holds both GRUB (EFI/proxmox/grubx64.efi) and systemd-boot"), why
    assert "proxmox-boot-tool init <its partition> grub" in why and "firmware's boot order" in why


def test_systemd_boot_started_on_grub_esps_is_a_changed_mode():
    state = reading("kpro6-grubesp-mixed-grub-esp-first")
    state["esp_list"] = state["esp_list"][:1]
    state["esps"] = state["esps"][:1]
    assert plan.esp_mode_problems(state) == []
    state["efivars"] = {"LoaderInfo": "systemd-boot 257.13-1~deb13u1"}
    (why,) = plan.esp_mode_problems(state)
    assert "systemd-boot started this boot (EFI variable LoaderInfo: systemd-boot 257.13-1~deb13u1)" in why


def test_legacy_bios_and_one_mode_readings_have_no_mode_problem():
    bios = reinit_over_grub_esp()
    bios["firmware"] = "bios"
    assert plan.both_loaders_on_one_esp(bios) is None
    for case in sorted(CASES.glob("*.yaml")):
        fact = yaml.safe_load(case.read_text())["fact"]
        if "mixed" not in case.stem:
            assert plan.esp_mode_problems(fact) == [], case.stem
        else:
            assert len(plan.esp_mode_problems(fact)) == 1, case.stem  # the mixed refusal alone
