"""Host checks against a host they cannot reach (issue 28 part 7): one failure naming host,
address and why; every other check is not run. Runs `pytest tests/host` as a user does, on
inventories made from the kpro6 example with an address that cannot answer."""
from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]


def host_checks(tmp_path: Path, hostname: str, port: int | None = None) -> subprocess.CompletedProcess:
    spec = yaml.safe_load((ROOT / "inventories/kpro6.yml").read_text())
    spec["hosts"]["kpro6"]["ssh"]["hostname"] = hostname
    if port is not None:
        spec["hosts"]["kpro6"]["ssh"]["port"] = port
    (tmp_path / "site.yml").write_text(yaml.safe_dump(spec))
    (tmp_path / "site.py").write_text("from pathlib import Path\nfrom spec.load import inventory_hosts\n"
                                      "gpu_hosts = inventory_hosts(Path(__file__).with_suffix('.yml'))\n")
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/host",
                           "--inventory", str(tmp_path / "site.py")], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)


def _one_failure_rest_skipped(done: subprocess.CompletedProcess, sentence: str) -> None:
    out = done.stdout + done.stderr
    assert done.returncode == 1, out[-3000:]
    assert out.count(sentence) >= 1 and "1 failed" in out and "passed" not in out and "error" not in out, out[-3000:]
    assert "Traceback" not in out and "gaierror" not in out and "def test_" not in out, out[-3000:]
    assert "not checked, the host cannot be reached" in out


def test_a_name_that_does_not_resolve(tmp_path):
    done = host_checks(tmp_path, "kpro6.pvegpu.invalid")  # .invalid never resolves (RFC 2606)
    _one_failure_rest_skipped(done, "kpro6: cannot reach kpro6.pvegpu.invalid: the name does not resolve")


def test_an_address_where_nothing_listens(tmp_path):
    with socket.socket() as s:  # a port that was free a moment ago: nothing listens there now
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    done = host_checks(tmp_path, "127.0.0.1", port)
    _one_failure_rest_skipped(done, f"kpro6: cannot reach 127.0.0.1 (127.0.0.1) on ssh port {port}: Connection refused")
