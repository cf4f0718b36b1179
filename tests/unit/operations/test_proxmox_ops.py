"""operations.proxmox: API writes as FunctionCommands (against the twin's API stand-in, run
here on a scratch root), the token kept out of every repr and error, and the shutdown-then-stop
shell fallback run with stub qm/pct."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import traceback
from pathlib import Path

import pytest
from pyinfra.api import FunctionCommand, StringCommand
from pyinfra.context import ctx_host, ctx_state
from pyinfra_testing.util import FakeState, create_host

from operations.proxmox import (
    PveApi,
    PveApiError,
    PveWrite,
    api_guest_start,
    api_guest_stop,
    api_merge_mapping,
    api_write,
    guest_start_commands,
    guest_stop_commands,
    shutdown_shell,
    write_commands,
)
from spec.models import HostSpec, ProxmoxApiSpec
from tests.twin import hardware

REPO = Path(__file__).resolve().parents[3]

TOKEN = "0d5c7c55-9a41-4e3b-token-must-not-leak"
STANDIN = Path(__file__).resolve().parents[2] / "twin/standins/pveapi.py"
MAP = "id=10de:2bb5,iommugroup=3,node=kpro6,path=0000:81:00"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The API stand-in on 127.0.0.1:<free port>, serving a scratch kpro6 twin root."""
    root = tmp_path_factory.mktemp("root")
    hardware.install(root, "kpro6")
    for d in ("etc/pve/priv", "var/log", "run"):
        (root / d).mkdir(parents=True, exist_ok=True)
    (root / "etc/pve/priv/token.cfg").write_text(f"root@pam!pvegpu {TOKEN}\n")
    port = free_port()
    proc = subprocess.Popen(["python3", str(STANDIN), "--listen", "127.0.0.1", "--port", str(port)],
                            env={**os.environ, "TWIN_ROOT": str(root)}, stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    assert proc.stderr is not None  # stderr=PIPE
    deadline = time.monotonic() + 20
    while not (root / "run/pveapi.pid").exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read().decode()
        time.sleep(0.05)
    yield {"root": root, "port": port, "cert": root / "etc/pve/local/pve-ssl.pem"}
    proc.terminate()
    proc.wait(timeout=10)


@pytest.fixture
def api(server, monkeypatch):
    monkeypatch.setenv("PVEGPU_TEST_TOKEN", TOKEN)
    spec = ProxmoxApiSpec(host="127.0.0.1", port=server["port"], token_name="pvegpu",
                          token_env="PVEGPU_TEST_TOKEN", ca_file=str(server["cert"]))
    return PveApi(spec, "kpro6")


def in_host(fn, *args):
    host = create_host(FakeState())
    with ctx_state.use(FakeState()), ctx_host.use(host):
        return fn(*args)


def guests_log(server) -> list[str]:
    text = (server["root"] / "var/lib/twin/guests.log").read_text() if (server["root"] / "var/lib/twin/guests.log").exists() else ""
    return [" ".join(l.split()[1:]) for l in text.splitlines()]


# ---------------------------------------------------------------- commands, no request


def test_pvesh_form_quotes_every_value():
    write = PveWrite("create", "/cluster/mapping/pci", (("id", "pvegpu-x"), ("map", MAP), ("map", "a b;c")))
    assert write.pvesh() == f"pvesh create /cluster/mapping/pci --id pvegpu-x --map {MAP} --map 'a b;c'"
    assert write.data() == {"id": "pvegpu-x", "map": [MAP, "a b;c"]}
    assert str(PveWrite("delete", "/cluster/mapping/pci/pvegpu-x")) == "DELETE /cluster/mapping/pci/pvegpu-x"


def test_without_api_the_writes_are_shell_commands():
    write = PveWrite("delete", "/cluster/mapping/pci/pvegpu-x")
    [cmd] = write_commands(None, write)
    assert isinstance(cmd, StringCommand) and str(cmd) == "pvesh delete /cluster/mapping/pci/pvegpu-x"
    assert str(write_commands(None, write, "qm set 300 --delete hostpci1")[0]) == "qm set 300 --delete hostpci1"
    # guest start/stop record the guest change in the host's run state: a host context of its own
    # (outside one, the test passed only when an earlier test had left a host behind)
    assert str(in_host(guest_start_commands, None, "lxc", 200)[0]) == "pct start 200"
    assert str(in_host(guest_stop_commands, None, "qemu", 300, 90)[0]).startswith("qm shutdown 300 --timeout 90 || ")


def test_api_commands_are_function_commands_whose_repr_hides_the_token(api):
    commands = (write_commands(api, PveWrite("create", "/cluster/mapping/pci", (("id", "x"), ("map", MAP))))
                + in_host(guest_stop_commands, api, "qemu", 300, 60) + in_host(guest_start_commands, api, "lxc", 200))
    assert all(isinstance(c, FunctionCommand) for c in commands)
    text = " ".join(repr(c) + str(c) + repr(c.args) + repr(c.kwargs) for c in commands)
    assert TOKEN not in text and "PveApi(https://127.0.0.1:" in text and "root@pam!pvegpu" in text
    assert TOKEN not in repr(api.spec) and TOKEN not in str(api.spec.model_dump())


def test_generating_the_commands_sends_nothing(api, server):
    log = server["root"] / "var/log/pveapi.log"
    before = log.read_text() if log.exists() else ""
    write_commands(api, PveWrite("delete", "/cluster/mapping/pci/none"))
    in_host(guest_stop_commands, api, "qemu", 300, 60)
    assert (log.read_text() if log.exists() else "") == before


# ---------------------------------------------------------------- requests to the stand-in


def test_mapping_create_set_delete_through_the_api(api, server):
    cfg = server["root"] / "etc/pve/mapping/pci.cfg"
    in_host(api_write, api, PveWrite("create", "/cluster/mapping/pci", (("id", "pvegpu-t"), ("map", MAP))))
    assert f"pvegpu-t\n\tmap {MAP}\n" in cfg.read_text()
    other = MAP.replace("iommugroup=3", "iommugroup=4")
    in_host(api_write, api, PveWrite("set", "/cluster/mapping/pci/pvegpu-t", (("map", other), ("map", "id=1:2,node=b,path=0000:01:00.0"))))
    assert f"\tmap {other}\n\tmap id=1:2,node=b,path=0000:01:00.0\n" in cfg.read_text()
    in_host(api_write, api, PveWrite("delete", "/cluster/mapping/pci/pvegpu-t"))
    assert "pvegpu-t" not in cfg.read_text()
    assert "POST /api2/json/cluster/mapping/pci 200" in (server["root"] / "var/log/pveapi.log").read_text()


def test_vm_config_set_and_power_actions_through_the_api(api, server):
    conf = server["root"] / "etc/pve/nodes/kpro6/qemu-server/300.conf"
    in_host(api_write, api, PveWrite("set", "/nodes/kpro6/qemu/300/config", (("description", "set via api"),)))
    assert "#set via api" in conf.read_text()
    in_host(api_guest_start, api, "qemu", 300)
    in_host(api_guest_stop, api, "qemu", 300, 30)
    assert guests_log(server)[-2:] == ["start qemu 300", "shutdown qemu 300"]


def test_shutdown_that_times_out_falls_back_to_stop(api, server, monkeypatch, caplog):
    in_host(api_guest_start, api, "lxc", 200)
    real = PveApi.request

    def request(self, method, path, params=None):
        if path.endswith("/status/shutdown"):  # what PVE's task says when the guest ignores ACPI
            return "UPID:kpro6:00000001:00000002:00000003:vzshutdown:200:root@pam:"
        if "/tasks/" in path and "vzshutdown" in path:
            return {"status": "stopped", "exitstatus": "VM quit/powerdown failed - got timeout"}
        return real(self, method, path, params)

    monkeypatch.setattr(PveApi, "request", request)
    in_host(api_guest_stop, api, "lxc", 200, 7)
    assert guests_log(server)[-2:] == ["start lxc 200", "stop lxc 200"]
    assert "CT 200 did not shut down within 7 s (VM quit/powerdown failed - got timeout); stopping it" in caplog.text


def test_errors_name_the_request_and_never_the_token(api, server):
    with pytest.raises(PveApiError) as err:
        in_host(api_write, api, PveWrite("create", "/cluster/mapping/pci", (("id", "pvegpu-bad"), ("map", "node=kpro6"))))
    message = str(err.value)
    assert "POST /cluster/mapping/pci" in message and "missing property" in message
    assert err.value.__cause__ is None and err.value.__context__ is None
    assert TOKEN not in "".join(traceback.format_exception(err.value))


def test_a_wrong_token_is_refused_and_the_error_masks_what_was_sent(server, monkeypatch):
    wrong = TOKEN + "-wrong"
    monkeypatch.setenv("PVEGPU_TEST_TOKEN", wrong)
    api = PveApi(ProxmoxApiSpec(host="127.0.0.1", port=server["port"], token_name="pvegpu",
                                token_env="PVEGPU_TEST_TOKEN", ca_file=str(server["cert"])), "kpro6")
    with pytest.raises(PveApiError) as err:
        api.request("get", "/version")
    assert "401" in str(err.value) and wrong not in "".join(traceback.format_exception(err.value))


def test_an_unverifiable_certificate_is_an_error(server, monkeypatch):
    monkeypatch.setenv("PVEGPU_TEST_TOKEN", TOKEN)
    api = PveApi(ProxmoxApiSpec(host="127.0.0.1", port=server["port"], token_name="pvegpu",
                                token_env="PVEGPU_TEST_TOKEN"), "kpro6")  # system CAs only
    with pytest.raises(PveApiError, match="SSLError|certificate verify failed"):
        api.request("get", "/version")


def test_token_problems_are_sentences(monkeypatch, tmp_path):
    monkeypatch.delenv("PVEGPU_NO_SUCH_TOKEN", raising=False)
    api = PveApi(ProxmoxApiSpec(host="127.0.0.1", token_name="pvegpu", token_env="PVEGPU_NO_SUCH_TOKEN"), "n")
    assert "PVEGPU_NO_SUCH_TOKEN" in (api.problem() or "") and "is not set" in (api.problem() or "")
    (tmp_path / "t").write_text("secret\n")
    (tmp_path / "t").chmod(0o600)
    api = PveApi(ProxmoxApiSpec(host="127.0.0.1", token_name="pvegpu", token_file=str(tmp_path / "t")), "n")
    assert api.problem() is None


# ---------------------------------------------------------------- issue 39 item 5: TLS and the token's file


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o660], ids=oct)
def test_a_token_file_others_can_read_is_refused_naming_it(tmp_path, mode):
    token = tmp_path / "token"
    token.write_text("secret-token-value\n")
    token.chmod(mode)
    api = PveApi(ProxmoxApiSpec(host="127.0.0.1", token_name="pvegpu", token_file=str(token)), "n")
    problem = api.problem() or ""
    assert f"proxmox_api.token_file {token} is mode {mode:04o}" in problem and "chmod 600" in problem, problem
    assert "secret-token-value" not in problem
    with pytest.raises(PveApiError, match="readable by its owner only"):
        api.request("get", "/version")


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid needs root")
def test_a_token_file_of_another_account_is_refused(tmp_path):
    token = tmp_path / "token"
    token.write_text("secret\n")
    token.chmod(0o600)
    os.chown(token, 4242, -1)
    api = PveApi(ProxmoxApiSpec(host="127.0.0.1", token_name="pvegpu", token_file=str(token)), "n")
    assert "owner uid 4242" in (api.problem() or "")


