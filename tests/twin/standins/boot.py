#!/usr/bin/python3 -IS
"""Twin stand-ins for booting, dispatched on the program name:

proxmox-boot-tool  status | refresh | kernel list | kernel pin <rel> [--next-boot] | kernel unpin [--next-boot]
update-grub        writes /boot/grub/grub.cfg from /etc/default/grub as grub-mkconfig would
                   (it cannot probe devices inside the twin), running the other scripts of
                   /etc/grub.d; grub-reboot, grub-set-default and grub-editenv are the real
                   Debian programs (grub2-common)
10_linux           /etc/grub.d/10_linux: the Linux entries for the exported GRUB_* values
grub-probe         --target=abstraction|fs only (the profile's boot.grubenv_abstraction, grubenv_fs)
bootctl            set-oneshot | set-default: the EFI variable, in the twin's NVRAM
                   (/var/lib/twin/efivars, read and cleared by the twin's boot)
reboot, shutdown -r, systemctl reboot   ask the twin's supervisor for a reboot (TWIN-CONTRACT)
systemctl is-system-running [--wait]     "starting" while the boot's onboot guest starts run, then
                   "running" (tests/twin/runtime.py Supervisor.boot)

zz-proxmox-boot    the kernel hook (/etc/kernel/postinst.d, postrm.d) a kernel package's postinst runs

State: pins in /etc/kernel/proxmox-boot-pin and /etc/kernel/next-boot-pin (as Proxmox keeps them);
the ESPs of /etc/kernel/proxmox-boot-uuids under /var/lib/twin/esp/<uuid>/ (loader/loader.conf,
loader/entries/proxmox-<rel>.conf, EFI/proxmox/<rel>/): written only by `refresh` and the hook,
read by the twin's reboot. `kernel pin` on such a host writes the pin file only.
"""
import os
import re
import shutil
import sys
import time

sys.dont_write_bytecode = True  # leave no __pycache__ in the twin (a --dry run must change nothing)
sys.path.insert(0, os.path.join(os.environ.get("TWIN_ROOT", "/"), "usr/local/lib/twin"))
import twinstate  # noqa: E402

PIN = "/etc/kernel/proxmox-boot-pin"
NEXT = "/etc/kernel/next-boot-pin"
ESP_LIST = "/etc/kernel/proxmox-boot-uuids"
# The twin's ESPs: one directory per UUID of ESP_LIST, standing for /dev/disk/by-uuid/<uuid>
# mounted (what systemd-boot reads at the twin's reboot: tests/twin/hardware.py esp_boot_entry).
ESP_ROOT = "/var/lib/twin/esp"
PMX_ESP_DIR = "EFI/proxmox"
LOADER_CONF = "loader/loader.conf"
VFAT_UUID = re.compile(r"[0-9a-fA-F]{4}-[0-9a-fA-F]{4}")


def warn(msg):
    sys.stderr.write(msg + "\n")


def first_line(p):
    """follows proxmox-kernel-helper functions get_first_line(): first line, "" when absent."""
    text = twinstate.read(p)
    return text.split("\n", 1)[0] if text else ""


def kernels():
    """Installed kernels: /boot/vmlinuz-<rel> with /lib/modules/<rel>, oldest first."""
    out = []
    boot = twinstate.path("/boot")
    for name in os.listdir(boot) if os.path.isdir(boot) else []:
        if name.startswith("vmlinuz-"):
            rel = name[len("vmlinuz-"):]
            if os.path.isdir(twinstate.path(f"/lib/modules/{rel}")):
                out.append(rel)
    return sorted(out, key=twinstate.version_key)


def esp_uuids():
    """follows functions loop_esp_list(): non-empty lines of ESP_LIST."""
    return [u.strip() for u in (twinstate.read(ESP_LIST) or "").splitlines() if u.strip()]


