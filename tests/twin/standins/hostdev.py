#!/usr/bin/python3 -IS
"""Twin stand-ins for host device tools, dispatched on the program name:

fuser            reports the busy.json holder of /dev/nvidia<minor> (psmisc output layout)
nvidia-modprobe  -u / -c=N / -m: records the call, makes the nodes when it may (root)
uname            the real uname, with the release/version of the twin's current boot
modprobe         a module the current boot lists as loaded: nothing to do (exit 0); on a twin
                 with live sysfs, a PCI driver module is loaded by its kernel model
                 (tests/twin/livesys.py); anything else goes to the real modprobe
mokutil          --sb-state and --test-key <der> against the twin's EFI variables (/var/lib/twin/efi:
                 SecureBoot, MokListRT/*.der, MokNew/*.der; tests/twin/hardware.py writes them); follows
                 mokutil.c main(): no EFI variables -> "EFI variables are not supported on this system",
                 exit 1, before any command; test_key(): not a DER X.509 (openssl decides) -> "Not a valid
                 x509 certificate", exit 255; "<file> is not enrolled", exit 1; print_skip_message()'s
                 "is already enrolled" / "is already in the enrollment request", exit 0
zpool            get [-H] [-p] [-o property,value] all|<props> <pool>: the profile's zfs.pools (a twin
                 has no disks); follows OpenZFS zpool_main.c zpool_do_get (-H: tab-separated, no
                 header) and libzfs_pool.c zpool_prop_get_feature (feature@<name>: "disabled" when the
                 pool does not have it, "enabled" at refcount 0, else "active")
findmnt          -n -o FSTYPE|SOURCE / on a profile whose root is a ZFS dataset (zfs.root: the
                 twin's / is an overlay); anything else goes to the real findmnt
"""
import json
import os
import re
import stat
import sys

sys.dont_write_bytecode = True  # leave no __pycache__ in the twin (a --dry run must change nothing)
sys.path.insert(0, os.path.join(os.environ.get("TWIN_ROOT", "/"), "usr/local/lib/twin"))
import twinstate  # noqa: E402


def fuser(argv):
    verbose = any(a in ("-v", "--verbose") or (a.startswith("-") and not a.startswith("--") and "v" in a)
                  for a in argv)
    files = [a for a in argv if not a.startswith("-")]
    st = twinstate.state()
    by_minor = {g["minor"]: g["bdf"] for g in st.get("gpus", []) if g.get("minor") is not None}
    busy = twinstate.busy()
    found = False
    if verbose:
        sys.stderr.write(f"{'':21}USER        PID ACCESS COMMAND\n")
    for f in files:
        m = re.fullmatch(r"/dev/nvidia(\d+)", f)
        if not os.path.lexists(twinstate.path(f)):
            sys.stderr.write(f"Specified filename {f} does not exist.\n")
            continue
        holder = busy.get(by_minor.get(int(m.group(1)))) if m else None
        if not holder:
            continue
        found = True
        if verbose:
            sys.stderr.write(f"{f + ':':<20} {'root':<10}{holder['pid']:>5} F.... {holder['holder'][:15]}\n")
        else:
            sys.stderr.write(f"{f}:")
            sys.stdout.write(f" {holder['pid']}")
    if found and not verbose:
        sys.stdout.write("\n")
    return 0 if found else 1


