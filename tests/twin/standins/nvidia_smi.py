#!/usr/bin/python3 -IS
"""Twin stand-in for nvidia-smi: answers from hw/state.json in the real tool's formats.

GPUs bound to anything but nvidia are invisible (as on a real host). Supported: (no args) table,
-L, -i, topo -m, topo -p2p r|w|n|a|p, --query-gpu=... / --query-compute-apps=... with
--format=csv[,noheader][,nounits], --version.

In an LXC container (TWIN_CT=1, set by the /usr/bin/nvidia-smi that tests/twin/installer.py installs;
TWIN_ROOT then points at the twin's state mounted in the CT) it answers as NVML does there, from the
CT's own root: libnvidia-ml.so.1 missing -> exit 12; no /dev/nvidiactl or no driver -> exit 9;
library version != /proc/driver/nvidia/version -> "Driver/library version mismatch", exit 18; else
only GPUs whose /dev/nvidia<minor> exists, indexed 0.. in minor order.
"""
import os
import re
import stat
import sys
import time

sys.dont_write_bytecode = True  # leave no __pycache__ in the twin (a --dry run must change nothing)
sys.path.insert(0, os.path.join(os.environ.get("TWIN_ROOT", "/"), "usr/local/lib/twin"))
import twinstate  # noqa: E402

U, R = "\x1b[4m", "\x1b[0m"  # the real tool underlines the header even into a pipe

LEGEND = """
Legend:

  X    = Self
  SYS  = Connection traversing PCIe as well as the SMP interconnect between NUMA nodes (e.g., QPI/UPI)
  NODE = Connection traversing PCIe as well as the interconnect between PCIe Host Bridges within a NUMA node
  PHB  = Connection traversing PCIe as well as a PCIe Host Bridge (typically the CPU)
  PXB  = Connection traversing multiple PCIe bridges (without traversing the PCIe Host Bridge)
  PIX  = Connection traversing at most a single PCIe bridge
  NV#  = Connection traversing a bonded set of # NVLinks
"""

P2P_LEGEND = ["  X    = Self", "  OK   = Status Ok", "  CNS  = Chipset not supported",
              "  GNS  = GPU not supported", "  TNS  = Topology not supported", "  NS   = Not supported"]

GEN = {"2.5": 1, "5.0": 2, "8.0": 3, "16.0": 4, "32.0": 5, "64.0": 6}


def bus_id(bdf):
    dom, rest = bdf.split(":", 1)
    return f"0000{dom}:{rest}".upper()


def visible(st):
    return sorted((g for g in st.get("gpus", []) if g.get("index") is not None), key=lambda g: g["index"])


def select(gpus, ids):
    if not ids:
        return gpus
    out = []
    for want in ids.split(","):
        want = want.strip()
        for g in gpus:
            if want in (str(g["index"]), g["uuid"], g["bdf"], bus_id(g["bdf"])) or \
                    bus_id(g["bdf"]).endswith(want.upper()):
                out.append(g)
    if not out:
        twinstate.die("No devices were found", 6)
    return out


def query_gpu_fields(st, g, count):
    link = g.get("link") or {}
    speed = lambda s: GEN.get((s or "").split()[0], "[N/A]") if s else "[N/A]"  # noqa: E731
    used = 512 if g["bdf"] in twinstate.busy() else 0
    return {
        "index": (str(g["index"]), ""), "count": (str(count), ""),
        "name": (g["name"], ""), "gpu_name": (g["name"], ""),
        "pci.bus_id": (bus_id(g["bdf"]), ""), "gpu_bus_id": (bus_id(g["bdf"]), ""),
        "pci.domain": ("0x" + g["bdf"][:4].upper(), ""), "pci.bus": ("0x" + g["bdf"][5:7].upper(), ""),
        "pci.device": ("0x" + g["bdf"][8:10].upper(), ""),
        "pci.device_id": (g["device_id"], ""), "pci.sub_device_id": (g["subsystem_id"], ""),
        "uuid": (g["uuid"], ""), "gpu_uuid": (g["uuid"], ""), "serial": (g["serial"], ""),
        "gpu_serial": (g["serial"], ""), "vbios_version": (g["vbios"], ""),
        "driver_version": (st["nvidia"]["version"], ""),
        "minor_number": (str(g["minor"]), ""),
        "memory.total": (str(g["memory_mib"]), "MiB"), "memory.used": (str(used), "MiB"),
        "memory.free": (str(g["memory_mib"] - used), "MiB"),
        "persistence_mode": ("Enabled", ""), "compute_cap": (g.get("compute_cap", "[N/A]"), ""),
        "pcie.link.gen.current": (str(speed(link.get("speed"))), ""),
        "pcie.link.gen.max": (str(speed(link.get("max_speed"))), ""),
        "pcie.link.gen.gpucurrent": (str(speed(link.get("speed"))), ""),
        "pcie.link.gen.gpumax": (str(speed(link.get("max_speed"))), ""),
        "pcie.link.width.current": (str(link.get("width", "[N/A]")), ""),
        "pcie.link.width.max": (str(link.get("max_width", "[N/A]")), ""),
        "temperature.gpu": ("30", ""), "utilization.gpu": ("0", "%"), "utilization.memory": ("0", "%"),
        "power.draw": ("30.00", "W"), "power.limit": (f"{g.get('power_limit_w', 300)}.00", "W"),
        "mig.mode.current": ("Disabled", ""), "mig.mode.pending": ("Disabled", ""),
        "compute_mode": ("Default", ""), "pstate": ("P8", ""), "fan.speed": ("[N/A]", "%"),
        "display_mode": ("Disabled", ""), "ecc.mode.current": ("Enabled", ""),
    }