def pbt_status(argv=()):
    """follows proxmox-boot-tool status()/_status_detail(): per listed ESP, the kernel versions
    synced onto it (its EFI/proxmox/ directories, as `ls -1` lists them), not those in /boot."""
    quiet = "--quiet" in argv
    if not os.path.isfile(twinstate.path(ESP_LIST)):
        if quiet:
            return 2
        twinstate.die(f"E: {ESP_LIST} does not exist.", 2)
    if quiet:
        return 0
    print("Re-executing '/usr/sbin/proxmox-boot-tool' in new private mount namespace..")
    print("System currently booted with uefi")
    for u in esp_uuids():
        esp = twinstate.path(f"{ESP_ROOT}/{u}")
        if not VFAT_UUID.search(u):
            warn(f"WARN: {u} read from {ESP_LIST} does not look like a VFAT-UUID - skipping")
            continue
        if not os.path.isdir(esp):
            warn(f"WARN: /dev/disk/by-uuid/{u} does not exist - clean '{ESP_LIST}'! - skipping")
            continue
        result = ""
        if os.path.isfile(os.path.join(esp, LOADER_CONF)):
            kdir = os.path.join(esp, PMX_ESP_DIR)
            versions = sorted(os.listdir(kdir)) if os.path.isdir(kdir) else []
            result = f"uefi (versions: {', '.join(versions)})"
        print(f"{u} is configured with: {result}")
    return 0


def esp_cmdline():
    """follows zz-proxmox-boot update_esps(): the first line of /etc/kernel/cmdline (it must
    carry root=), else /proc/cmdline without its initrd= entries. None: refuse."""
    if os.path.isfile(twinstate.path("/etc/kernel/cmdline")):
        cmdline = first_line("/etc/kernel/cmdline")
        if "root=" not in cmdline:
            warn("No root= parameter in /etc/kernel/cmdline found!")
            return None
        return cmdline
    warn("No /etc/kernel/cmdline found - falling back to /proc/cmdline")
    # (/proc/cmdline is the rendered hw/proc/cmdline; outside a running twin read that file)
    proc = (twinstate.read("/proc/cmdline") or twinstate.read("/var/lib/twin/hw/proc/cmdline") or "").strip()
    return re.sub(r"\binitrd=[0-9a-zA-Z\\/.-]*\s*", "", proc).strip()


def esp_sync(install_version=None):
    """follows zz-proxmox-boot update_esps()/update_esp_func(): copy each kernel with an
    initrd to every listed ESP, write its loader entry, point loader.conf's default at the
    next-boot pin, else the pin, else `proxmox-*` (systemd-boot then takes the newest), and
    drop kernels no longer installed. No ESP list: nothing is synced."""
    if not os.path.isfile(twinstate.path(ESP_LIST)):
        warn(f"No {ESP_LIST} found, skipping ESP sync.")
        return 0
    cmdline = esp_cmdline()
    if cmdline is None:
        return 1
    boot_kvers = kernels()
    if install_version and install_version not in boot_kvers and os.path.exists(twinstate.path(f"/boot/vmlinuz-{install_version}")):
        boot_kvers.append(install_version)
    for uuid in esp_uuids():
        if not VFAT_UUID.search(uuid):
            warn(f"WARN: {uuid} read from {ESP_LIST} does not look like a VFAT-UUID - skipping")
            continue
        esp = twinstate.path(f"{ESP_ROOT}/{uuid}")
        dev = f"/dev/disk/by-uuid/{uuid}"
        if not os.path.isdir(esp):
            warn(f"WARN: {dev} does not exist - clean '{ESP_LIST}'! - skipping")
            continue
        if not os.path.isfile(os.path.join(esp, LOADER_CONF)):
            warn(f"{dev} contains no loader.conf - skipping")
            continue
        warn(f"Copying and configuring kernels on {dev}")
        os.makedirs(os.path.join(esp, "loader/entries"), exist_ok=True)
        for kver in boot_kvers:
            image, initrd = f"/boot/vmlinuz-{kver}", f"/boot/initrd.img-{kver}"
            if not os.path.isfile(twinstate.path(image)):
                warn(f"No linux-image {image} found - skipping")
                continue
            if not os.path.isfile(twinstate.path(initrd)):
                warn(f"No initrd-image {initrd} found - skipping")
                continue
            warn(f"\tCopying kernel and creating boot-entry for {kver}")
            live = os.path.join(esp, PMX_ESP_DIR, kver)
            os.makedirs(live, exist_ok=True)
            for src in (image, initrd):
                shutil.copy2(twinstate.path(src), live)
            with open(os.path.join(esp, f"loader/entries/proxmox-{kver}.conf"), "w") as f:
                f.write(f"title    Proxmox Virtual Environment\nversion  {kver}\noptions  {cmdline}\n"
                        f"linux    /{PMX_ESP_DIR}/{kver}/vmlinuz-{kver}\ninitrd   /{PMX_ESP_DIR}/{kver}/initrd.img-{kver}\n")
        pinned = first_line(PIN)
        if os.path.exists(twinstate.path(NEXT)):
            pinned = first_line(NEXT)
        set_loader_default(os.path.join(esp, LOADER_CONF), f"proxmox-{pinned}.conf" if pinned else "proxmox-*")
        # follows zz-proxmox-boot remove_old_kernels_efi(): kernels not in the boot list go
        kdir = os.path.join(esp, PMX_ESP_DIR)
        for kver in sorted(os.listdir(kdir)) if os.path.isdir(kdir) else []:
            if kver not in boot_kvers:
                warn(f"\tRemoving old version {kver}")
                shutil.rmtree(os.path.join(kdir, kver), ignore_errors=True)
                entry = os.path.join(esp, f"loader/entries/proxmox-{kver}.conf")
                if os.path.exists(entry):
                    os.unlink(entry)
    return 0