def nvidia_modprobe(argv):
    st = twinstate.state()
    majors = st.get("char_majors", {})
    nodes = []
    uvm = any(a in ("-u", "--unified-memory") for a in argv)
    minors = [int(m.group(1)) for a in argv for m in [re.fullmatch(r"(?:-c|--create-nvidia-device-file)=?(\d+)", a)] if m]
    for i, a in enumerate(argv):
        if a in ("-c", "--create-nvidia-device-file") and i + 1 < len(argv) and argv[i + 1].isdigit():
            minors.append(int(argv[i + 1]))
    if not st.get("nvidia", {}).get("loaded"):
        return 1
    if uvm:
        if "nvidia-uvm" not in majors:
            return 1
        # -u -c=N creates the UVM node N (and the tools node); nvidia-uvm gets loaded
        for n in (minors or [0]):
            nodes.append({"path": "/dev/nvidia-uvm" if n == 0 else f"/dev/nvidia-uvm{n}", "major": majors["nvidia-uvm"], "minor": n})
        nodes.append({"path": "/dev/nvidia-uvm-tools", "major": majors["nvidia-uvm"], "minor": 1})
    else:
        for n in minors:
            if n not in {g["minor"] for g in st.get("gpus", [])}:
                return 1
            nodes.append({"path": f"/dev/nvidia{n}", "major": 195, "minor": n})
        nodes.append({"path": "/dev/nvidiactl", "major": 195, "minor": 255})
    if any(a in ("-m", "--modeset") for a in argv):
        nodes.append({"path": "/dev/nvidia-modeset", "major": 195, "minor": 254})
    made = []
    for node in nodes:
        p = twinstate.path(node["path"])
        if os.path.lexists(p):
            continue
        try:
            os.makedirs(os.path.dirname(p), exist_ok=True)
            os.mknod(p, 0o666 | stat.S_IFCHR, os.makedev(node["major"], node["minor"]))
            os.chmod(p, 0o666)
            made.append(node["path"])
        except PermissionError:
            pass  # not root (tests on a tmp root): the record below is what counts
    with open(twinstate.path(f"{twinstate.TWIN}/nvidia-modprobe.log"), "a") as f:
        f.write(json.dumps({"time": twinstate.now_iso(), "argv": argv, "nodes": nodes, "made": made}) + "\n")
    return 0


def uname(argv):
    real = "/bin/uname" if os.path.exists("/bin/uname") else "/usr/bin/uname"
    boot = twinstate.state().get("boot") or {}
    prof = twinstate.profile().get("kernel") or {}
    rel = boot.get("release")
    flags = "".join(a[1:] for a in argv if a.startswith("-") and not a.startswith("--"))
    longs = [a for a in argv if a.startswith("--")]
    if not rel or longs or not flags or set(flags) - set("snrvmpioa"):
        os.execv(real, [real] + argv)
    ver = prof.get("version", "#1 SMP PREEMPT_DYNAMIC") if rel == prof.get("release") else "#1 SMP PREEMPT_DYNAMIC"
    node = (twinstate.read("/etc/hostname") or "localhost").strip()
    vals = {"s": "Linux", "n": node, "r": rel, "v": ver, "m": "x86_64", "p": "unknown", "i": "unknown",
            "o": "GNU/Linux"}
    order = "snrvmpio"
    if "a" in flags:
        want = [c for c in order if c not in "pi"]
    else:
        want = [c for c in order if c in flags]
    sys.stdout.write(" ".join(vals[c] for c in want) + "\n")
    return 0


LOAD_MODULE = "/run/twin-sysfs/load_module"  # served by tests/twin/livesys.py on live twins


def modprobe(argv):
    real = "/usr/sbin/modprobe" if os.path.exists("/usr/sbin/modprobe") else "/sbin/modprobe"
    names = [a for a in argv if not a.startswith("-")]
    plain = not {a for a in argv if a.startswith("-")} - {"-q", "--quiet", "-v", "--verbose", "-b", "--use-blacklist"}
    if plain and names:
        name = names[0].replace("-", "_")  # kmod modprobe: the first name is the module, the rest its parameters
        st = twinstate.state()
        if name in st.get("modules", []):
            return 0  # follows kmod tools/modprobe.c: a loaded module is not an error (nothing done)
        ctl = twinstate.path(LOAD_MODULE)
        if os.path.exists(ctl):
            try:
                with open(ctl, "w") as f:
                    f.write(name + "\n")
                return 0
            except OSError:
                rel = (st.get("boot") or {}).get("release", "")
                if "-q" not in argv and "--quiet" not in argv:
                    sys.stderr.write(f"modprobe: FATAL: Module {name} not found in directory /lib/modules/{rel}\n")
                return 1
    os.execv(real, [real] + argv)


EFI = f"{twinstate.TWIN}/efi"


def _efi_files(var):
    d = twinstate.path(f"{EFI}/{var}")
    try:
        names = sorted(os.listdir(d))
    except FileNotFoundError:
        return []
    out = []
    for name in names:
        with open(os.path.join(d, name), "rb") as f:
            out.append(f.read())
    return out


