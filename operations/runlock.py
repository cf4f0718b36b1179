"""One pvegpu run per host at a time (issue 19, part 1).

pyinfra runs every command as its own SSH exec, so no single remote command lives as long as
the run. The lock therefore has its own channel on the run's SSH connection: a small bash
*keeper* on the host takes ``flock`` on ``/run/pvegpu/run.lock`` and writes who holds it to
``/run/pvegpu/holder`` (user@machine, since when, pid, converge or --dry), then waits on its
stdin, which is that channel:

- the run ends normally (pyinfra disconnects the host): pyinfra sends ``done``, the keeper
  removes the holder record and exits; the kernel drops the flock with the keeper;
- pyinfra is killed or the connection drops: the channel closes, the keeper sees end of file,
  adds ``ended=`` and ``how=`` to the record and exits;
- the link hangs silently: pyinfra sends a heartbeat line every few seconds; with none for
  `HEARTBEAT_TIMEOUT_S` the keeper records that and exits;
- the keeper itself is killed: the flock goes with it and the record stays as it was.

A second run (converge or ``--dry``, which would read a half-done state) tries the flock
without waiting: when a live keeper holds it, the run refuses before reading or changing
anything and names the holder; when the flock is free but a record is left, the previous run
died — its record is reported as stale and the new run takes the lock. Once it holds the lock, the keeper also waits while a GPU rebind runner an earlier run started
detached (`plan.rebind`) still holds ``/run/pvegpu/rebind.lock`` (it says ``WAIT``; the run logs
it), so no fact is read in the middle of a transaction. /run is a tmpfs, so a
reboot (which ends every keeper) leaves no lock behind, and ``--dry`` leaves no file where
configuration lives.
"""

from __future__ import annotations

import atexit
import datetime
import getpass
import logging
import os
import socket
import subprocess
import sys
from collections.abc import Iterable
from typing import Any

from pyinfra.api.exceptions import DeployError

from facts.shell import word
from plan.render import root_dir_function

LOCK_DIR = "/run/pvegpu"
LOCK_FILE = f"{LOCK_DIR}/run.lock"
HOLDER_FILE = f"{LOCK_DIR}/holder"
HEARTBEAT_S = 5
# A GPU rebind transaction an earlier run started detached (plan.rebind) may still run: the new
# run waits for it (holding the run lock) before it reads anything. Guests get their shutdown
# timeout each, so this is generous.
REBIND_WAIT_S = 1800
# Long enough for pyinfra's "Detected changes" prompt (it blocks the whole process, heartbeats
# included); a test may shorten it (PVEGPU_LOCK_TIMEOUT_S) to see a silent link's end quickly.
HEARTBEAT_TIMEOUT_S = int(os.environ.get("PVEGPU_LOCK_TIMEOUT_S", "600"))

# $1 user  $2 machine  $3 since  $4 pid  $5 mode  $6 heartbeat timeout (s)
KEEPER = r"""
set -u
dir=%(dir)s; lock=%(lock)s; info=%(info)s
trap '' HUP
%(root_dir)s
{ pvegpu_dir "$dir" 755 && exec 9>>"$lock"; } || { echo "ERROR cannot open $lock"; echo END; exit 1; }
if ! flock -n -x 9; then
  echo HELD; cat "$info" 2>/dev/null; echo END; exit 0
fi
if [ -s "$info" ]; then echo STALE; cat "$info"; fi
printf 'user=%%s\nmachine=%%s\nsince=%%s\npid=%%s\nmode=%%s\nkeeper=%%s\n' "$1" "$2" "$3" "$4" "$5" "$$" > "$info.new" \
  && mv -f "$info.new" "$info"
rb=%(rebind)s
if [ -e "$rb" ] && ! flock -n "$rb" true; then
  echo "WAIT"
  flock -w %(rebind_wait)d "$rb" true || { echo "ERROR a GPU rebind transaction an earlier run started still runs after %(rebind_wait)d s (see /var/lib/pvegpu/rebind/journal)"; echo END; exit 1; }
fi
echo "LOCKED $$"; echo END
how="the connection closed before the run ended (pyinfra killed, or the link lost)"
while :; do
  if IFS= read -r -t "$6" line; then
    if [ "$line" = done ]; then rm -f "$info"; exit 0; fi
  else
    [ $? -gt 128 ] && how="no word from the run for $6 s (the link lost?)"
    break
  fi
done
printf 'ended=%%s\nhow=%%s\n' "$(date -u +%%Y-%%m-%%dT%%H:%%M:%%SZ)" "$how" >> "$info"
"""