def set_loader_default(conf, entry):
    """follows functions set_systemd_boot_default(): replace the `default` line, else append one."""
    with open(conf) as f:
        lines = f.read().splitlines()
    done = False
    for i, line in enumerate(lines):
        if line.startswith("default "):
            lines[i] = f"default {entry}"
            done = True
    if not done:
        lines.append(f"default {entry}")
    with open(conf, "w") as f:
        f.write("\n".join(lines) + "\n")


def pbt_refresh(argv=()):
    """follows proxmox-boot-tool refresh(): run the kernel hooks proxmox-auto-removal and
    zz-proxmox-boot (the twin's auto-removal keeps every kernel)."""
    print("Running hook script 'proxmox-auto-removal'..")
    print("Running hook script 'zz-proxmox-boot'..")
    print("Re-executing '/etc/kernel/postinst.d/zz-proxmox-boot' in new private mount namespace..")
    return esp_sync()


def zz_proxmox_boot(argv):
    """/etc/kernel/{postinst,postrm}.d/zz-proxmox-boot as a kernel package's maintainer script
    runs it (run-parts --arg=<version> --arg=<image>): follows zz-proxmox-boot's case on
    $DEB_MAINT_PARAMS (configure/remove or none: sync the ESPs)."""
    params = (os.environ.get("DEB_MAINT_PARAMS") or "").split()
    mode = params[0].strip("'") if params else ""
    if mode not in ("", "configure", "remove"):
        return 0
    return esp_sync(argv[0] if argv and mode != "remove" else None)


