"""Which kernel the boot loader boots next, decided from what the loader itself reads
(`facts.loader.LoaderState`), and which loader that is on a host (issue 38 items 2.4 and 2.6); pure.

    host_loader(firmware, esp_modes)  -> SYSTEMD_BOOT | GRUB | GRUB_ESP   # the one loader decision
    esp_loader(esp, firmware)         -> SYSTEMD_BOOT | GRUB_ESP | None   # one ESP's, as refresh set it up
    refresh_modes(esps, firmware)     -> [{"uuid", "own", "refreshed", "skipped"}]  # what one refresh does to each
    mixed_esps_refusal(loader_state)  -> str | None   # ESPs of both loaders: no one decision (refused)
    both_loaders_on_one_esp(state)    -> str | None   # one ESP holding both, or systemd-boot started on GRUB's ESPs
    esp_mode_problems(loader_state)   -> [str]        # both of the above (the host check, the kernel hook)
    next_boot(loader_state)           -> [{"where", "loader", "release", "why"}, …]   # one per place it boots from
    systemd_boot_order(entries)       -> the entries in systemd-boot's menu order
    strverscmp_improved(a, b)         -> <0 | 0 | >0

systemd-boot (systemd src/boot/efi/boot.c, v252 as Debian bookworm ships it, the same in 257):
the entries of loader/entries/*.conf whose kernel file is on the ESP, ordered by
config_entry_compare; config_default_entry_select takes the first entry whose id matches, as a
glob, LoaderEntryOneShot, then LoaderEntryDefault, then loader.conf's `default`, else the first.
GRUB (grub util/grub.d/00_header.in, grub-core/normal/menu.c): grub.cfg from $prefix, whose header
loads $prefix/grubenv and boots next_entry when set, else the `set default=` GRUB_DEFAULT became
(`${saved_entry}` with GRUB_DEFAULT=saved); an unknown default is the first entry.
"""

from __future__ import annotations

import fnmatch
import functools
import re

SYSTEMD_BOOT = "systemd-boot"
GRUB = "grub"  # GRUB reading /boot/grub (grub.cfg and grubenv on the root's /boot)
GRUB_ESP = "grub-esp"  # GRUB from proxmox-boot-tool ESPs (its grub mode): grub.cfg and grubenv on each ESP


def esp_loader(esp: dict, firmware: str | None) -> str | None:
    """The loader `proxmox-boot-tool refresh` sets up on one ESP (proxmox-kernel-helper
    zz-proxmox-boot update_esp_func): GRUB where EFI/proxmox/grubx64.efi is (installed by `init
    <part> grub`, e.g. a UEFI host installed with Secure Boot), else systemd-boot under UEFI (with
    loader/loader.conf), else GRUB (legacy BIOS; with grub/). None: the ESP has neither."""
    has = set(esp.get("has") or [])
    if "EFI/proxmox/grubx64.efi" in has:
        return GRUB_ESP
    if firmware == "uefi":
        return SYSTEMD_BOOT if "loader/loader.conf" in has else None
    return GRUB_ESP if "grub" in has else None


def refresh_modes(esps: list[dict], firmware: str | None) -> list[dict]:
    """What one `proxmox-boot-tool refresh` does to each ESP, in /etc/kernel/proxmox-boot-uuids
    order (`esps`: `facts.loader.LoaderState` "esps", which keeps that order). Follows
    proxmox-kernel-helper src/proxmox-boot/zz-proxmox-boot update_esp_func as run by functions
    loop_esp_list (one `while read` subshell for the whole list, so its `grub=1`, set where
    EFI/proxmox/grubx64.efi is, is never reset and holds for every ESP after the first GRUB one):
    under UEFI without the flag an ESP needs loader/loader.conf (systemd-boot), else it needs grub/
    ("contains no grub directory - skipping"). The EFI/proxmox directory check of that function is
    left out (LoaderState does not read it).

    [{"uuid", "own": esp_loader (the ESP's mode on its own), "refreshed": SYSTEMD_BOOT | GRUB_ESP
    | None, "skipped": None | why}]"""
    out = []
    grub = False
    for esp in esps:
        has = set(esp.get("has") or [])
        row = {"uuid": esp.get("uuid"), "own": esp_loader(esp, firmware), "refreshed": None, "skipped": None}
        out.append(row)
        if not esp.get("mounted", True):
            row["skipped"] = "mount failed"
            continue
        if "EFI/proxmox/grubx64.efi" in has:
            grub = True
        if firmware == "uefi" and not grub:
            if "loader/loader.conf" in has:
                row["refreshed"] = SYSTEMD_BOOT
            else:
                row["skipped"] = "contains no loader.conf"
        elif "grub" in has:
            row["refreshed"] = GRUB_ESP
        else:
            row["skipped"] = ("contains no grub directory (the GRUB mode of an ESP before it holds)"
                              if grub and "EFI/proxmox/grubx64.efi" not in has else "contains no grub directory")
    return out