_HELD: dict[str, _Keeper] = {}  # host name -> its keeper, alive for the whole run
_PENDING: dict[str, _Keeper] = {}  # host name -> a keeper `begin` started, its answer not read yet


def whoami() -> dict[str, str]:
    """The holder record of this run."""
    try:
        user = getpass.getuser()
    except Exception:  # no login name (container without passwd entry)
        user = str(os.getuid())
    return {
        "user": user,
        "machine": socket.gethostname(),
        "since": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "pid": str(os.getpid()),
        "mode": "--dry" if "--dry" in sys.argv else "converge",
    }


def keeper_command(me: dict[str, str], timeout_s: int = HEARTBEAT_TIMEOUT_S, lock_dir: str = LOCK_DIR) -> str:
    """The remote command: bash running KEEPER with the holder record as its arguments."""
    script = KEEPER % {"root_dir": root_dir_function(), "dir": word(lock_dir), "lock": word(f"{lock_dir}/run.lock"),
                       "info": word(f"{lock_dir}/holder"), "rebind": word(f"{lock_dir}/rebind.lock"),
                       "rebind_wait": REBIND_WAIT_S}
    args = [me["user"], me["machine"], me["since"], me["pid"], me["mode"], str(timeout_s)]
    return "exec bash -c " + word(script) + " pvegpu-lock " + " ".join(word(a) for a in args)


def parse_reply(lines: list[str]) -> tuple[str, dict[str, str], dict[str, str]]:
    """The keeper's first lines → (state, this lock's info, the stale record if any).

    state: ``locked``, ``held`` or ``error``; a ``STALE`` block comes before ``LOCKED``."""
    state, block = "error", None
    records: dict[str, dict[str, str]] = {"HELD": {}, "STALE": {}}
    keeper = ""
    for line in lines:
        line = line.rstrip("\n")
        if line in ("HELD", "STALE"):
            block = line
            if line == "HELD":
                state = "held"
        elif line.startswith("LOCKED "):
            state, block, keeper = "locked", None, line.split()[1]
        elif line.startswith("ERROR "):
            state, block = "error", None
            records["ERROR"] = {"message": line[len("ERROR "):]}
        elif line == "END":
            break
        elif block and "=" in line:
            key, _, value = line.partition("=")
            records[block][key] = value
    info = records["HELD"] if state == "held" else {"keeper": keeper, **records.get("ERROR", {})}
    return state, info, records["STALE"]


def describe_holder(rec: dict[str, str]) -> str:
    if not rec:
        return "another pvegpu run (it has not written its name yet)"
    who = f"{rec.get('user', '?')}@{rec.get('machine', '?')}"
    return f"{who} (pid {rec.get('pid', '?')}, {rec.get('mode', 'converge')}) since {rec.get('since', '?')}"


def stale_message(host_name: str, rec: dict[str, str]) -> str:
    how = rec.get("how") or "its lock keeper on the host is gone"
    when = f" at {rec['ended']}" if rec.get("ended") else ""
    return (f"{host_name}: the previous pvegpu run, {describe_holder(rec)}, ended without finishing{when}: "
            f"{how}. Its lock was stale and is taken over; this run reads the host as that run left it.")


def held_message(host_name: str, rec: dict[str, str]) -> str:
    return (f"pvegpu: host {host_name} is held by another pvegpu run: {describe_holder(rec)}; nothing was "
            f"read or changed. Wait for it to finish, then run again (a run that is killed or loses its "
            f"connection lets go at once; one whose link went silent, after {HEARTBEAT_TIMEOUT_S} s). The holder is in {HOLDER_FILE} on the host.")