def pbt_kernel(args):
    if not args:
        twinstate.die("USAGE: proxmox-boot-tool kernel <add|remove|list|pin|unpin> [<kernel-version>]", 2)
    op, rest = args[0], args[1:]
    next_boot = "--next-boot" in rest
    rest = [a for a in rest if a != "--next-boot"]
    if op == "list":
        print("Manually selected kernels:\nNone.\n")
        print("Automatically selected kernels:")
        print("\n".join(kernels()))
        pin, nxt = first_line(PIN), first_line(NEXT)
        if pin:
            print(f"\nPinned kernel:\n{pin}")
        if nxt:
            print(f"\nKernel pinned on next-boot:\n{nxt}")
        return 0
    if op == "pin":
        # follows proxmox-boot-tool pin_kernel()
        if not rest:
            twinstate.die("E: <kernel-version> is mandatory", 1)
        rel = rest[0]
        if not os.path.exists(twinstate.path(f"/boot/vmlinuz-{rel}")):
            twinstate.die(f"E: no kernel image found in /boot for '{rel}', not setting default.", 1)
        where = NEXT if next_boot else PIN
        old = first_line(where)
        if old and old != rel:
            print(f"Overriding previously pinned version '{old}' with '{rel}'")
        twinstate.write(where, rel + "\n")
        if os.path.isfile(twinstate.path(ESP_LIST)):
            # ESPs listed: only the pin file; the loader changes at `refresh` (no terminal: no prompt)
            print(f"Set kernel '{rel}' in {where}. Use the 'refresh' command to update the ESPs.")
        else:
            kver = first_line(NEXT) or rel
            print(f"Setting '{kver}' as grub default entry and running update-grub.")
            set_grub_default(kver)
            update_grub([])
        if next_boot:
            print("Pinned for next boot only.")
        return 0
    if op == "unpin":
        # follows proxmox-boot-tool unpin_kernel(): --next-boot removes only that pin
        last = first_line(NEXT)
        p = twinstate.path(NEXT)
        if os.path.exists(p):
            os.unlink(p)
        print(f"Removed {NEXT}.")
        if not next_boot:
            last = first_line(PIN) or last
            if os.path.exists(twinstate.path(PIN)):
                os.unlink(twinstate.path(PIN))
            print(f"Removed {PIN}.")
        if os.path.isfile(twinstate.path(ESP_LIST)):
            if last:
                print(f"Unpinned kernel '{last}'. Use the 'refresh' command to update the ESPs.")
        else:
            print("Reset default grub entry and running update-grub.")
            set_grub_default(first_line(PIN))
            update_grub([])
        return 0
    twinstate.die(f"E: invalid 'kernel' subcommand '{op}'.", 1)


def proxmox_boot_tool(argv):
    if not argv:
        twinstate.die("USAGE: proxmox-boot-tool <commands> [ARGS]", 2)
    cmd = argv[0]
    if cmd == "status":
        return pbt_status(argv[1:])
    if cmd == "refresh":
        return pbt_refresh(argv[1:])
    if cmd == "kernel":
        return pbt_kernel(argv[1:])
    twinstate.die(f"E: unknown command '{cmd}'", 2)


GRUB_PIN_SNIPPET = "/etc/default/grub.d/proxmox-kernel-pin.cfg"


def set_grub_default(kver):
    """follows proxmox-kernel-helper functions set_grub_default(): GRUB_DEFAULT naming the
    kernel's entry in the Advanced-options submenu (its id read from grub.cfg), or no snippet."""
    if not kver:
        p = twinstate.path(GRUB_PIN_SNIPPET)
        if os.path.exists(p):
            os.unlink(p)
        return
    m = re.search(r"gnulinux-advanced-(.+)' \{$", twinstate.read("/boot/grub/grub.cfg") or "", re.M)
    devid = m.group(1) if m else ""
    twinstate.write(GRUB_PIN_SNIPPET, f'GRUB_DEFAULT="gnulinux-advanced-{devid}>gnulinux-{kver}-advanced-{devid}"\n')


GRUB_NAMES = ("GRUB_CMDLINE_LINUX", "GRUB_CMDLINE_LINUX_DEFAULT", "GRUB_DEFAULT", "GRUB_DISTRIBUTOR",
              "GRUB_DISABLE_RECOVERY", "GRUB_DISABLE_SUBMENU")


def grub_defaults():
    """Values of /etc/default/grub (+ grub.d/*.cfg) as the shell sees them (grub-mkconfig sources
    them in this order)."""
    files = [twinstate.path("/etc/default/grub")]
    d = twinstate.path("/etc/default/grub.d")
    if os.path.isdir(d):
        files += [os.path.join(d, f) for f in sorted(os.listdir(d)) if f.endswith(".cfg")]
    script = "".join(f'[ -f "{f}" ] && . "{f}"\n' for f in files)
    script += "".join(f'printf "%s\\n" "${name}"\n' for name in GRUB_NAMES)
    import subprocess  # only update-grub needs it; proxmox-boot-tool status runs on every converge

    out = subprocess.run(["/bin/sh", "-c", script], capture_output=True, text=True).stdout.split("\n")
    return dict(zip(GRUB_NAMES, out, strict=False))


def grub_device_id():
    """The id 10_linux puts in the entry ids (boot_device_id: the root file system's UUID)."""
    boot = twinstate.profile().get("boot") or {}
    if boot.get("fs_uuid"):
        return boot["fs_uuid"]
    import hashlib
    h = hashlib.sha256(str(twinstate.profile().get("name", "twin")).encode()).hexdigest()
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