_MODE_WORD = {SYSTEMD_BOOT: "systemd-boot", GRUB_ESP: "grub"}


def mixed_esps_refusal(state: dict | None) -> str | None:
    """Refusal (words) where the listed ESPs are set up for both loaders (`esp_loader`: one with
    systemd-boot, another with GRUB): what refresh writes to each then depends on their order in
    /etc/kernel/proxmox-boot-uuids (`refresh_modes`), and which loader starts depends on the
    firmware's boot order, so no one loader decision (`host_loader`) holds for the host. Names
    each ESP with its mode and the fix: proxmox-kernel-helper bin/proxmox-boot-tool
    init_bootloader (`init <partition> [grub]`; without `grub` an ESP with EFI/proxmox/grubx64.efi
    stays in grub mode, so going to systemd-boot needs `format <partition> --force` first, which
    gives the ESP a new UUID: `clean` drops the old one). None: one mode (or no ESPs)."""
    state = state or {}
    if not state.get("esp_list"):
        return None
    firmware = state.get("firmware")
    rows = refresh_modes(state.get("esps") or [], firmware)
    own = {r["own"] for r in rows if r["own"]}
    if not {SYSTEMD_BOOT, GRUB_ESP} <= own:
        return None
    sd = [r["uuid"] for r in rows if r["own"] == SYSTEMD_BOOT]
    grub = [r["uuid"] for r in rows if r["own"] == GRUB_ESP]
    listing = ", ".join(f"{r['uuid']} ({_MODE_WORD.get(r['own'] or '', 'neither loader')})" for r in rows)
    refresh = "; ".join(f"{r['uuid']} " + (f"in {_MODE_WORD[r['refreshed']]} mode" if r["refreshed"]
                                           else f"skipped: {r['skipped']}") for r in rows)
    to_grub = ("to GRUB (EFI/proxmox/grubx64.efi on each): "
               + "; ".join(f"proxmox-boot-tool init /dev/disk/by-uuid/{u} grub" for u in sd))
    to_sd = ("to systemd-boot: for " + ", ".join(grub) + " each: proxmox-boot-tool format <its partition> --force; "
             "proxmox-boot-tool init <its partition>; then proxmox-boot-tool clean (format gives it a new UUID; "
             "init without grub keeps an ESP holding EFI/proxmox/grubx64.efi in grub mode)")
    fixes = [to_grub, to_sd] if len(sd) <= len(grub) else [to_sd, to_grub]
    return ("the ESPs in /etc/kernel/proxmox-boot-uuids are set up for different boot loaders: " + listing
            + ". proxmox-boot-tool refresh (zz-proxmox-boot update_esp_func) keeps GRUB's mode for every ESP after "
            "the first GRUB one in that file, so a refresh now writes " + refresh + "; and which loader starts "
            "depends on the firmware's boot order: no kernel default or trial can be set for this host. Nothing "
            "was changed. Put every ESP in one mode first, either " + fixes[0] + ", or " + fixes[1])