class _Keeper:
    """One host's keeper process and the channel (or pipe) to it."""

    def __init__(self, host, command: str):
        # the heartbeat runs in its own greenlet, outside pyinfra's host context: keep the name,
        # not the context-bound `host` proxy (reading it there raises)
        self.host_name = host.name
        self._chan: Any = None  # a paramiko Channel over SSH
        self._proc: subprocess.Popen[str] | None = None  # the keeper itself under @local
        self._reader: Iterable[str]
        self._done = False
        from pyinfra.connectors.local import LocalConnector

        connector = host.connector
        if isinstance(connector, LocalConnector):  # @local: the keeper is a subprocess of this run
            proc = subprocess.Popen(["sh", "-c", command], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            assert proc.stdout is not None  # stdout=PIPE
            self._proc, self._reader = proc, proc.stdout
            return
        client = getattr(connector, "client", None)
        transport = client.get_transport() if client is not None else None
        if transport is None:
            raise DeployError(f"pvegpu: host {host.name}: the run lock needs an SSH or @local connection "
                              f"(got {type(connector).__name__}); nothing was changed")
        chan = transport.open_session()
        chan.exec_command(command)
        self._chan = chan
        self._reader = chan.makefile("r")

    def first_lines(self, log=None) -> list[str]:
        lines = []
        for line in self._reader:
            lines.append(line)
            if line.strip() == "WAIT" and log is not None:
                log(f"{self.host_name}: a GPU rebind transaction an earlier run started is still running on the "
                    "host; waiting for it to end before reading anything (/var/lib/pvegpu/rebind/journal)")
            if line.strip() == "END" or len(lines) > 50:
                break
        return lines

    def send(self, text: str) -> bool:
        try:
            if self._chan is not None:
                if self._chan.closed:
                    return False
                self._chan.sendall(text.encode())
            elif self._proc is not None and self._proc.stdin is not None:  # stdin=PIPE: always
                self._proc.stdin.write(text)
                self._proc.stdin.flush()
            else:
                return False
            return True
        except Exception:  # the link is gone: the keeper notices on its side
            return False

    def beat(self) -> None:
        import gevent

        while not self._done and self.send(".\n"):
            gevent.sleep(HEARTBEAT_S)
            if self._chan is not None and self._chan.exit_status_ready() and not self._done:
                # the keeper ends with the host's reboot too (the reboot stage); /run is emptied then
                logging.getLogger("pyinfra").warning(
                    f"{self.host_name}: pvegpu lost its run lock (its keeper on the host ended, e.g. the host "
                    "rebooted); another run may now take the host")
                return

    def release(self) -> None:
        if self._done:
            return
        self._done = True
        self.send("done\n")
        try:
            if self._chan is not None:
                self._chan.shutdown_write()
                self._chan.recv_exit_status()
            elif self._proc is not None:
                if self._proc.stdin is not None:  # stdin=PIPE: always
                    self._proc.stdin.close()
                self._proc.wait(timeout=10)
        except Exception:
            pass


def begin(host) -> None:
    """Start this host's keeper without waiting for its answer: the keeper takes the lock on the
    host while the run goes on with work that reads nothing of the host (deploy.py loads its
    stages meanwhile); `hold` then reads the answer. Nothing may be read from the host between
    the two. A run that stops before `hold` calls `abandon`."""
    if host.name not in _HELD and host.name not in _PENDING:
        _PENDING[host.name] = _Keeper(host, keeper_command(whoami()))


def abandon(host) -> None:
    """Let go of a keeper `begin` started for a run that stops before `hold` (its lock, if the
    keeper got it, goes with it and its record is removed)."""
    keeper = _PENDING.pop(host.name, None)
    if keeper is not None:
        keeper.release()


def hold(host, log) -> None:
    """Take this host's run lock for the rest of the run (the keeper `begin` started, else a new
    one), or raise DeployError naming the holder.

    `log(line)` reports a stale holder that is taken over."""
    if host.name in _HELD:
        return
    keeper = _PENDING.pop(host.name, None) or _Keeper(host, keeper_command(whoami()))
    state, info, stale = parse_reply(keeper.first_lines(log))
    if state == "held":
        keeper.release()
        raise DeployError(held_message(host.name, info))
    if state != "locked":
        keeper.release()
        raise DeployError(f"pvegpu: host {host.name}: could not take the run lock ({info.get('message', 'no reply')}); "
                          "nothing was changed")
    if stale:
        log(stale_message(host.name, stale))
    _HELD[host.name] = keeper
    import gevent

    gevent.spawn(keeper.beat)
    # the run's end: pyinfra disconnects every host (also after errors); then the keeper removes
    # the record. A killed pyinfra never gets here, and the keeper records that instead.
    original = getattr(host.connector, "disconnect", None)

    def disconnect():
        keeper.release()
        if original is not None:
            original()

    host.connector.disconnect = disconnect
    atexit.register(keeper.release)
