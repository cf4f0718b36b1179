#!/usr/bin/python3 -ISB
"""The twin's stand-in server: runs stand-in calls in forked workers of one interpreter that has
already imported every stand-in module (client.c says why and how the calls arrive).

Started by the twin's supervisor at each boot (tests/twin/runtime.py), inside the twin's root and
namespaces, listening on /run/twin/standins.sock (tmpfs: nothing lands in the twin's root). For each
call a worker is forked; it takes the caller's stdin/stdout/stderr, cwd, environment and argv
(sys.argv[0] = the stand-in's path, as if run directly), runs the module's `main(prog, args)` and
exits with its status, which the server sends back to the waiting client.

    /usr/bin/python3 -ISB /usr/local/lib/twin/standind.py [SOCKET]
"""
import os
import selectors
import signal
import socket
import struct
import sys
import traceback

sys.dont_write_bytecode = True
LIB = os.path.join(os.environ.get("TWIN_ROOT", "/"), "usr/local/lib/twin")
SOCKET = "/run/twin/standins.sock"
MODULES = ("boot", "hostdev", "nvidia_smi", "proxmox")
MAX_REQUEST = 1 << 20
# Imported by the stand-ins only inside functions (a stand-in run as its own program should not
# pay for them on every call); the server imports them once so that no worker does: hashlib alone
# maps libcrypto and reads openssl.cnf, ~5 ms of every `pct list` / `qm list` worker.
PRELOAD = ("hashlib", "datetime", "shutil", "subprocess")


def load_programs() -> dict:
    """{program name: module} from each module's PROGRAMS."""
    sys.path.insert(0, LIB)
    programs = {}
    for name in MODULES:
        if not os.path.exists(os.path.join(LIB, f"{name}.py")):
            continue
        module = __import__(name)
        for prog in module.PROGRAMS:
            programs[prog] = module
    for name in PRELOAD:
        __import__(name)
    __import__("hashlib").sha1(b"")  # OpenSSL's first use loads its configuration
    return programs


def receive(conn: socket.socket) -> tuple[list[int], list[str]]:
    """One request: (the caller's fds 0-2, its strings)."""
    fds: list[int] = []
    data = b""
    while len(data) < 4 or len(data) < 4 + struct.unpack("=I", data[:4])[0]:
        chunk, ancdata, _, _ = conn.recvmsg(65536, socket.CMSG_SPACE(3 * 4))
        for level, kind, payload in ancdata:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds += list(struct.unpack(f"={len(payload) // 4}i", payload[: len(payload) - len(payload) % 4]))
        if not chunk:
            raise ConnectionError("client closed the connection mid-request")
        data += chunk
        if len(data) > MAX_REQUEST:
            raise ConnectionError("request too large")
    length = struct.unpack("=I", data[:4])[0]
    strings = data[4:4 + length].split(b"\0")[:-1]
    return fds, [s.decode("utf-8", "surrogateescape") for s in strings]


def enter_callers_root(pid: int | None) -> None:
    """See the files as the caller sees them: a caller in a mount namespace of its own (e.g.
    proxmox-boot-tool's, functions reexec_in_mountns, which binds an ESP on /boot before
    update-grub: zz-proxmox-boot update_esp_func), or a program such a caller started, has mounts
    the server's namespace lacks. The kernel resolves /proc/<pid>/root to the caller's root with
    the caller's mounts (proc(5)), so chrooting there makes every path walk cross them (the
    caller's own root, mount and directory alike: a child of a worker is such a caller too)."""
    if not pid or pid == os.getpid():
        return
    try:
        os.chroot(f"/proc/{pid}/root")
    except OSError as err:
        sys.stderr.write(f"twin stand-in server: cannot enter the mount namespace of pid {pid}: {err}\n")


def run_worker(programs: dict, fds: list[int], strings: list[str], pid: int | None = None) -> int:
    """In the forked worker: become the caller's process and run the stand-in."""
    exe, argv0, cwd, argc = strings[0], strings[1], strings[2], int(strings[3])
    args = strings[4:4 + argc]
    envc = int(strings[4 + argc])
    env = strings[5 + argc:5 + argc + envc]
    for target, fd in enumerate(fds[:3]):
        os.dup2(fd, target)
    for fd in fds:
        if fd > 2:
            os.close(fd)
    enter_callers_root(pid)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(dict(e.split("=", 1) for e in env if "=" in e))
    sys.argv = [exe, *args]
    prog = os.path.basename(argv0)
    module = programs.get(prog)
    if module is None:
        sys.stderr.write(f"twin stand-in server: no stand-in named {prog}\n")
        return 127
    try:
        code = module.main(prog, args)
    except SystemExit as stop:
        code = stop.code
    except BaseException:  # as an uncaught exception in a fresh interpreter: traceback, 1
        traceback.print_exc()
        code = 1
    if code is None:
        code = 0
    elif not isinstance(code, int):
        sys.stderr.write(f"{code}\n")
        code = 1
    return code & 0xFF


def main() -> int:
    path = sys.argv[1] if len(sys.argv) > 1 else SOCKET
    programs = load_programs()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".new")
    listener.listen(128)
    os.rename(path + ".new", path)  # clients see the socket only once it listens

    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ, "accept")
    selector.register(wake_r, selectors.EVENT_READ, "child")
    waiting: dict[int, socket.socket] = {}

    while True:
        for key, _ in selector.select():
            if key.data == "accept":
                conn, _ = listener.accept()
                fds: list[int] = []
                try:
                    conn.settimeout(10)
                    fds, strings = receive(conn)
                    # the caller's pid (SO_PEERCRED: struct ucred pid, uid, gid), this pid namespace's
                    peer = struct.unpack("=3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                                struct.calcsize("=3i")))[0]
                except (OSError, ValueError, IndexError):
                    for fd in fds:
                        os.close(fd)
                    conn.close()
                    continue
                pid = os.fork()
                if pid == 0:
                    code = 1
                    try:
                        signal.set_wakeup_fd(-1)
                        for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGPIPE):
                            signal.signal(sig, signal.SIG_DFL)
                        selector.close()
                        listener.close()
                        conn.close()
                        for other in waiting.values():
                            other.close()
                        os.close(wake_r)
                        os.close(wake_w)
                        code = run_worker(programs, fds, strings, peer)
                    finally:
                        for stream in (sys.stdout, sys.stderr):
                            try:
                                stream.flush()
                            except (OSError, ValueError):
                                pass
                        os._exit(code)
                for fd in fds:
                    os.close(fd)
                waiting[pid] = conn
            else:
                try:
                    while os.read(wake_r, 512):
                        pass
                except BlockingIOError:
                    pass
                while True:
                    try:
                        pid, status = os.waitpid(-1, os.WNOHANG)
                    except ChildProcessError:
                        break
                    if pid == 0:
                        break
                    if pid not in waiting:
                        continue
                    conn = waiting.pop(pid)
                    code = os.waitstatus_to_exitcode(status)
                    code = 128 - code if code < 0 else code
                    try:
                        conn.sendall(struct.pack("=i", code))
                    except OSError:
                        pass
                    conn.close()


if __name__ == "__main__":
    sys.exit(main())