def grub_10_linux(g):
    """What /etc/grub.d/10_linux prints for the GRUB_* values `g` (grub-mkconfig exports them to
    every script): follows 10_linux.in: a plain entry for the newest kernel, then the 'Advanced
    options' submenu with every kernel, newest first, each with its recovery entry unless
    GRUB_DISABLE_RECOVERY=true; with GRUB_DISABLE_SUBMENU true/y/yes no plain entry and no
    submenu, every kernel's entry at the top level; ids gnulinux-simple-<dev>,
    gnulinux-advanced-<dev>, gnulinux-<version>-advanced-<dev>; args GRUB_CMDLINE_LINUX then
    GRUB_CMDLINE_LINUX_DEFAULT."""
    root = (twinstate.profile().get("boot") or {}).get("root", "/dev/mapper/pve-root")
    dev = grub_device_id()
    os_name = f"{g.get('GRUB_DISTRIBUTOR') or 'Debian'} GNU/Linux"
    flat = (g.get("GRUB_DISABLE_SUBMENU") or "") in ("true", "y", "yes")
    rels = list(reversed(kernels()))
    out = []

    def entry(title, ident, rel, args, indent=""):
        return (f"{indent}menuentry '{title}' --class proxmox $menuentry_id_option '{ident}' {{\n"
                f"{indent}\tlinux\t/boot/vmlinuz-{rel} root={root} ro {args}\n"
                f"{indent}\tinitrd\t/boot/initrd.img-{rel}\n{indent}}}\n")

    normal = f"{g.get('GRUB_CMDLINE_LINUX') or ''} {g.get('GRUB_CMDLINE_LINUX_DEFAULT') or ''}".strip()
    indent = ""
    for i, rel in enumerate(rels):
        sys.stderr.write(f"Found linux image: /boot/vmlinuz-{rel}\nFound initrd image: /boot/initrd.img-{rel}\n")
        if i == 0 and not flat:
            out.append(entry(os_name, f"gnulinux-simple-{dev}", rel, normal))
            out.append(f"submenu 'Advanced options for {os_name}' $menuentry_id_option 'gnulinux-advanced-{dev}' {{\n")
            indent = "\t"
        out.append(entry(f"{os_name}, with Linux {rel}", f"gnulinux-{rel}-advanced-{dev}", rel, normal, indent))
        if g.get("GRUB_DISABLE_RECOVERY") != "true":
            out.append(entry(f"{os_name}, with Linux {rel} (recovery mode)", f"gnulinux-{rel}-recovery-{dev}", rel,
                             " ".join(x for x in ("single", g.get("GRUB_CMDLINE_LINUX")) if x), indent))
    if rels and not flat:
        out.append("}\n")
    return "".join(out)


def linux_10(argv):
    """/etc/grub.d/10_linux run by itself (a grub.d script of ours runs it): the GRUB_* values
    from the environment, as grub-mkconfig exported them."""
    sys.stdout.write(grub_10_linux({name: os.environ.get(name, "") for name in GRUB_NAMES}))
    return 0


GRUB_D = "/etc/grub.d"
# grub-common's scripts that the twin does not run: 00_header and 10_linux are the stand-in's own
# (update_grub, grub_10_linux: the real ones probe devices the twin cannot show); the theme, Xen,
# os-prober and firmware-setup scripts add no Linux entry on a server. Every other executable
# script of /etc/grub.d (40_custom, 41_custom, those other packages or the admin put there) runs.
GRUB_D_OWN = ("00_header", "10_linux")
GRUB_D_NOT_MODELLED = ("05_debian_theme", "20_linux_xen", "30_os-prober", "30_uefi-firmware")


def grub_file_is_not_garbage(name):
    """follows grub-mkconfig_lib grub_file_is_not_garbage() (and grub-mkconfig's editor backups)."""
    return not (name.endswith("~") or (name.startswith("#") and name.endswith("#")) or ".dpkg-" in name
                or name.endswith((".rpmsave", ".rpmnew", ".sig")) or name.startswith("README"))


