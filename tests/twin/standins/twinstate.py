"""Shared by the twin's stand-in programs (run by the twin's /usr/bin/python3, stdlib only).

Installed as /usr/local/lib/twin/twinstate.py. Every path goes through `path()`, so a test can run
a stand-in against a tmp root with TWIN_ROOT=/tmp/x instead of chrooting.
"""
import json
import os
import re
import sys

# datetime and hashlib are imported where used: every stand-in imports this module, and each
# run of one is a fresh interpreter (a real `uname -r` or `nvidia-smi -L` does not pay for them)

ROOT = os.environ.get("TWIN_ROOT", "/")
TWIN = "/var/lib/twin"


def path(p):
    return os.path.join(ROOT, p.lstrip("/"))


def read(p, default=None):
    try:
        with open(path(p)) as f:
            return f.read()
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
        return default


def write(p, text):
    full = path(p)
    os.makedirs(os.path.dirname(full), exist_ok=True)
    tmp = full + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, full)


def state():
    """hw/state.json written by tests.twin.hardware.render (the current boot)."""
    return json.loads(read(f"{TWIN}/hw/state.json", "{}"))


def profile():
    return json.loads(read(f"{TWIN}/profile.json", "{}"))


def busy():
    """{bdf: holder} (or {bdf: {"holder":..., "pid":...}}) from busy.json."""
    raw = json.loads(read(f"{TWIN}/busy.json", "{}") or "{}")
    out = {}
    for i, (bdf, v) in enumerate(sorted(raw.items())):
        if isinstance(v, str):
            v = {"holder": v}
        v.setdefault("pid", 4100 + 17 * i)  # stable made-up pid per holder
        out[bdf] = v
    return out


def now_iso(timespec="seconds"):
    import datetime

    return datetime.datetime.now(datetime.UTC).astimezone().isoformat(timespec=timespec)


def log_guest(action, kind, vmid):
    with open(path(f"{TWIN}/guests.log"), "a") as f:
        f.write(f"{now_iso('milliseconds')} {action} {kind} {vmid}\n")  # ms: boot's startup delays are seen


def die(msg, code=255):
    sys.stderr.write(msg if msg.endswith("\n") else msg + "\n")
    sys.exit(code)


# Proxmox's CLIs are Perl programs that load the PVE::* modules before doing anything: 0.3-0.6 s
# per start on a real node (issue 19), a few ms here. With var/lib/twin/pve-delay (seconds;
# tests/twin/runtime.set_pve_delay, PVEGPU_TWIN_PVE_DELAY) each waits that long first; with
# var/lib/twin/pve-count each pct/qm/pvesh call is logged to var/lib/twin/pve-calls.log.
PVE_PERL = ("pct", "qm", "pvesh", "pveversion", "pvecm")
PVE_COUNTED = PVE_PERL  # every Perl CLI start is counted (what a real node pays 0.3-0.6 s for)


def _pve_start(prog, argv):
    if prog in PVE_COUNTED and os.path.exists(path(TWIN + "/pve-count")):
        with open(path(TWIN + "/pve-calls.log"), "a") as f:
            f.write(" ".join([prog, *argv]).replace("\n", " ")[:300] + "\n")
    delay = read(TWIN + "/pve-delay")
    if delay and delay.strip():
        import time

        time.sleep(float(delay))


def dispatch(handlers, kind, prog, argv):
    """Run `handlers[prog](argv)` (a stand-in module's `main`): its exit status."""
    if prog not in handlers:
        die(f"{kind} stand-in: unknown program name {prog}", 127)
    if prog in PVE_PERL:
        _pve_start(prog, argv)
    return handlers[prog](argv)


def standin(handlers, kind):
    """A stand-in module's (PROGRAMS, main): the program names it answers to, and main(prog, argv)
    running `handlers[prog]` through `dispatch` (the server calls it; so does `run_program`)."""
    def main(prog, argv):
        return dispatch(handlers, kind, prog, argv)
    return tuple(handlers), main


def run_program(main):
    """A stand-in run as its own program: the one its name (argv[0]) says, exit with its status."""
    sys.exit(main(os.path.basename(sys.argv[0]), sys.argv[1:]))


# ---- Proxmox config files: pct.conf(5) / qm.conf(5) -------------------------------------

def parse_conf(text):
    """{"description": [comment lines], "keys": [(key, value)], "rest": "<[snapshot] sections verbatim>"}."""
    desc, keys, rest = [], [], ""
    lines = text.splitlines(True)
    for i, line in enumerate(lines):
        if line.startswith("["):
            rest = "".join(lines[i:])
            break
        s = line.rstrip("\n")
        if s.startswith("#"):
            desc.append(s)
        elif s.strip():
            k, _, v = s.partition(":")
            keys.append((k.strip(), v.strip()))
    return {"description": desc, "keys": keys, "rest": rest}


