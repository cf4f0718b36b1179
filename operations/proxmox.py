"""Proxmox writes and guest power actions: through the Proxmox API when the spec has
`proxmox_api`, else over SSH (`pvesh`, `qm`, `pct`) as root on the host.

Through the API (proxmoxer's https backend), every write is a pyinfra `FunctionCommand` that
runs on the machine running pyinfra at execution time, in order with the host's other
commands; `--dry` runs none of them. The token is read from `token_env`/`token_file` inside
that function, at the moment of the request, and never stored in an object, printed or put in
an exception: `PveApi`'s repr names only the address and the token id, and every error is
re-raised as `PveApiError` with the token masked and the original exception dropped.

Reads stay over SSH (facts): each stage reads everything it decides on (configs, mappings,
run states, hardware) in one remote command, parsed the same whether or not an API is
configured; reading configs over the API would add a round trip per guest and a second
parser, and the decisions would not change.

Guest stop (`guest_stop_commands`): a clean `shutdown --timeout N` first; only when that fails
(timed out) a hard `stop`, and the log says so.

    PveWrite("create", "/cluster/mapping/pci", (("id", "pvegpu-kpro6-0000-81-00-0"),
             ("map", "id=10de:2bb5,iommugroup=3,node=kpro6,path=0000:81:00"),))
"""

from __future__ import annotations

import importlib.util
import os
import stat
import time
import warnings
from dataclasses import dataclass

from pyinfra import host, logger
from pyinfra.api import FunctionCommand, StringCommand

from facts.guest_state import guest_state_changes
from facts.shell import word
from spec.models import ProxmoxApiSpec

KIND_TOOL = {"lxc": "pct", "qemu": "qm"}
KIND_LABEL = {"lxc": "CT", "qemu": "VM"}
HTTP_METHOD = {"get": "GET", "create": "POST", "set": "PUT", "delete": "DELETE"}
REQUEST_TIMEOUT_S = 30
TASK_SLACK_S = 60  # a task may take this long beyond its own timeout before we give up


class PveApiError(RuntimeError):
    """An API request failed (the message never holds the token)."""


@dataclass(frozen=True)
class PveWrite:
    """One API write. `method`: create (POST), set (PUT) or delete (DELETE); `params`: pairs,
    a key may repeat (`map`)."""

    method: str
    path: str
    params: tuple[tuple[str, str], ...] = ()

    def __str__(self) -> str:
        args = " ".join(f"--{k} {v}" for k, v in self.params)
        return f"{HTTP_METHOD[self.method]} {self.path}" + (f" {args}" if args else "")

    def pvesh(self) -> str:
        """The same write as a `pvesh` command line (every value quoted)."""
        # pvesh/qm/pct (pve-common JSONSchema.pm get_options, Getopt::Long '=s'): an option's value is
        # the next word whatever it starts with; the path starts with '/', guest ids are ints >= 100
        args = "".join(f" --{k} {word(v)}" for k, v in self.params)
        return f"pvesh {self.method} {word(self.path)}{args}"

    def data(self) -> dict[str, str | list[str]]:
        out: dict[str, str | list[str]] = {}
        for k, v in self.params:
            if k in out:
                prev = out[k]
                out[k] = (prev if isinstance(prev, list) else [prev]) + [v]
            else:
                out[k] = v
        return out