CANONICAL = {"gpu_name": "name", "gpu_bus_id": "pci.bus_id", "gpu_uuid": "uuid", "gpu_serial": "serial"}


def csv(rows, fields, units_of, fmt):
    noheader, nounits = "noheader" in fmt, "nounits" in fmt
    out = []
    if not noheader:
        out.append(", ".join(f"{f} [{units_of[f]}]" if units_of.get(f) and not nounits else f for f in fields))
    for row in rows:
        out.append(", ".join(v if nounits or not u or v.startswith("[") else f"{v} {u}" for v, u in row))
    return "".join(line + "\n" for line in out)


def query_gpu(st, gpus, spec, fmt):
    fields = [f.strip() for f in spec.split(",") if f.strip()]
    rows, units = [], {}
    for g in gpus:
        table = query_gpu_fields(st, g, len(gpus))
        for f in fields:
            if f not in table:
                twinstate.die(f'Field "{f}" is not a valid field to query.', 2)
        rows.append([table[f] for f in fields])
        units = {f: table[f][1] for f in fields}
    return csv(rows, [CANONICAL.get(f, f) for f in fields], {CANONICAL.get(f, f): u for f, u in units.items()}, fmt)


def query_apps(st, gpus, spec, fmt):
    fields = [f.strip() for f in spec.split(",") if f.strip()]
    busy = twinstate.busy()
    names = {"used_memory": "used_gpu_memory", "name": "process_name"}
    rows = []
    for g in gpus:
        if g["bdf"] not in busy:
            continue
        b = busy[g["bdf"]]
        table = {"pid": (str(b["pid"]), ""), "process_name": (b["holder"], ""), "name": (b["holder"], ""),
                 "gpu_bus_id": (bus_id(g["bdf"]), ""), "gpu_uuid": (g["uuid"], ""), "gpu_name": (g["name"], ""),
                 "gpu_serial": (g["serial"], ""), "used_memory": ("512", "MiB"), "used_gpu_memory": ("512", "MiB")}
        for f in fields:
            if f not in table:
                twinstate.die(f'Field "{f}" is not a valid field to query.', 2)
        rows.append([table[f] for f in fields])
    units = {names.get(f, f): ("MiB" if f in ("used_memory", "used_gpu_memory") else "") for f in fields}
    return csv(rows, [names.get(f, f) for f in fields], units, fmt)


def topo_matrix(st, gpus):
    nics = [n for n in st.get("nics", []) if n.get("driver") == "mlx5_core"]
    ends = [(f"GPU{g['index']}", g["bdf"]) for g in gpus] + [(f"NIC{i}", n["bdf"]) for i, n in enumerate(nics)]
    topo = st["topology"]
    head = "\t" + U + "\t".join([name for name, _ in ends] + ["CPU Affinity", "NUMA Affinity", "GPU NUMA ID"]) + R + "\n"
    lines = [head]
    for name, bdf in ends:
        cells = [" X " if b == bdf else topo[f"{bdf} {b}"] for _, b in ends]
        if name.startswith("GPU"):
            g = next(x for x in gpus if x["bdf"] == bdf)
            cells += [g["cpu_affinity"], g["numa_affinity"], "", "N/A"]
        else:
            cells += ["", "", "", ""]
        lines.append(name + "\t" + "\t".join(cells) + "\n")
    out = "".join(lines) + LEGEND
    if nics:
        out += "\nNIC Legend:\n\n" + "".join(f"  NIC{i}: {n['name']}\n" for i, n in enumerate(nics))
    return out