def both_loaders_on_one_esp(state: dict | None) -> str | None:
    """Words where a UEFI host's ESP in proxmox-boot-tool's grub mode (EFI/proxmox/grubx64.efi)
    also holds systemd-boot's loader/loader.conf, or where systemd-boot started this boot
    (its LoaderInfo EFI variable) on a host whose ESPs are all GRUB's: an ESP's mode changed.

    proxmox-kernel-helper after 9.2.0 (master b4954f3, bin/proxmox-boot-tool init_bootloader)
    tests `[ -e "$esp_mp/EFI/proxmox/grub*.efi" ]` with the glob inside the quotes, a name no
    ESP holds, so its `reinit` (run by the dpkg trigger on any grub/shim/systemd-boot-efi
    upgrade) installs systemd-boot (`bootctl install`, loader.conf, its NVRAM entry first) over
    a GRUB ESP, while zz-proxmox-boot update_esp_func still tests EFI/proxmox/grubx64.efi and
    keeps refreshing GRUB's grub.cfg there: the firmware then starts systemd-boot, whose entries
    no refresh writes. None: no such ESP (or not UEFI)."""
    state = state or {}
    if state.get("firmware") != "uefi" or not state.get("esp_list"):
        return None
    esps = [e for e in state.get("esps") or [] if e.get("mounted")]
    both = [e["uuid"] for e in esps if {"EFI/proxmox/grubx64.efi", "loader/loader.conf"} <= set(e.get("has") or [])]
    info = (state.get("efivars") or {}).get("LoaderInfo") or ""
    changed = bool(esps) and info.startswith("systemd-boot") and all(
        esp_loader(e, "uefi") == GRUB_ESP for e in esps)
    if not both and not changed:
        return None
    fix = ("Put each ESP in one mode: for GRUB, proxmox-boot-tool format <its partition> --force; "
           "proxmox-boot-tool init <its partition> grub; then proxmox-boot-tool clean (format gives it a new UUID); "
           "for systemd-boot the same without grub")
    said = []
    if both:
        said.append("ESP " + ", ".join(both) + " holds both GRUB (EFI/proxmox/grubx64.efi) and systemd-boot "
                    "(loader/loader.conf): proxmox-boot-tool refresh (zz-proxmox-boot update_esp_func) writes only "
                    "GRUB's grub.cfg there, and which loader starts is the firmware's boot order (a reinit that "
                    "installed systemd-boot put its entry first)")
    if changed:
        said.append(f"systemd-boot started this boot (EFI variable LoaderInfo: {info}) but every ESP is in GRUB's "
                    "mode: the loader mode changed under the host (e.g. a boot-loader package upgrade's "
                    "proxmox-boot-tool reinit)")
    return "; ".join(said) + ". No kernel default or trial can be trusted on this host. " + fix


def esp_mode_problems(state: dict | None) -> list[str]:
    """What keeps one loader decision from holding on a host's ESPs: ESPs of both loaders
    (`mixed_esps_refusal`), an ESP that holds both or a mode that changed (`both_loaders_on_one_esp`)."""
    return [w for w in (mixed_esps_refusal(state), both_loaders_on_one_esp(state)) if w]


def host_loader(firmware: str | None, esp_modes: list[str | None], esp_listed: bool = False) -> str:
    """The one loader decision of a host: with ESPs listed in /etc/kernel/proxmox-boot-uuids the
    loader refresh keeps on them (`esp_loader` of each; GRUB_ESP when any is GRUB's: its grub.cfg
    and grubenv are on the ESPs, and /boot/grub is not read), else GRUB from /boot/grub."""
    modes = [m for m in esp_modes if m]
    if modes:
        return GRUB_ESP if GRUB_ESP in modes else SYSTEMD_BOOT
    if esp_listed:
        return SYSTEMD_BOOT if firmware == "uefi" else GRUB_ESP
    return GRUB


def loader_of_state(state: dict) -> str:
    """`host_loader` from a `facts.loader.LoaderState` reading."""
    firmware = state.get("firmware")
    return host_loader(firmware, [esp_loader(e, firmware) for e in state.get("esps") or [] if e.get("mounted")],
                       bool(state.get("esp_list")))


def loader_of_boot_fact(boot_loader: dict | None) -> str | None:
    """`host_loader` from `facts.kernel.BootLoader` (the boot stage's reading: each ESP's mode as
    `proxmox-boot-tool status` shows it, `uefi` or `grub`, the firmware's where it shows both);
    None where the host has neither ESPs nor a GRUB configuration."""
    fact = boot_loader or {}
    esps = fact.get("esps") or []
    if esps:
        modes = [{"uefi": SYSTEMD_BOOT, "grub": GRUB_ESP}.get(e.get("mode") or "") for e in esps]
        return host_loader(fact.get("firmware"), modes, True)
    return GRUB if fact.get("loader") == "grub" else (SYSTEMD_BOOT if fact.get("loader") == "systemd-boot" else None)


# -- systemd-boot --------------------------------------------------------------------------