class PveApi:
    """Where the API is and which token to use; the token itself is read per request.

    ``PveApi(spec.proxmox_api, "kpro6")``; repr: ``PveApi(https://10.0.0.5:8006, root@pam!pvegpu)``.
    """

    def __init__(self, spec: ProxmoxApiSpec, node: str):
        self.spec = spec
        self.node = node

    def __repr__(self) -> str:
        return f"PveApi(https://{self.spec.host}:{self.spec.port}, {self.spec.user}!{self.spec.token_name})"

    __str__ = __repr__

    def problem(self) -> str | None:
        """A sentence when the API cannot be used (preflight): the token cannot be read, or
        proxmoxer's https backend lacks `requests` (it would exit the process). Else None."""
        if importlib.util.find_spec("requests") is None:
            return "proxmox_api needs the Python package requests (proxmoxer's https backend); install it"
        try:
            if not self.spec.token().get_secret_value():
                return f"the Proxmox API token of {self!r} is empty"
        except (ValueError, OSError) as e:
            return f"cannot read the Proxmox API token of {self!r}: {e}"
        if self.spec.ca_file:
            # whoever can write the CA file can put their own CA there and read every request (the token)
            path = os.path.expanduser(self.spec.ca_file)
            try:
                st = os.stat(path)
            except OSError as e:
                return f"proxmox_api.ca_file {path} cannot be read: {e}"
            if st.st_uid not in (os.geteuid(), 0) or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
                return (f"proxmox_api.ca_file {path} is mode {st.st_mode & 0o7777:04o}, owner uid {st.st_uid}: another "
                        "account could replace the CA the API's certificate is checked against; make it owned by "
                        "you or root and writable by its owner only (chmod 644)")
        return None

    def warning(self) -> str | None:
        """A sentence for every run while `verify_ssl` is false (issue 39 item 5); else None."""
        if self.spec.verify_ssl:
            return None
        return (f"proxmox_api.verify_ssl is false: the Proxmox API at {self.spec.host}:{self.spec.port} is used "
                "WITHOUT checking its TLS certificate, so anyone on the network path can read the API token and "
                "change what pvegpu writes. Give the node's CA instead: copy /etc/pve/pve-root-ca.pem to this "
                "machine and set proxmox_api.ca_file to it")

    def _client(self, token: str):
        problem = self.problem() if importlib.util.find_spec("requests") is None else None
        if problem:  # proxmoxer's https backend calls sys.exit(1) without requests
            raise PveApiError(problem)
        from proxmoxer import ProxmoxAPI  # imported here: only API users need requests

        verify = self.spec.ca_file if (self.spec.verify_ssl and self.spec.ca_file) else self.spec.verify_ssl
        # proxmoxer backends/https.py calls urllib3.disable_warnings() when ProxmoxAPI imports it: a
        # process-wide filter that would hide every InsecureRequestWarning; the filters are put back
        with warnings.catch_warnings():
            return ProxmoxAPI(self.spec.host, port=self.spec.port, user=self.spec.user, token_name=self.spec.token_name,
                              token_value=token, verify_ssl=verify, timeout=REQUEST_TIMEOUT_S, backend="https")

    def request(self, method: str, path: str, params: dict | None = None):
        """One request; returns the reply's `data`. Raises `PveApiError` (token masked)."""
        token = ""
        try:
            token = self.spec.token().get_secret_value()
            resource = self._client(token)(path.strip("/"))
            call = {"get": resource.get, "create": resource.post, "set": resource.put, "delete": resource.delete}[method]
            return call(**(params or {}))
        except Exception as e:  # noqa: BLE001 — every failure is re-raised without the token
            detail = f"{type(e).__name__}: {e}"
            errors = getattr(e, "errors", None)
            if errors:
                detail += f" ({errors})"
            if token:
                detail = detail.replace(token, "***")
        raise PveApiError(f"Proxmox API {HTTP_METHOD[method]} {path} via {self!r} failed: {detail}")

    def wait_task(self, upid: str, timeout_s: float) -> str:
        """Wait for a task (`UPID:...`) to end; its exit status ("OK" or the error)."""
        deadline = time.monotonic() + timeout_s
        while True:
            status = self.request("get", f"/nodes/{self.node}/tasks/{upid}/status")
            if status.get("status") != "running":
                return str(status.get("exitstatus"))
            if time.monotonic() > deadline:
                return f"task {upid} still running after {timeout_s:.0f} s"
            time.sleep(1)

    def power(self, kind: str, gid: int, action: str, params: dict | None = None, task_timeout: float = 60) -> str:
        """start/stop/shutdown a guest and wait for its task; its exit status."""
        upid = self.request("create", f"/nodes/{self.node}/{kind}/{gid}/status/{action}", params)
        if isinstance(upid, str) and upid.startswith("UPID:"):
            return self.wait_task(upid, task_timeout)
        return "OK"


# ---------------------------------------------------------------- FunctionCommand bodies


def api_write(api: PveApi, write: PveWrite) -> None:
    """Run one `PveWrite` (a FunctionCommand body); a task it starts must end OK."""
    result = api.request(write.method, write.path, write.data())
    if isinstance(result, str) and result.startswith("UPID:"):
        status = api.wait_task(result, REQUEST_TIMEOUT_S + TASK_SLACK_S)
        if status != "OK":
            raise PveApiError(f"{write} via {api!r}: task ended with {status}")


MERGE_TRIES = 10  # writes of other nodes in between a read and its digest-checked set


def node_of_map(entry: str) -> str | None:
    """The `node=` of one `map` property string of a PCI mapping."""
    for part in entry.split(","):
        if part.startswith("node="):
            return part[5:]
    return None


