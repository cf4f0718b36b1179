"""Issue 31 part 2: every command operand from the spec passes through one quoting helper
(facts/shell.py `operands`/`word`), which ends options where the command takes them.

The line is held by reading the code: operations/, plan/ and facts/ (but facts/shell.py itself)
never name shlex (a direct shlex.quote there would bypass the end of options). The builders' operands are then checked
command by command, and a leading '-' is refused where the program has no end of options.
"""

from __future__ import annotations

import ast
import subprocess
from pathlib import Path

import pytest

from operations import files, handlers
from operations import nvidia as nvidia_ops
from plan import kernel as kernel_plan

ROOT = Path(__file__).resolve().parents[2]


# the helper itself is the one place shlex is named
HELPER = "facts/shell.py"


def shlex_uses(directory: str, root: Path = ROOT) -> list[str]:
    """Every import of shlex and every `shlex.<name>` under `directory` (file:line), but in HELPER."""
    found = []
    for path in sorted((root / directory).rglob("*.py")):
        if path.relative_to(root).as_posix() == HELPER:
            continue
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
                names = [node.value.id]
            elif isinstance(node, ast.Name):
                names = [node.id]
            if "shlex" in names:
                found.append(f"{path.relative_to(root)}:{getattr(node, 'lineno', 0)}")
    return found


@pytest.mark.parametrize("directory", ["operations", "plan", "facts"])
def test_command_builders_quote_only_through_facts_shell(directory):
    assert shlex_uses(directory) == [], "use facts.shell.operands (operands of a command) or word"


def test_a_signing_key_path_is_read_after_the_end_of_options():
    """NvidiaHostState reads the spec's signing key with `head -n 1 -- <key>`."""
    from facts.nvidia import NvidiaHostState
    command = NvidiaHostState().command([], signing=["/root/mok.key", "/root/mok.der"])
    assert "head -n 1 -- /root/mok.key | grep -q" in command


def test_the_lint_sees_a_direct_shlex_quote(tmp_path):
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "m.py").write_text("import shlex as s\nfrom shlex import quote\nq = shlex.quote('a')\n")
    assert shlex_uses("x", tmp_path) == ["x/m.py:1", "x/m.py:2", "x/m.py:3", "x/m.py:3"]


def test_spec_operands_come_after_the_end_of_options():
    assert nvidia_ops.cleanup_command("595.71.05") == "rm -rf -- /var/cache/pvegpu/nvidia-build/595.71.05"
    assert nvidia_ops.userspace_command("/c/x.run").startswith("sh -- /c/x.run --silent")
    assert "v=$(sh -- /c/x.run --version" in nvidia_ops.installer_version_command("/c/x.run", "595.71.05")
    assert handlers.depmod_command({"/lib/modules/6.14.8-2-pve/updates/pvegpu/nvidia.ko": 1}) == "depmod -- 6.14.8-2-pve"
    write = files.write_file_command("/etc/systemd/system/a.service.d/pvegpu-nccl.conf", "x\n")
    assert "mkdir -p -- /etc/systemd/system/a.service.d &&" in write
    assert write.endswith("mv -f -- /etc/systemd/system/a.service.d/pvegpu-nccl.conf.pvegpu-tmp "
                          "/etc/systemd/system/a.service.d/pvegpu-nccl.conf")


def test_no_end_of_options_means_a_leading_dash_is_refused():
    """proxmox-boot-tool reads the release as "$2" (no options parser, no '--'): a release
    starting with '-' is refused rather than passed (the spec refuses it at load too)."""
    assert kernel_plan.set_default_command("6.14.8-2-pve", kernel_plan.SYSTEMD_BOOT).startswith(
        "proxmox-boot-tool kernel pin 6.14.8-2-pve &&")
    with pytest.raises(ValueError):
        kernel_plan.set_default_command("--next-boot", kernel_plan.SYSTEMD_BOOT)


def test_dash_takes_the_end_of_options_before_a_script(tmp_path):
    """The host's sh (dash) reads '--' as the end of its options: `sh -- <run> --version` runs the
    file and hands it --version (what installer_version_command relies on)."""
    (tmp_path / "-x.run").write_text('printf "%s\\n" "$@"\n')
    out = subprocess.run(["sh", "-c", nvidia_ops.userspace_command("-x.run")],
                         cwd=tmp_path, capture_output=True, text=True, check=True)
    assert out.stdout.split() == list(nvidia_ops.USERSPACE_FLAGS)