def strverscmp_improved(a: str | None, b: str | None) -> int:
    """systemd src/fundamental/string-util-fundamental.c strverscmp_improved: compare two versions
    segment by segment. Characters other than ASCII letters, digits and "~-^." are skipped; each
    segment may start with "~" (older than anything, the end included), then (one after the other)
    "-", "^", "." (each older than a segment without it); once one string ends, the longer is newer;
    a digit run is newer than a letter run, digit runs compare as numbers, letter runs as strings
    (a longer one newer). <0, 0, >0 as a is older, the same, newer."""
    a, b = a or "", b or ""

    def sign(x: int) -> int:
        return (x > 0) - (x < 0)

    def ch(s: str, i: int) -> str:
        return s[i] if i < len(s) else ""

    def run(s: str, i: int, digits: bool) -> int:
        while i < len(s) and s[i].isascii() and (s[i].isdigit() if digits else s[i].isalpha()):
            i += 1
        return i

    i = j = 0
    while True:
        while i < len(a) and not (a[i].isascii() and (a[i].isalnum() or a[i] in "~-^.")):
            i += 1
        while j < len(b) and not (b[j].isascii() and (b[j].isalnum() or b[j] in "~-^.")):
            j += 1
        if "~" in (ch(a, i), ch(b, j)):
            r = sign((ch(a, i) != "~") - (ch(b, j) != "~"))
            if r:
                return r
            i, j = i + 1, j + 1
        if ch(a, i) == "" or ch(b, j) == "":
            return sign(ord(ch(a, i) or "\0") - ord(ch(b, j) or "\0"))
        for sep in "-^.":  # one after the other, within the same segment
            if sep in (ch(a, i), ch(b, j)):
                r = sign((ch(a, i) != sep) - (ch(b, j) != sep))
                if r:
                    return r
                i, j = i + 1, j + 1
        x, y = ch(a, i), ch(b, j)
        digits = (x.isascii() and x.isdigit()) or (y.isascii() and y.isdigit())
        ea, eb = run(a, i, digits), run(b, j, digits)
        if digits:
            r = sign((ea != i) - (eb != j))
            if r:
                return r
            while i < ea and a[i] == "0":
                i += 1
            while j < eb and b[j] == "0":
                j += 1
            sa, sb = a[i:ea], b[j:eb]
            r = sign(len(sa) - len(sb)) or sign((sa > sb) - (sa < sb))
        else:
            sa, sb = a[i:ea], b[j:eb]
            n = min(len(sa), len(sb))
            r = sign((sa[:n] > sb[:n]) - (sa[:n] < sb[:n])) or sign(len(sa) - len(sb))
        if r:
            return r
        i, j = ea, eb


_COUNTER = re.compile(r"\+\d+(?:-\d+)?(?=\.conf$)", re.I)


def _entry(raw: dict) -> dict:
    """One loader entry as boot.c config_entry_add_type1 keeps it: its id (the file name, case
    folded, without a boot counter "+N[-M]"), its keys (the last of each wins; `options` add up)."""
    keys: dict[str, str] = {}
    options = []
    for line in raw.get("lines") or []:
        text = line.strip()
        if not text or text.startswith("#"):
            continue
        key, _, value = text.partition(" ") if " " in text else text.partition("\t")
        value = value.strip()
        if key == "options":
            options.append(value)
        else:
            keys[key] = value
    file = raw["file"]
    return {"file": file, "id": _COUNTER.sub("", file).lower(), "keys": keys, "options": " ".join(options),
            "kernel_present": raw.get("kernel_present", True)}


def systemd_boot_order(entries: list[dict]) -> list[dict]:
    """Entries (`_entry`) in systemd-boot's order (boot.c config_entry_compare; boot counting,
    which Proxmox's entries do not use, left out): entries with a sort-key first, by sort-key,
    machine-id, then version newest first; then by id, newest first (strverscmp_improved)."""
    def compare(x: dict, y: dict) -> int:
        kx, ky = x["keys"].get("sort-key"), y["keys"].get("sort-key")
        if (kx is None) != (ky is None):
            return -1 if kx is not None else 1
        if kx is not None and ky is not None:
            for key in ("sort-key", "machine-id"):
                vx, vy = x["keys"].get(key) or "", y["keys"].get(key) or ""
                if vx != vy:
                    return -1 if vx < vy else 1
            r = -strverscmp_improved(x["keys"].get("version"), y["keys"].get("version"))
            if r:
                return r
        return -strverscmp_improved(x["id"], y["id"])
    return sorted(entries, key=functools.cmp_to_key(compare))