def topo_p2p(st, gpus, kind):
    p2p = st.get("p2p") or {}
    value = p2p.get(kind, "NS")
    head = " \t" + U + "".join(f"GPU{g['index']}\t" for g in gpus) + R + "\n"
    rows = "".join(f" GPU{a['index']}\t" + "".join(("X" if a is b else value) + "\t" for b in gpus) + "\n"
                   for a in gpus)
    legend = P2P_LEGEND + (["  DR   = Disabled by regkey"] if p2p.get("legend_dr") else []) + ["  U    = Unknown"]
    return head + rows + "\nLegend:\n\n" + "".join(line + "\n" for line in legend)


def table(st, gpus):
    """The default report, column for column as driver 580 prints it (91 wide)."""
    nv = st["nvidia"]
    busy = twinstate.busy()
    line = "+" + "-" * 89 + "+"
    bar = "+" + "-" * 41 + "+" + "-" * 24 + "+" + "-" * 22 + "+"
    out = [time.strftime("%a %b %e %H:%M:%S %Y") + "       ", line,
           f"| NVIDIA-SMI {nv['version']:<23}Driver Version: {nv['version']:<15}"
           f"CUDA Version: {nv.get('cuda_version') or 'N/A':<9}|",
           bar,
           "| GPU  Name                 Persistence-M | Bus-Id          Disp.A | Volatile Uncorr. ECC |",
           "| Fan  Temp   Perf          Pwr:Usage/Cap |           Memory-Usage | GPU-Util  Compute M. |",
           "|                                         |                        |               MIG M. |",
           "|" + "=" * 41 + "+" + "=" * 24 + "+" + "=" * 22 + "|"]
    for g in gpus:
        name = g["name"] if len(g["name"]) <= 27 else g["name"][:24] + "..."
        used = 512 if g["bdf"] in busy else 0
        out += [f"| {g['index']:>3}  {name:<31}{'On':<4}|   {bus_id(g['bdf'])} {'Off':>3} | {'0':>20} |",
                f"| {'N/A':>3}   {'30C':>3}    P8{'30W':>16} / {str(g.get('power_limit_w', 300)) + 'W':>5} "
                f"| {str(used) + 'MiB':>10} / {str(g['memory_mib']) + 'MiB':>9} |{'0%':>8}{'Default':>13} |",
                f"|{'':41}|{'':24}| {'Disabled':>20} |", bar]
    out += ["", line, f"| {'Processes:':<88}|",
            "|  GPU   GI   CI              PID   Type   Process name                        GPU Memory |",
            "|        ID   ID                                                               Usage      |",
            "|" + "=" * 89 + "|"]
    procs = [(g, busy[g["bdf"]]) for g in gpus if g["bdf"] in busy]
    if not procs:
        out.append(f"|  {'No running processes found':<87}|")
    for g, b in procs:
        out.append(f"|  {g['index']:>3}   N/A  N/A{b['pid']:>16}{'C':>7}   {b['holder'][:36]:<36}{'512MiB':>10} |")
    out.append(line)
    return "".join(x + "\n" for x in out)


NO_DRIVER = ("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. "
             "Make sure that the latest NVIDIA driver is installed and running.\n\n")
LIB_DIRS = ("/usr/lib/x86_64-linux-gnu", "/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/lib")