def update_grub(argv):
    """grub-mkconfig cannot probe devices inside the twin; this writes what it would:
    follows grub-mkconfig.in (GRUB_DEFAULT=saved becomes ${saved_entry}; the scripts of
    /etc/grub.d run in name order with GRUB_* exported, each one's output between BEGIN/END
    lines), util/grub.d/00_header.in (load_env; next_entry boots once and is cleared with
    save_env; else the default) and 10_linux.in (grub_10_linux). The scripts other than the
    stand-in's own run only inside the twin (TWIN_ROOT /): never on the machine that seeds it."""
    import subprocess

    g = grub_defaults()
    default = g["GRUB_DEFAULT"] or "0"
    if default == "saved":
        default = "${saved_entry}"
    sys.stderr.write("Generating grub configuration file ...\n")
    out = ["### generated by the twin's update-grub stand-in ###\n",
           "### BEGIN /etc/grub.d/00_header ###\n",
           "if [ -s $prefix/grubenv ]; then\n  set have_grubenv=true\n  load_env\nfi\n",
           'if [ "${next_entry}" ] ; then\n   set default="${next_entry}"\n   set next_entry=\n'
           "   save_env next_entry\n   set boot_once=true\nelse\n"
           f'   set default="{default}"\nfi\n',
           "### END /etc/grub.d/00_header ###\n"]
    env = {**os.environ, **g}
    grub_d = twinstate.path(GRUB_D)
    for name in sorted(os.listdir(grub_d)) if os.path.isdir(grub_d) else ["10_linux"]:
        script = os.path.join(grub_d, name)
        if name == "00_header" or name in GRUB_D_NOT_MODELLED or not grub_file_is_not_garbage(name):
            continue
        if name == "10_linux":
            text = grub_10_linux(g)
        elif twinstate.ROOT != "/" or not (os.path.isfile(script) and os.access(script, os.X_OK)):
            continue
        else:
            done = subprocess.run([script], env=env, stdout=subprocess.PIPE, text=True)
            if done.returncode != 0:
                twinstate.die(f"/usr/sbin/grub-mkconfig: {script} failed (exit {done.returncode})", 1)
            text = done.stdout
        out.append(f"### BEGIN {GRUB_D}/{name} ###\n{text}### END {GRUB_D}/{name} ###\n")
    twinstate.write("/boot/grub/grub.cfg", "".join(out))
    sys.stderr.write("done\n")
    return 0


# -- EFI variables and the programs that set them ------------------------------------------

# The twin's NVRAM: one file per variable, in efivarfs' format (4 bytes of attributes, then the
# data), kept across reboots; the twin's boot (tests/twin/hardware.py) reads and deletes them.
EFIVARS = "/var/lib/twin/efivars"
LOADER_GUID = "4a67b082-0a4c-41cf-b6c7-440b29bb8c4f"


def bootctl(argv):
    """bootctl set-oneshot / set-default ID: follows systemd src/boot/bootctl.c verb_set_efivar():
    refused unless booted with UEFI through a boot loader that implements the interface
    (LoaderInfo; here: a systemd-boot profile), then the id as a UTF-16LE NUL-terminated string
    (LoaderEntryOneShot / LoaderEntryDefault). The id is not checked against the entries (as
    bootctl does not); `@current`/`@default`/`@oneshot` are not modelled and refused."""
    verbs = [a for a in argv if not a.startswith("-")]
    names = {"set-oneshot": "LoaderEntryOneShot", "set-default": "LoaderEntryDefault"}
    if not verbs or verbs[0] not in names:
        twinstate.die("twin: bootctl stand-in: only set-oneshot and set-default are modelled", 1)
    if len(verbs) != 2:
        twinstate.die(f"bootctl: '{verbs[0]}' takes one entry id.", 1)
    if (twinstate.profile().get("boot") or {}).get("loader") != "systemd-boot":
        twinstate.die("Not booted with a supported boot loader.", 1)
    ident = verbs[1]
    if ident.startswith("@"):
        twinstate.die(f"twin: bootctl stand-in: special entry {ident} is not modelled", 1)
    os.makedirs(twinstate.path(EFIVARS), exist_ok=True)
    with open(twinstate.path(f"{EFIVARS}/{names[verbs[0]]}-{LOADER_GUID}"), "wb") as f:
        f.write(b"\x07\x00\x00\x00" + ident.encode("utf-16-le") + b"\x00\x00")
    return 0