def _loader_conf_default(lines: list[str] | None) -> str | None:
    """loader.conf's `default` (boot.c config_defaults_load_from_file: the last one, case folded)."""
    found = None
    for line in lines or []:
        key, _, value = line.strip().partition(" ")
        if key == "default" and value.strip():
            found = value.strip().lower()
    return found


def _entry_release(entry: dict) -> str | None:
    """The kernel release an entry boots: its `linux` image's name (vmlinuz-<rel>), else `version`."""
    m = re.search(r"vmlinuz-([^/\\\s]+)$", entry["keys"].get("linux", ""))
    return m.group(1) if m else entry["keys"].get("version")


def systemd_boot_choice(esp: dict, efivars: dict, once: bool = True) -> dict:
    """{"entry", "release", "why"} of the entry systemd-boot starts from this ESP at the next boot
    (`once` False: at the boots after it, LoaderEntryOneShot left out)."""
    entries = systemd_boot_order([e for e in map(_entry, esp.get("entries") or [])
                                  if e["kernel_present"] and "linux" in e["keys"]])
    if not entries:
        return {"entry": None, "release": None, "why": "no loader entry with its kernel on the ESP"}
    for source, pattern in (("LoaderEntryOneShot", efivars.get("LoaderEntryOneShot") if once else None),
                            ("LoaderEntryDefault", efivars.get("LoaderEntryDefault")),
                            ("loader.conf default", _loader_conf_default(esp.get("loader_conf")))):
        if not pattern:
            continue
        hit = next((e for e in entries if fnmatch.fnmatchcase(e["id"], pattern.lower())), None)
        if hit is not None:
            return {"entry": hit["file"], "release": _entry_release(hit), "why": f"{source} {pattern}"}
    first = entries[0]
    return {"entry": first["file"], "release": _entry_release(first), "why": "the first entry (no default matches)"}


# -- GRUB -----------------------------------------------------------------------------------

_ITEM = re.compile(r"^\s*(menuentry|submenu)\s+(?:'([^']*)'|\"([^\"]*)\"|(\S+))(.*)\{\s*$")
_ID = re.compile(r"(?:\$menuentry_id_option|--id)\s+(?:'([^']*)'|\"([^\"]*)\"|(\S+))")


def grub_menu(lines: list[str] | None) -> list[dict]:
    """The menu of a grub.cfg: [{"title", "id", "linux" | "items": [...]}] (grub-mkconfig's form:
    one item per `menuentry`/`submenu … {` line, its `linux` line, `}` closing it)."""
    top: list[dict] = []
    stack: list[dict] = []
    for line in lines or []:
        m = _ITEM.match(line)
        if m:
            rest = m.group(5)
            ident = _ID.search(rest)
            title = m.group(2) if m.group(2) is not None else (m.group(3) if m.group(3) is not None else m.group(4))
            item: dict = {"title": title, "id": next((g for g in ident.groups() if g is not None), None) if ident else None}
            if m.group(1) == "submenu":
                item["items"] = []
            (stack[-1]["items"] if stack else top).append(item)
            stack.append(item)
            continue
        if stack and re.match(r"^\s*\}\s*$", line):
            stack.pop()
            continue
        m2 = re.match(r"^\s*linux\S*\s+(\S+)", line)
        if m2 and stack and "items" not in stack[-1]:
            stack[-1]["linux"] = m2.group(1)
    return top


def grub_resolve(menu: list[dict], default: str) -> dict | None:
    """GRUB's entry for a default (normal/menu.c get_entry_index_by_name via
    grub_menu_get_default_entry_index): per `>`-separated level a number is an index, else the
    item whose id, else title, it equals. None where it names no kernel entry."""
    items, found = menu, None
    for part in default.split(">"):
        if part.isdigit():
            found = items[int(part)] if int(part) < len(items) else None
        else:
            found = next((i for i in items if i.get("id") == part), None) \
                or next((i for i in items if i.get("title") == part), None)
        if found is None:
            return None
        items = found.get("items") or []
    return found if found is not None and "linux" in found else None