def container_view(st):
    """(state with only this CT's GPUs, None) or (None, (message, exit code)) as NVML in a CT."""
    lib = next((os.path.realpath(f"{d}/libnvidia-ml.so.1") for d in LIB_DIRS
                if os.path.exists(f"{d}/libnvidia-ml.so.1")), None)
    if lib is None:
        return None, ("NVIDIA-SMI couldn't find libnvidia-ml.so library in your system. Please make sure that "
                      "the NVIDIA Display Driver is properly installed and present in your system.\nPlease also "
                      "try adding directory that contains libnvidia-ml.so to your system PATH.\n", 12)
    try:
        with open("/proc/driver/nvidia/version") as f:
            driver = re.search(r"\s(\d+\.\d+(?:\.\d+)?)\s", f.read())
    except OSError:
        driver = None
    if driver is None or not os.path.exists("/dev/nvidiactl"):
        return None, (NO_DRIVER, 9)
    m = re.search(r"\.so\.(\d+\.\d+(?:\.\d+)?)$", lib)
    if m is None or m.group(1) != driver.group(1):
        short = ".".join((m.group(1) if m else "0.0").split(".")[:2])
        return None, (f"Failed to initialize NVML: Driver/library version mismatch\nNVML library version: {short}\n", 18)

    def opened(minor):
        try:
            return stat.S_ISCHR(os.stat(f"/dev/nvidia{minor}").st_mode)
        except OSError:
            return False
    mine = [dict(g) for g in visible(st) if opened(g["minor"])]
    for i, g in enumerate(mine):
        g["index"] = i
    others = [g for g in st.get("gpus", []) if g.get("index") is None]
    return dict(st, gpus=mine + others), None


PROGRAMS = ("nvidia-smi",)


def main(prog, argv):
    """`nvidia-smi argv` (prog is always nvidia-smi); its exit status."""
    st = twinstate.state()
    if os.environ.get("TWIN_CT") and "--version" not in argv:
        st, failure = container_view(st)
        if failure:
            sys.stdout.write(failure[0])
            return failure[1]
    if "--version" in argv:
        nv = st.get("nvidia") or {}
        sys.stdout.write(f"NVIDIA-SMI version  : {nv.get('version')}\nNVML version        : "
                         f"{(nv.get('version') or '').split('.')[0]}.{nv.get('version')}\n"
                         f"DRIVER version      : {nv.get('version')}\nCUDA Version        : {nv.get('cuda_version')}\n")
        return 0
    if not st.get("nvidia", {}).get("loaded"):
        sys.stdout.write("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. "
                         "Make sure that the latest NVIDIA driver is installed and running.\n\n")
        return 9
    gpus = visible(st)
    opts, args = {}, []
    i = 0
    while i < len(argv):
        a = argv[i]
        if a.startswith("--") and "=" in a:
            k, v = a.split("=", 1)
            opts[k] = v
        elif a in ("-i", "--id", "-p2p", "--p2pstatus"):
            if i + 1 >= len(argv):
                twinstate.die(f'Option "{a}" is missing its value.', 2)
            opts[a] = argv[i + 1]
            i += 1
        else:
            args.append(a)
        i += 1
    if not gpus:
        sys.stdout.write("No devices were found\n")
        return 6
    ids = opts.get("-i") or opts.get("--id")
    if args[:1] == ["topo"]:
        if "-m" in args or "--matrix" in args:
            sys.stdout.write(topo_matrix(st, gpus))
            return 0
        kind = opts.get("-p2p") or opts.get("--p2pstatus")
        if kind:
            if kind not in ("r", "w", "n", "a", "p"):
                twinstate.die(f'Invalid value "{kind}" for option "-p2p".', 2)
            sys.stdout.write(topo_p2p(st, gpus, kind))
            return 0
        twinstate.die("Invalid combination of input arguments. Please run 'nvidia-smi -h' for help.", 2)
    gpus = select(gpus, ids)
    if "-L" in args or "--list-gpus" in args:
        sys.stdout.write("".join(f"GPU {g['index']}: {g['name']} (UUID: {g['uuid']})\n" for g in gpus))
        return 0
    fmt = opts.get("--format", "")
    if "--query-gpu" in opts:
        if not fmt.startswith("csv"):
            twinstate.die('"--format" is required with "--query-gpu". Please run "nvidia-smi -h" for help.', 2)
        sys.stdout.write(query_gpu(st, gpus, opts["--query-gpu"], fmt))
        return 0
    if "--query-compute-apps" in opts:
        if not fmt.startswith("csv"):
            twinstate.die('"--format" is required with "--query-compute-apps".', 2)
        sys.stdout.write(query_apps(st, gpus, opts["--query-compute-apps"], fmt))
        return 0
    if args:
        twinstate.die("Invalid combination of input arguments. Please run 'nvidia-smi -h' for help.", 2)
    sys.stdout.write(table(st, gpus))
    return 0


if __name__ == "__main__":
    sys.exit(main("nvidia-smi", sys.argv[1:]))