def mokutil(argv):
    import subprocess

    prof = twinstate.profile()
    boot = prof.get("boot") or {}
    if not (boot.get("loader") == "systemd-boot" or boot.get("uefi")):
        sys.stderr.write("EFI variables are not supported on this system\n")
        return 1
    if argv[:1] == ["--sb-state"]:
        on = (twinstate.read(f"{EFI}/SecureBoot", "0") or "0").strip() == "1"
        sys.stdout.write("SecureBoot enabled\n" if on else "SecureBoot disabled\n")
        return 0
    if len(argv) == 2 and argv[0] in ("--test-key", "-t"):
        name = argv[1]
        try:
            with open(name, "rb") as f:
                data = f.read()
        except OSError:
            sys.stderr.write(f"Failed to open {name}\n")
            return 255
        der = subprocess.run(["openssl", "x509", "-inform", "DER", "-noout"], input=data, capture_output=True)
        if der.returncode != 0:
            sys.stderr.write("Not a valid x509 certificate\n")
            return 255
        if data in _efi_files("MokListRT"):
            sys.stdout.write(f"{name} is already enrolled\n")
            return 0
        if data in _efi_files("MokNew"):
            sys.stdout.write(f"{name} is already in the enrollment request\n")
            return 0
        sys.stdout.write(f"{name} is not enrolled\n")
        return 1
    sys.stderr.write(f"mokutil (pvegpu twin stand-in): {' '.join(argv)} is not modelled\n")
    return 1


def _zfs():
    return twinstate.profile().get("zfs") or {}


def zpool(argv):
    if argv[:1] != ["get"]:
        twinstate.die("twin: zpool stand-in: only `zpool get` is modelled", 2)
    args = argv[1:]
    scripted, fields = False, ["name", "property", "value", "source"]
    rest = []
    i = 0
    while i < len(args):
        a = args[i]
        if a == "-H":
            scripted = True
        elif a == "-p":
            pass
        elif a == "-o":
            i += 1
            fields = args[i].split(",")
        elif a.startswith("-o"):
            fields = a[2:].split(",")
        else:
            rest.append(a)
        i += 1
    if len(rest) != 2:
        twinstate.die("twin: zpool stand-in: zpool get <props> <pool>", 2)
    props, name = rest
    pool = (_zfs().get("pools") or {}).get(name)
    if pool is None:
        return twinstate.die(f"cannot open '{name}': no such pool", 1)
    # pool properties, then one feature@ per feature of the userland's table (the profile's
    # `features`: every feature the host's zpool knows, with its state on this pool)
    values = [("size", pool.get("size", "1.73T"), "-"), ("health", pool.get("health", "ONLINE"), "-")]
    values += [(f"feature@{f}", state, "local") for f, state in (pool.get("features") or {}).items()]
    wanted = None if props == "all" else props.split(",")
    rows = [(name, p, v, src) for p, v, src in values if wanted is None or p in wanted]
    col = {"name": 0, "property": 1, "value": 2, "source": 3}
    out = []
    if not scripted:
        out.append("  ".join(f.upper() for f in fields))
    for row in rows:
        out.append(("\t" if scripted else "  ").join(row[col[f]] for f in fields))
    sys.stdout.write("".join(line + "\n" for line in out))
    return 0


def findmnt(argv):
    root = _zfs().get("root")
    opts = [a for a in argv if a != "-n"]
    if root and "-n" in argv and len(opts) == 3 and opts[0] == "-o" and opts[2] == "/" and opts[1] in ("FSTYPE", "SOURCE"):
        sys.stdout.write(("zfs" if opts[1] == "FSTYPE" else root) + "\n")
        return 0
    os.execv("/usr/bin/findmnt", ["findmnt", *argv])


HANDLERS = {"zpool": zpool, "findmnt": findmnt, "fuser": fuser, "nvidia-modprobe": nvidia_modprobe, "uname": uname, "modprobe": modprobe,
            "mokutil": mokutil}
PROGRAMS, main = twinstate.standin(HANDLERS, "hostdev")

if __name__ == "__main__":
    twinstate.run_program(main)