def grub_probe(argv):
    """grub-probe --target=abstraction|fs PATH: what the profile says holds /boot/grub
    (boot.grubenv_abstraction, e.g. `lvm`; empty: a plain partition; boot.grubenv_fs, GRUB's
    name of its file system: `ext2` for ext2/3/4 (grub-core/fs/ext2.c), `btrfs`, `zfs`, …;
    ext2 when the profile says none). Every other use fails as the real grub-probe does inside
    the twin (it cannot see the twin's block devices)."""
    targets = [a.split("=", 1)[1] for a in argv if a.startswith("--target=")]
    boot = twinstate.profile().get("boot") or {}
    if targets == ["abstraction"]:
        value = boot.get("grubenv_abstraction")
        if value is not None:
            if value:
                print(value)
            return 0
    if targets == ["fs"] and boot.get("grubenv_abstraction") is not None:
        print(boot.get("grubenv_fs") or "ext2")
        return 0
    twinstate.die("grub-probe: error: failed to get canonical path of `overlay'.", 1)


def request_reboot(how):
    """Log now; touch the request from a detached child a moment later, so the caller (often an
    SSH session) gets its exit status before the supervisor kills sshd, as with a real reboot."""
    with open(twinstate.path("/var/lib/twin/reboot.log"), "a") as f:
        f.write(f"{twinstate.now_iso()} {how}\n")
    if os.fork() == 0:
        os.setsid()
        devnull = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(devnull, fd)
        time.sleep(0.3)
        with open(twinstate.path("/var/lib/twin/reboot-request"), "w") as f:
            f.write(how + "\n")
        os._exit(0)
    return 0


# Written by the twin's supervisor (tests/twin/runtime.py Supervisor.boot) before sshd starts and
# removed once the boot's jobs (the onboot guest starts, as pve-guests.service) are done.
BOOT_JOBS = "/run/twin/boot-jobs"


def is_system_running(argv):
    """`systemctl is-system-running [--wait] [-q]`: "starting" while the boot's jobs run, then
    "running"; exit 0 only for "running"; --wait blocks while the boot is not done."""
    # systemd src/systemctl/systemctl-is-system-running.c verb_is_system_running: with --wait and the
    # state "initializing"/"starting" it waits for the manager's StartupFinished, then prints the state
    while "--wait" in argv and os.path.exists(twinstate.path(BOOT_JOBS)):
        time.sleep(0.1)
    state = "starting" if os.path.exists(twinstate.path(BOOT_JOBS)) else "running"
    if "-q" not in argv and "--quiet" not in argv:
        print(state)
    return 0 if state == "running" else 1


def systemctl(argv):
    verbs = [a for a in argv if not a.startswith("-")]
    if verbs[:1] == ["reboot"]:
        return request_reboot("systemctl " + " ".join(argv))
    if verbs[:1] == ["is-system-running"]:
        return is_system_running(argv)
    for real in ("/usr/bin/systemctl", "/bin/systemctl"):
        if os.path.exists(real) and os.path.realpath(real) != os.path.realpath(sys.argv[0]):
            os.execv(real, [real] + argv)
    twinstate.die("System has not been booted with systemd as init system (PID 1). Can't operate.", 1)


def shutdown(argv):
    if "-r" in argv or "--reboot" in argv:
        return request_reboot("shutdown " + " ".join(argv))
    twinstate.die("twin: only 'shutdown -r' is supported (a twin cannot power off)", 1)


HANDLERS = {"proxmox-boot-tool": proxmox_boot_tool, "update-grub": update_grub, "zz-proxmox-boot": zz_proxmox_boot,
            "10_linux": linux_10,
            "bootctl": bootctl, "grub-probe": grub_probe,
            "reboot": lambda a: request_reboot("reboot " + " ".join(a)), "shutdown": shutdown,
            "systemctl": systemctl}
PROGRAMS, main = twinstate.standin(HANDLERS, "boot")

if __name__ == "__main__":
    twinstate.run_program(main)
