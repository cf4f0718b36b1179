"""Issue 43 item 2: the device-node listing does not depend on the host's locale or TIME_STYLE.
NvidiaDeviceNodes runs `stat -c '%f %t %T %n'` (fixed formats); its parser still reads `ls -l`
listings in any time style. Both on the same device nodes recorded under two configurations
(tests/fixtures/device-nodes/, INDEX.tsv), and the probe sets LC_ALL=C for all its programs."""

from __future__ import annotations

from pathlib import Path

import pytest

from facts.devices import NvidiaDeviceNodes, parse_device_listing
from facts.hardware import LOCALE_FREE, HardwareProbe

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "device-nodes"
CONFIGS = ("c-locale", "de-long-iso")
EXPECTED = {"/dev/null": (1, 3), "/dev/zero": (1, 5), "/dev/full": (1, 7), "/dev/urandom": (1, 9),
            "/dev/net/tun": (10, 200)}


def recorded(config: str) -> tuple[list[str], list[str]]:
    """(the ls -l lines, the stat lines) recorded under `config`."""
    lines = (FIXTURES / f"char-devices-{config}.txt").read_text().splitlines()[2:]
    at = lines.index("@@ stat")
    return lines[:at], lines[at + 1:]


@pytest.mark.parametrize("config", CONFIGS)
def test_every_form_gives_the_same_nodes_under_every_configuration(config):
    listing, stat = recorded(config)
    want = {path: {"type": "char", "major": major, "minor": minor} for path, (major, minor) in EXPECTED.items()}
    assert parse_device_listing(stat) == want  # the directory /dev/net (41ed) is no node
    assert parse_device_listing(listing) == want


def test_the_old_listing_reader_lost_every_node_of_a_long_iso_host():
    """The fact's regex before issue 43 wanted three date words: a long-iso `ls -l` gave no node."""
    import re

    old = re.compile(r"^([cb])[-rwxsStT]{9}\S*\s+\d+\s+\S+\s+\S+\s+(\d+),\s*(\d+)\s+\S+\s+\S+\s+\S+\s+(\S+)\s*$")
    assert [line for line in recorded("de-long-iso")[0] if old.match(line)] == []
    assert len([line for line in recorded("c-locale")[0] if old.match(line)]) == 5


def test_the_commands_use_fixed_formats_and_the_probe_the_c_locale():
    assert "ls " not in NvidiaDeviceNodes.command and "stat -c '%f %t %T %n'" in NvidiaDeviceNodes.command
    probe = HardwareProbe().command
    assert probe.startswith("{ " + LOCALE_FREE)  # once, before the prelude and every section
    assert probe.count("LC_ALL=C") == 1


def test_the_stat_command_lists_nodes_and_directory_entries(tmp_path, monkeypatch):
    """The command's globs on a real tree: every /dev/nvidia* entry and each entry of a /dev/nvidia*
    directory (nvidia-caps/), as `ls -l /dev/nvidia*` listed them; a file is no node."""
    import subprocess

    (tmp_path / "nvidia-caps").mkdir()
    (tmp_path / "nvidia-caps" / "nvidia-cap1").write_text("")
    (tmp_path / "nvidiactl").write_text("")
    command = NvidiaDeviceNodes.command.replace("/dev/", f"{tmp_path}/")
    out = subprocess.run(["sh", "-c", command], capture_output=True, text=True, env={"PATH": "/usr/bin:/bin",
                         "LANG": "de_DE.UTF-8", "TIME_STYLE": "long-iso"}, timeout=30).stdout.splitlines()
    assert sorted(line.split()[-1] for line in out) == sorted(
        [f"{tmp_path}/nvidia-caps", f"{tmp_path}/nvidia-caps/nvidia-cap1", f"{tmp_path}/nvidiactl"])
    assert parse_device_listing(out) == {}