def grubenv_values(lines: list[str] | None) -> dict[str, str]:
    """grubenv's variables (lib/envblk.c: `name=value` lines after the header, '#' padding)."""
    env = {}
    for line in lines or []:
        if line and not line.startswith("#") and "=" in line:
            name, _, value = line.partition("=")
            env[name] = value
    return env


def grub_choice(cfg: list[str] | None, env_lines: list[str] | None, once: bool = True) -> dict:
    """{"entry", "release", "why"} of the entry GRUB boots with this grub.cfg and grubenv
    (00_header.in: next_entry when set, else the header's `set default=`; menu.c: an unknown
    default boots the first entry). `once` False: the default, next_entry left out."""
    menu = grub_menu(cfg)
    if not menu:
        return {"entry": None, "release": None, "why": "no grub.cfg menu"}
    env = grubenv_values(env_lines)
    defaults = [m.group(1) for line in cfg or [] if (m := re.match(r'^\s*set default="([^"]*)"\s*$', line))]
    fallback = next((d for d in defaults if d != "${next_entry}"), "0")
    tried = []
    if once and env.get("next_entry") and "${next_entry}" in defaults:
        tried.append((f"next_entry {env['next_entry']}", env["next_entry"]))
    value = fallback.replace("${saved_entry}", env.get("saved_entry", ""))
    tried.append((f"saved_entry {env.get('saved_entry', '')}" if "${saved_entry}" in fallback else f"default {fallback}",
                  value))
    for why, name in tried:
        hit = grub_resolve(menu, name) if name else None
        if hit is not None:
            return {"entry": hit.get("id") or hit["title"], "release": _grub_release(hit), "why": why}
    first = grub_resolve(menu, "0") or (grub_resolve(menu, "0>0") if menu[0].get("items") else None)
    if first is None:
        return {"entry": None, "release": None, "why": "the first entry of grub.cfg boots no kernel"}
    return {"entry": first.get("id") or first["title"], "release": _grub_release(first),
            "why": f"the first entry ({tried[-1][0] or 'no default'} names none)"}


def _grub_release(item: dict) -> str | None:
    m = re.search(r"vmlinuz-(\S+)$", item.get("linux", ""))
    return m.group(1) if m else None


# -- the decision ---------------------------------------------------------------------------


def next_boot(state: dict, once: bool = True) -> list[dict]:
    """What the loader boots next, for each place the firmware may start it from: each ESP of
    /etc/kernel/proxmox-boot-uuids (the loader refresh keeps there: `esp_loader`), else GRUB from
    /boot/grub; [] where neither is there. [{"where": "ESP 5A1C-9E27" | "/boot/grub", "loader", "entry", "release", "why"}];
    "release" None where nothing bootable was found (the "why" says what). `once` False: the
    loader's default, the boots after the next (one-shots left out)."""
    firmware = state.get("firmware")
    efivars = state.get("efivars") or {}
    out = []
    if state.get("esp_list"):
        for esp in state.get("esps") or []:
            where = f"ESP {esp['uuid']}"
            if not esp.get("mounted"):
                out.append({"where": where, "loader": None, "entry": None, "release": None,
                            "why": "the ESP could not be mounted"})
                continue
            loader = esp_loader(esp, firmware)
            if loader == SYSTEMD_BOOT:
                out.append({"where": where, "loader": loader, **systemd_boot_choice(esp, efivars, once)})
            elif loader == GRUB_ESP:
                out.append({"where": where, "loader": loader, **grub_choice(esp.get("grub_cfg"), esp.get("grubenv"), once)})
            else:
                out.append({"where": where, "loader": None, "entry": None, "release": None,
                            "why": "the ESP has neither systemd-boot (loader/loader.conf) nor GRUB (grub/) set up"})
        if out:
            return out
    if state.get("grub_cfg") is None:
        return []  # no loader this reading knows of (a VM booted by its hypervisor's kernel, a CT)
    return [{"where": "/boot/grub", "loader": GRUB, **grub_choice(state.get("grub_cfg"), state.get("grubenv"), once)}]


def next_boot_releases(state: dict, once: bool = True) -> list[str]:
    """The kernel releases `next_boot` finds, each once, in order."""
    return list(dict.fromkeys(c["release"] for c in next_boot(state, once) if c["release"]))