@pytest.mark.parametrize("mode", [0o664, 0o646], ids=oct)
def test_a_ca_file_others_can_write_is_refused(tmp_path, monkeypatch, mode):
    ca = tmp_path / "ca.pem"
    ca.write_text("-----BEGIN CERTIFICATE-----\n")
    ca.chmod(mode)
    monkeypatch.setenv("PVEGPU_UNIT_TOKEN", "x")
    api = PveApi(ProxmoxApiSpec(host="127.0.0.1", token_name="pvegpu", token_env="PVEGPU_UNIT_TOKEN",
                                ca_file=str(ca)), "n")
    assert f"proxmox_api.ca_file {ca} is mode {mode:04o}" in (api.problem() or "")
    ca.chmod(0o644)
    assert api.problem() is None


def test_verify_ssl_false_is_said_at_every_run(monkeypatch):
    from operations import guests

    monkeypatch.setenv("PVEGPU_UNIT_TOKEN", "x")
    said: list[str] = []
    monkeypatch.setattr(guests, "logger", type("L", (), {"warning": staticmethod(said.append)}))
    monkeypatch.setattr(guests, "node_of", lambda spec: "kpro6")  # the host's NodeName fact
    spec = HostSpec(node="kpro6", proxmox_api={"host": "10.0.0.5", "token_name": "pvegpu",
                                               "token_env": "PVEGPU_UNIT_TOKEN", "verify_ssl": False})
    assert in_host(guests.preflight, spec) == []
    assert len(said) == 1 and ": proxmox_api.verify_ssl is false" in said[0] and "WITHOUT checking" in said[0]
    assert "10.0.0.5:8006" in said[0] and "proxmox_api.ca_file" in said[0]
    said.clear()
    checked = HostSpec(node="kpro6", proxmox_api={"host": "10.0.0.5", "token_name": "pvegpu",
                                                  "token_env": "PVEGPU_UNIT_TOKEN"})
    assert in_host(guests.preflight, checked) == [] and said == []