def api_merge_mapping(api: PveApi, mid: str, node: str, mine: list[str], description: str = "") -> None:
    """This node's `map` entries of PCI mapping `mid` become `mine`, other nodes' entries kept as
    they are when the write runs (a FunctionCommand body; templates/mapping-merge.sh.j2 is the
    same over SSH): the API's get returns the file's digest, and the set carrying it is refused
    when another node wrote in between (pve-manager PVE/API2/Cluster/Mapping/PCI.pm update:
    assert_if_modified under lock_pci_config); then it is read and computed again."""
    error = ""
    for _ in range(MERGE_TRIES):
        try:
            current = api.request("get", f"/cluster/mapping/pci/{mid}")
        except PveApiError as e:
            if "not found" not in str(e):
                raise
            current = None
        try:
            if current is None:
                if mine:
                    api.request("create", "/cluster/mapping/pci", {"id": mid, "map": list(mine),
                                                                   **({"description": description} if description else {})})
                return
            maps = [m for m in current.get("map") or [] if node_of_map(m) != node] + list(mine)
            params: dict = {"digest": current.get("digest"), **({"map": maps} if maps else {"delete": "map"})}
            api.request("set", f"/cluster/mapping/pci/{mid}", params)
            return
        except PveApiError as e:
            if "detected modified configuration" not in str(e) and "already defined" not in str(e):
                raise
            error = str(e)
        time.sleep(1)
    raise PveApiError(f"PCI mapping {mid} (node {node}): other nodes kept writing it: {error}")


def api_guest_stop(api: PveApi, kind: str, gid: int, timeout: int) -> None:
    """Shut a guest down cleanly; stop it hard only when that fails (a FunctionCommand body)."""
    label = f"{KIND_LABEL[kind]} {gid}"
    try:
        status = api.power(kind, gid, "shutdown", {"timeout": timeout, "forceStop": 0}, timeout + TASK_SLACK_S)
    except PveApiError as e:
        status = str(e)
    if status == "OK":
        logger.info(f"{host.name}: {label} shut down")
        return
    logger.warning(f"{host.name}: {label} did not shut down within {timeout} s ({status}); stopping it")
    status = api.power(kind, gid, "stop", None, TASK_SLACK_S)
    if status != "OK":
        raise PveApiError(f"{label} could not be stopped via {api!r}: {status}")


def api_guest_start(api: PveApi, kind: str, gid: int) -> None:
    status = api.power(kind, gid, "start", None, TASK_SLACK_S)
    if status != "OK":
        raise PveApiError(f"{KIND_LABEL[kind]} {gid} could not be started via {api!r}: {status}")


# ---------------------------------------------------------------- commands for operations


def shutdown_shell(kind: str, gid: int, timeout: int) -> str:
    """`qm shutdown 300 --timeout 120`, falling back to `qm stop` with a line on stderr and in
    the host's syslog when the shutdown fails; non-zero only when the stop fails too."""
    tool, q = KIND_TOOL[kind], word(str(gid))
    msg = word(f"pvegpu: {KIND_LABEL[kind]} {gid} did not shut down within {timeout} s; stopping it")
    return (f"{tool} shutdown {q} --timeout {int(timeout)} || {{ echo {msg} >&2; "
            f"logger -t pvegpu {msg} 2>/dev/null || true; {tool} stop {q}; }}")


def wait_stopped_shell(kind: str, gid: int, timeout: int) -> str:
    """Waits (up to `timeout` s) until `qm/pct status <gid>` says stopped; non-zero if it does not."""
    tool, q = KIND_TOOL[kind], word(str(gid))
    return (f"( n=0; until {tool} status {q} 2>/dev/null | grep -qx 'status: stopped'; do "
            f"n=$((n+1)); [ $n -le {int(timeout)} ] || exit 1; sleep 1; done )")


def guest_stop_commands(api: PveApi | None, kind: str, gid: int, timeout: int) -> list:
    """The command that shuts guest `gid` down (see `shutdown_shell` / `api_guest_stop`). Called
    by an operation right before it yields it: the run's guest state is read again after it."""
    guest_state_changes()
    if api is None:
        return [StringCommand(shutdown_shell(kind, gid, timeout))]
    return [FunctionCommand(api_guest_stop, (api, kind, gid, int(timeout)), {})]


def guest_start_commands(api: PveApi | None, kind: str, gid: int) -> list:
    """The command that starts guest `gid`. Called by an operation right before it yields it:
    the run's guest state is read again after it."""
    guest_state_changes()
    if api is None:
        return [StringCommand(f"{KIND_TOOL[kind]} start {word(str(gid))}")]
    return [FunctionCommand(api_guest_start, (api, kind, gid), {})]


def write_commands(api: PveApi | None, write: PveWrite, shell: str | None = None) -> list:
    """A write through the API, else over SSH: `shell` when given (`qm set ...`), else pvesh."""
    if api is None:
        return [StringCommand(shell or write.pvesh())]
    return [FunctionCommand(api_write, (api, write), {})]


def api_of(spec, node: str) -> PveApi | None:
    """The host's `PveApi` when its spec has `proxmox_api`, else None (SSH)."""
    return PveApi(spec.proxmox_api, node) if spec.proxmox_api is not None else None
