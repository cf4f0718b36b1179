#!/usr/bin/python3 -IS
"""Twin stand-ins for host device tools, dispatched on the program name:

fuser            reports the busy.json holder of /dev/nvidia<minor> (psmisc output layout)
nvidia-modprobe  -u / -c=N / -m: records the call, makes the nodes when it may (root)
uname            the real uname, with the release/version of the twin's current boot
modprobe         a module the current boot lists as loaded: nothing to do (exit 0); on a twin
                 with live sysfs, a PCI driver module is loaded by its kernel model
                 (tests/twin/livesys.py); anything else goes to the real modprobe
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


HANDLERS = {"fuser": fuser, "nvidia-modprobe": nvidia_modprobe, "uname": uname, "modprobe": modprobe}
PROGRAMS = tuple(HANDLERS)


def main(prog, argv):
    """Run stand-in `prog` (what the program was called as) with `argv`; its exit status."""
    return twinstate.dispatch(HANDLERS, "hostdev", prog, argv)


if __name__ == "__main__":
    sys.exit(main(os.path.basename(sys.argv[0]), sys.argv[1:]))