def test_the_api_client_leaves_urllib3s_insecure_warning_on(tmp_path):
    """proxmoxer's https backend runs urllib3.disable_warnings() when it is imported: every
    InsecureRequestWarning of the process would be hidden. In a fresh interpreter (the backend
    not yet imported), after PveApi made its client the warning is still shown."""
    code = """
import os, warnings
from operations.proxmox import PveApi
from spec.models import ProxmoxApiSpec
os.environ["PVEGPU_UNIT_TOKEN"] = "x"
api = PveApi(ProxmoxApiSpec(host="127.0.0.1", token_name="pvegpu", token_env="PVEGPU_UNIT_TOKEN",
                            verify_ssl=False), "n")
api._client("x")
import proxmoxer.backends.https  # noqa: F401  (imported by the client above)
from urllib3.exceptions import InsecureRequestWarning
with warnings.catch_warnings(record=True) as seen:
    warnings.warn("unverified", InsecureRequestWarning)
print("shown" if seen else "hidden")
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=60,
                       env={**os.environ, "PYTHONPATH": str(REPO)})
    assert r.stdout.strip() == "shown", r.stderr


# ---------------------------------------------------------------- SSH form of the stop


@pytest.mark.parametrize("shutdown_rc, want", [(0, ["qm shutdown 300 --timeout 5"]),
                                               (1, ["qm shutdown 300 --timeout 5", "qm stop 300"])])
def test_shutdown_shell_stops_hard_only_after_a_failed_shutdown(tmp_path, shutdown_rc, want):
    log = tmp_path / "calls.log"
    (tmp_path / "qm").write_text(f'#!/bin/sh\necho "qm $*" >> {log}\n[ "$1" = shutdown ] && exit {shutdown_rc}\nexit 0\n')
    (tmp_path / "qm").chmod(0o755)
    (tmp_path / "logger").write_text("#!/bin/sh\nexit 0\n")
    (tmp_path / "logger").chmod(0o755)
    result = subprocess.run(["sh", "-c", shutdown_shell("qemu", 300, 5)], capture_output=True, text=True,
                            env={**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}"})
    assert result.returncode == 0
    assert log.read_text().splitlines() == want
    assert ("VM 300 did not shut down within 5 s; stopping it" in result.stderr) == bool(shutdown_rc)


def test_missing_requests_is_refused_not_an_exit(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "requests" else real(name, *a))
    monkeypatch.setenv("PVEGPU_UNIT_TOKEN", "x")
    api = PveApi(ProxmoxApiSpec(host="127.0.0.1", token_name="pvegpu", token_env="PVEGPU_UNIT_TOKEN"), "n")
    assert "needs the Python package requests" in (api.problem() or "")
    with pytest.raises(PveApiError, match="needs the Python package requests"):
        api.request("get", "/version")


def test_mapping_merge_through_the_api_keeps_a_write_of_another_node_in_between(api, server, monkeypatch):
    # issue 26: the set carries the digest of the get it was computed from; another node's write
    # in between makes the API refuse it (assert_if_modified) and the merge reads again
    cfg = server["root"] / "etc/pve/mapping/pci.cfg"
    in_host(api_write, api, PveWrite("create", "/cluster/mapping/pci", (("id", "pool-t"), ("map", MAP.replace("kpro6", "n0")))))
    real = api.request
    raced: list[str] = []

    def request(method, path, params=None):
        reply = real(method, path, params)
        if method == "get" and not raced:  # another node merges its entry right after our read
            raced.append(path)
            real("set", path, {"map": [*reply["map"], MAP.replace("kpro6", "n1")]})
        return reply
    monkeypatch.setattr(api, "request", request)
    monkeypatch.setattr("operations.proxmox.time.sleep", lambda s: None)
    in_host(api_merge_mapping, api, "pool-t", "kpro6", [MAP])
    text = cfg.read_text()
    assert raced and all(f"node={n}," in text for n in ("n0", "n1", "kpro6")), text
    in_host(api_merge_mapping, api, "pool-t", "n1", [])  # a node without such GPUs takes only its own out
    assert "node=n1," not in cfg.read_text() and "node=n0," in cfg.read_text() and "node=kpro6," in cfg.read_text()