def format_conf(conf):
    """PVE writes description comments, then sorted keys, then raw lxc.* keys in their order."""
    plain = sorted((k, v) for k, v in conf["keys"] if not k.startswith("lxc."))
    raw = [(k, v) for k, v in conf["keys"] if k.startswith("lxc.")]
    body = "".join(f"{line}\n" for line in conf["description"])
    body += "".join(f"{k}: {v}\n" for k, v in plain + raw)
    if conf["rest"]:
        body += "\n" + conf["rest"].lstrip("\n")
    return body


def conf_get(conf, key):
    for k, v in conf["keys"]:
        if k == key:
            return v
    return None


def conf_set(conf, key, value):
    for i, (k, _) in enumerate(conf["keys"]):
        if k == key:
            conf["keys"][i] = (key, value)
            return
    conf["keys"].append((key, value))


def conf_delete(conf, key):
    conf["keys"] = [(k, v) for k, v in conf["keys"] if k != key]


def digest(text):
    import hashlib

    return hashlib.sha1(text.encode()).hexdigest()


def prop_string(value):
    """'a=1,b=2' or 'path,a=1' -> {"_": path, "a": "1", ...}."""
    out = {}
    for i, part in enumerate(value.split(",")):
        if "=" in part:
            k, v = part.split("=", 1)
            out[k] = v
        elif i == 0:
            out["_"] = part
        else:
            out[part] = "1"
    return out


def version_key(rel):
    return [int(x) if x.isdigit() else x for x in re.split(r"[.\-+~]", rel)]


# ---- pmxcfs's cluster lock ------------------------------------------------------------------

CFS_LOCK_DIR = "/etc/pve/priv/lock"
CFS_LOCK_TIMEOUT = 120  # pve-cluster src/pmxcfs/memdb.c CFS_LOCK_TIMEOUT: a lock lives 120 s
CFS_LOCKS_SEEN = TWIN + "/cfs-locks.json"  # this node's "first seen" time of each lock


def _cfs_unlock_request(lockdir):
    """utime(0, 0) on a held lock (pmxcfs cfs-plug-memdb.c cfs_plug_memdb_utimens ->
    memdb.c memdb_lock_expired): the lock is removed when this node first saw it (this lock
    instance: its mtime) more than CFS_LOCK_TIMEOUT s ago; pmxcfs never uses the stored mtime
    for the age (nodes' clocks drift, src/README "File Locking")."""
    import time

    try:
        st = os.stat(path(lockdir))
    except FileNotFoundError:
        return
    try:
        seen = json.loads(read(CFS_LOCKS_SEEN, "{}") or "{}")
    except ValueError:
        seen = {}
    mark = f"{st.st_ino}:{st.st_mtime_ns}"
    entry = seen.get(lockdir)
    now = time.time()
    if not entry or entry[1] != mark:
        seen[lockdir] = [now, mark]
        full = path(CFS_LOCKS_SEEN)  # several waiters at once: each its own temporary file
        os.makedirs(os.path.dirname(full), exist_ok=True)
        with open(f"{full}.{os.getpid()}", "w") as f:
            f.write(json.dumps(seen))
        os.replace(f"{full}.{os.getpid()}", full)
    elif now - entry[0] > CFS_LOCK_TIMEOUT:
        try:
            os.rmdir(path(lockdir))
        except OSError:
            pass


def cfs_lock(lockid, code, timeout=10):
    """Run `code()` holding pmxcfs's cluster lock `lockid`, as pve-cluster src/PVE/Cluster.pm
    $cfs_lock does: mkdir /etc/pve/priv/lock/<lockid> is the lock (atomic cluster-wide); while
    it exists, an unlock request (utime 0,0) and a short sleep, until `timeout` s (default 10)
    have passed: then "got lock request timeout"; rmdir once `code` returned or failed. The
    lock of a config file is `file-<name>` with `.` and `/` as `_` (cfs_lock_file)."""
    import time

    lockdir = f"{CFS_LOCK_DIR}/{lockid}"
    os.makedirs(path(CFS_LOCK_DIR), exist_ok=True)
    deadline = time.monotonic() + timeout
    while True:
        try:
            os.mkdir(path(lockdir))
            break
        except FileExistsError:
            if time.monotonic() >= deadline:
                raise TimeoutError(f"cfs-lock '{lockid}' error: got lock request timeout") from None
            _cfs_unlock_request(lockdir)
            time.sleep(0.1)
    try:
        return code()
    finally:
        os.rmdir(path(lockdir))


def cfs_file_lockid(name):
    """cfs_lock_file's lock name: 'mapping/pci.cfg' -> 'file-mapping_pci_cfg'."""
    return "file-" + re.sub(r"[./]", "_", name)
