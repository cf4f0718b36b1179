"""The shell templates (templates/*.sh.j2): every value a caller passes lands quoted.

For each template and each value it takes, a hostile value (spaces, `;`, `$(…)`, backticks,
both quotes, a backslash, a newline) is rendered in: the script still parses (`sh -n`) and every
piece of the value that a shell would act on sits inside single quotes (a small lexer below).
The scripts that can run here run with that value and stand-in tools: the value arrives
literally (as one argument, in a path, in a message) and nothing it says is executed. Also: the
representative values shellcheck renders with (plan/render.py SHELL_EXAMPLES) have exactly the
keys the operations pass.
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
from pathlib import Path

import pytest

from operations import gpus, kernel
from operations import nvidia as ops
from plan import rebind, render
from plan.gpus import Move, RebindPlan
from spec.models import HostSpec, KernelSpec


def hostile(tag: str) -> str:
    """A value a shell would act on in every way unless it is quoted (no `/`: it is also a file name)."""
    return f"x y;touch PWN{tag}a;$(touch PWN{tag}b)`touch PWN{tag}c`'\"\\\n{tag}*"


def spec_hostile(tag: str) -> str:
    """`hostile` less the newline and the backslash, for the scripts that run: a spec value has no
    control characters (spec.models SafeStr) and the scripts read paths from find line by line;
    GNU tar unquotes backslash escapes in the names it is given and dash's echo reads them (the
    rendered script still hands both over literally: the static test above has them)."""
    return hostile(tag).replace("\n", "").replace("\\", "")


MARKERS = ("touch PWN",)


# per state: a run of characters that changes no state of single_quoted (nothing that opens or
# closes a quote, comment or `$( )`; a '$' not before '('); in plain text and `$( )` a '#' may
# start a comment, so it ends a run
_ORDINARY = {
    "plain": re.compile(r"(?:[^\\'\"#$()]|\$(?!\())+"),
    "sub": re.compile(r"(?:[^\\'\"#$()]|\$(?!\())+"),
    "double": re.compile(r"(?:[^\\\"$]|\$(?!\())+"),
}


def single_quoted(script: str) -> list[bool]:
    """For each character of `script`: is it inside single quotes? (sh lexing: quotes, backslash,
    comments, `$( )` also inside double quotes, where quotes count again).
    A run of characters that changes no state is taken in one step (the hostile walks lex
    thousands of long scripts)."""
    inside = [False] * len(script)
    stack, i, word_start, n = ["plain"], 0, True, len(script)
    while i < n:
        state = stack[-1]
        if state == "single":
            end = script.find("'", i)
            end = n if end == -1 else end
            inside[i:end] = [True] * (end - i)
            if end < n:
                stack.pop()
            i, word_start = end + 1, False
            continue
        if state == "comment":
            end = script.find("\n", i)
            if end == -1:
                break
            i = end  # the newline itself: below
        else:
            run = _ORDINARY[state].match(script, i)
            if run:
                i = run.end()
                word_start = state != "double" and script[i - 1] in " \t\n;&|"
                continue
        c = script[i]
        if state == "comment":
            stack.pop()
        elif state == "double":
            if c == "\\":
                i += 1
            elif c == '"':
                stack.pop()
            elif script.startswith("$(", i):
                stack.append("sub")
                i += 1
        else:
            if c == "\\":
                i += 1
            elif c == "'":
                stack.append("single")
            elif c == '"':
                stack.append("double")
            elif c == "#" and word_start:
                stack.append("comment")
            elif script.startswith("$(", i):
                stack.append("sub")
                i += 1
            elif c == "(" and state == "sub":
                stack.append("sub")
            elif c == ")" and state == "sub":
                stack.pop()
        word_start = c in " \t\n;&|()" and stack[-1] in ("plain", "sub")
        i += 1
    return inside


def single_quoted_by_char(script: str) -> list[bool]:
    """single_quoted, one character at a time (the reading it must give, kept to test it against)."""
    inside = [False] * len(script)
    stack, i, word_start = ["plain"], 0, True
    while i < len(script):
        c, state = script[i], stack[-1]
        if state == "single":
            if c == "'":
                stack.pop()
            else:
                inside[i] = True
        elif state == "comment":
            if c == "\n":
                stack.pop()
        elif state == "double":
            if c == "\\":
                i += 1
            elif c == '"':
                stack.pop()
            elif script.startswith("$(", i):
                stack.append("sub")
                i += 1
        else:  # plain, or inside $( ) / ( ) there
            if c == "\\":
                i += 1
            elif c == "'":
                stack.append("single")
            elif c == '"':
                stack.append("double")
            elif c == "#" and word_start:
                stack.append("comment")
            elif script.startswith("$(", i):
                stack.append("sub")
                i += 1
            elif c == "(" and state == "sub":
                stack.append("sub")
            elif c == ")" and state == "sub":
                stack.pop()
        word_start = c in " \t\n;&|()" and stack[-1] in ("plain", "sub")
        i += 1
    return inside


def test_single_quoted_reads_as_one_character_at_a_time():
    """The run-skipping lexer gives every character the state the char-by-char one gives: on
    every template and on random strings of the characters that change its state."""
    import random

    rnd = random.Random(31)
    alphabet = [*"ab \t\n;&|()'\"\\#$\r{}", "$(", "'", "#"]
    texts = [p.read_text() for p in (Path(__file__).resolve().parents[2] / "templates").iterdir()]
    texts += ["".join(rnd.choice(alphabet) for _ in range(rnd.randint(0, 40))) for _ in range(20000)]
    for text in texts:
        assert single_quoted(text) == single_quoted_by_char(text), repr(text)


def assert_quoted(script: str) -> int:
    """`script` parses, and every marker of a hostile value in it is inside single quotes; how many."""
    check = subprocess.run(["sh", "-n"], input=script, capture_output=True, text=True)
    assert check.returncode == 0, check.stderr + script
    quoted = single_quoted(script)
    found = 0
    for marker in MARKERS:
        start = script.find(marker)
        while start != -1:
            found += 1
            assert all(quoted[start:start + len(marker)]), f"unquoted at {start}: {script[max(0, start - 80):start + 40]!r}"
            start = script.find(marker, start + 1)
    return found


def no_injection(root: Path) -> None:
    assert not [p for p in root.rglob("PWN*")], "a hostile value was executed"


# -- the representative values have the callers' keys -------------------------------------------

def captured(monkeypatch, module, call) -> tuple[str, dict]:
    seen: dict = {}

    def capture(name, **context):
        seen.setdefault("name", name)
        seen.setdefault("context", context)
        return render.render_template(name, **context)

    monkeypatch.setattr(module, "render_template", capture)
    call()
    return seen["name"], seen["context"]


@pytest.mark.parametrize("module,call", [
    (ops, lambda: ops.fetch_source_command("https://x/a.tgz", "a" * 64, "/c/a.tgz")),
    (ops, lambda: ops.conftest_key_command("/a", "r", "gcc", "modules CC=gcc")),
    (ops, lambda: ops.build_command("/a", "1", "r", "gcc", 2, True, cxx="g++", signing=("/k", "/c"))),
    (ops, lambda: ops.install_command("1", "r")),
    (ops, lambda: ops.verify_command("1", ["r"], True, ["gsp.bin"])),
    (kernel, lambda: kernel.start_build_command("/b", True, 1024)),
    (rebind, lambda: gpus.rebind_script(RebindPlan([Move("0000:01:00.0", "nvidia", "vfio-pci")], [("lxc", 200)],
                                                   [], True), {"0000:01:00.0": {"minor": 0}}, "tx")),
    (kernel, lambda: kernel.build_script(KernelSpec(version="6.14.8-2-pve", source={
        "kind": "proxmox-git", "url": "git://x/pve-kernel.git", "ref": "ad58d1445425ea4742e3470b2edbee35df0657e9"}), "running", 2, "/b")),
    (kernel, lambda: kernel.gate_script(HostSpec(
        kernel={"version": "6.14.8-2-pve", "source": {"kind": "proxmox-git", "url": "git://x/pve-kernel.git", "ref": "ad58d1445425ea4742e3470b2edbee35df0657e9"}},
        nvidia={"version": "595.45.04", "modules_source": {"url": "https://x/a.tgz", "sha256": hashlib.sha256(b"a").hexdigest()}}),
        "/b", 2, "gcc-12", "g++-12")),
])
def test_examples_have_the_keys_the_operations_pass(monkeypatch, module, call):
    name, context = captured(monkeypatch, module, call)
    assert render.SHELL_EXAMPLES[name], name
    for example in render.SHELL_EXAMPLES[name]:
        assert set(example) == set(context), name


def test_every_shell_template_has_examples_and_they_render_clean():
    assert set(render.SHELL_EXAMPLES) == {p.name for p in render.TEMPLATES.glob("*.sh.j2")}
    assert render.check_shell() == []


def test_the_q_filter_is_shlex_quote_and_refuses_none():
    assert render.quote("a b'c") == "'a b'\"'\"'c'" and render.quote(3) == "3"
    with pytest.raises(ValueError):
        render.quote(None)


# -- every field of every template, rendered hostile, is quoted ----------------------------------

# Fields that are not values: a branch selector (share_by: who keeps a build), or shell code built (and quoted) by the caller
# (rebind.sh.j2's guest shutdown commands from operations.proxmox.shutdown_shell).
NOT_VALUES = ("kind", "base_config", "shell", "share_by")


def fields(name: str) -> list[tuple[int, str, object]]:
    """(example, field, hostile value) for every string field (and each item of list/tuple fields;
    in a list of records, each string field of its first record; in a list of pairs, each string)."""
    out: list[tuple[int, str, object]] = []
    for i, example in enumerate(render.SHELL_EXAMPLES[name]):
        for key, value in example.items():
            if isinstance(value, str) and key not in NOT_VALUES:
                out.append((i, key, hostile(key)))
            elif isinstance(value, list) and value and isinstance(value[0], dict):
                for sub, v in value[0].items():
                    if isinstance(v, str) and sub not in NOT_VALUES:
                        out.append((i, key, [{**value[0], sub: hostile(f"{key}.{sub}")}, *value[1:]]))
            elif isinstance(value, list) and value and isinstance(value[0], tuple):
                out.append((i, key, [tuple(hostile(f"{key}{n}") if isinstance(x, str) else x
                                           for n, x in enumerate(value[0])), *value[1:]]))
            elif isinstance(value, list | tuple) and value:
                out.append((i, key, type(value)(hostile(f"{key}{n}") for n in range(len(value)))))
    return out


@pytest.mark.parametrize("name", sorted(render.SHELL_EXAMPLES))
def test_each_field_rendered_hostile_stays_quoted(name):
    """Each field, in each example, hostile: quoted wherever it lands, and it lands somewhere."""
    reached: dict[str, int] = {}
    if not any(render.SHELL_EXAMPLES[name]):  # a template of no values (nvidia-first-error.sh.j2): nothing to quote
        return
    for i, key, value in fields(name):
        context = {**render.SHELL_EXAMPLES[name][i], key: value}
        reached[key] = reached.get(key, 0) + assert_quoted(render.render_template(name, **context))
    for key in UNREACHED.get(name, ()):
        assert reached.pop(key) == 0, f"{key} reaches {name} now: drop it from UNREACHED"
    assert reached and all(reached.values()), f"fields that never reach the script: {reached}"


# values of the NVIDIA build context whose branches a caller including nvidia-build.sh.j2 never takes:
# the driver x kernel gate builds unsigned and without the conftest cache (its key reads the
# installed headers' tree; the gate's are unpacked elsewhere)
# it shares no build (issue 41: the converge keeps its build with a share_key, the kernel hook with its own key)
UNREACHED = {"kernel-nvidia-gate.sh.j2": ("sig_hash", "conftest_cache_dir", "sign_file", "share_root")}


def test_kernel_base_config_path_stays_quoted():
    base = render.SHELL_EXAMPLES["kernel-build.sh.j2"][4]
    assert assert_quoted(render.render_template("kernel-build.sh.j2", **{**base, "base_config": "/" + hostile("base")}))


# -- the scripts run with hostile values: passed through literally --------------------------------

def sh(script: str, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(["sh", "-c", script], capture_output=True, text=True, errors="replace", cwd=cwd, env=env,
                          timeout=60)


def shown(value: str) -> str:
    """The part of `value` a message shows as is (dash's echo reads backslash escapes in messages)."""
    return value.split("\\")[0]


def test_fetch_takes_a_hostile_path_literally(tmp_path):
    src = tmp_path / spec_hostile("url")
    src.write_bytes(b"archive\n")
    good = hashlib.sha256(b"archive\n").hexdigest()
    dest = tmp_path / "cache" / spec_hostile("dest")
    bad = sh(ops.fetch_source_command(str(src), "0" * 64, str(dest)), tmp_path)
    assert bad.returncode == 1 and f"checksum mismatch for {shown(str(src))}" in bad.stderr
    ok = sh(ops.fetch_source_command(f"file://{src}", good, str(dest)), tmp_path)
    assert ok.returncode == 0, ok.stderr
    assert dest.read_bytes() == b"archive\n"
    no_injection(tmp_path)


def nvidia_kernel_archive(root: Path, monkeypatch, archive: Path | None = None) -> Path:
    """operations.nvidia's build and conftest cache dirs under `root`, and a tar of a one-Kbuild
    `nvidia-kernel/` source tree at `archive` (default: root/nvidia.tar)."""
    monkeypatch.setattr(ops, "BUILD_ROOT", str(root / "build"))
    monkeypatch.setattr(ops, "CONFTEST_CACHE", str(root / "conftest-cache"))
    tree = root / "tree/nvidia-kernel"
    tree.mkdir(parents=True)
    (tree / "Kbuild").write_text("obj-m += nvidia.o\n")
    archive = archive or root / "nvidia.tar"
    subprocess.run(["tar", "-C", str(root / "tree"), "-cf", str(archive), "nvidia-kernel"], check=True)
    return archive


def tools(tmp_path: Path) -> dict:
    """Stand-ins that write their arguments one per line (NUL-separated: values hold newlines)."""
    bindir = tmp_path / "tools"
    bindir.mkdir()
    log = tmp_path / "argv"
    scripts = {
        "make": 'cd "$2"; mkdir -p conftest; touch nvidia.ko\n',
        "modinfo": 'case "$*" in *vermagic*) printf "%s SMP\\n" "$REL";; *firmware*) ;; *) printf "%s\\n" "$VER";; esac\n',
        "strip": "",
        "sign-file": "",
        "depmod": "",
    }
    for tool, body in scripts.items():
        (bindir / tool).write_text(f'#!/bin/sh\nprintf "%s\\0" {tool} "$@" >> "$LOG"; printf "\\n\\0" >> "$LOG"\n{body}')
        (bindir / tool).chmod(0o755)
    return {**os.environ, "PATH": f"{bindir}:{os.environ['PATH']}", "LOG": str(log)}


def calls(tmp_path: Path) -> list[list[str]]:
    text = (tmp_path / "argv").read_text()
    return [[a for a in call.split("\0") if a] for call in text.split("\n\0") if call.strip("\0")]


def test_build_takes_hostile_values_literally(tmp_path, monkeypatch):
    """Archive path, version, release, compiler, signing key and cert all hostile at once: the build
    runs, `make` and sign-file get each one as one argument, nothing in them runs."""
    monkeypatch.setattr(ops, "CCACHE_DIR", str(tmp_path / "ccache"))
    archive = nvidia_kernel_archive(tmp_path, monkeypatch, tmp_path / spec_hostile("archive"))
    version, release, cc = spec_hostile("version"), spec_hostile("release"), spec_hostile("cc")
    key, cert = str(tmp_path / spec_hostile("key")), str(tmp_path / spec_hostile("cert"))
    Path(key).write_text("-----BEGIN PRIVATE KEY-----\n")
    Path(key).chmod(0o600)  # root's alone, as the build's key check wants (issue 39 item 4)
    env = {**tools(tmp_path), "REL": release, "VER": version}
    command = ops.build_command(str(archive), version, release, cc, 2, ccache=True, signing=(key, cert))
    modules = tmp_path / "lib/modules" / release / "build/scripts"
    modules.mkdir(parents=True)
    (modules / "sign-file").symlink_to(tmp_path / "tools/sign-file")
    command = command.replace("/lib/modules", str(tmp_path / "lib/modules"))
    done = sh(command, tmp_path, env)
    assert done.returncode == 0, done.stderr
    made = [c for c in calls(tmp_path) if c[0] == "make"]
    assert made and made[0][4:] == ["modules", f"KERNEL_UNAME={release}", f"CC={cc}"]
    signed = [c for c in calls(tmp_path) if c[0] == "sign-file"]
    assert signed and signed[0][1:4] == ["sha256", key, cert]
    assert f"pvegpu: building nvidia {shown(version)}" in done.stdout
    assert (tmp_path / "build" / version / release / "out" / "nvidia.ko").exists()
    assert len(list((tmp_path / "conftest-cache").glob("*.tgz"))) == 1, "the conftest key ran"
    no_injection(tmp_path)


def test_a_failed_build_says_it_failed_and_that_nothing_was_installed(tmp_path, monkeypatch):
    """The stage's and the kernel hook's build (one template, the release in $R): when make fails,
    the message names version and release and says the build failed (the e2e faults test reads it)."""
    archive = nvidia_kernel_archive(tmp_path, monkeypatch)
    env = tools(tmp_path)
    (tmp_path / "tools/make").write_text("#!/bin/sh\necho 'second.c:1: error: expected expression'\nexit 2\n")
    command = ops.build_command(str(archive), "595.71.05", "6.12.118+deb12-amd64", "gcc-12", 2, ccache=False)
    done = sh(command, tmp_path, env)
    assert done.returncode != 0
    assert ("pvegpu: building nvidia 595.71.05 for 6.12.118+deb12-amd64 failed; installed modules are untouched"
            in done.stderr), done.stderr


def test_install_and_verify_take_hostile_values_literally(tmp_path):
    release, version = spec_hostile("release"), spec_hostile("version")
    parent = tmp_path / spec_hostile("build")
    build, dest = parent / release, tmp_path / "modules" / release / "pvegpu"
    (build / "out").mkdir(parents=True)
    (build / "out" / "nvidia.ko").write_text("ko")
    env = {**tools(tmp_path), "VER": "535.1"}
    done = sh(render.render_template("nvidia-install.sh.j2", release=release, build_parent=str(parent),
                                     modules_dir=str(tmp_path / "modules"), module_subdir="pvegpu"), tmp_path, env)
    assert done.returncode == 0, done.stderr
    assert (dest / "nvidia.ko").read_text() == "ko" and not build.exists()
    assert not (tmp_path / "argv").exists()  # no tool ran: depmod is the handler's (operations.handlers)
    bad = sh(ops.verify_command(version, [release], firmware=True, firmware_files=[spec_hostile("fw")]), tmp_path, env)
    assert bad.returncode == 1
    assert f"pvegpu: kernel {shown(release)}" in bad.stderr and "nvidia module is '535.1', want " in bad.stderr
    assert f"pvegpu: GSP firmware {shown(version)}" in bad.stderr
    good = sh(ops.verify_command("535.1", [release], firmware=False), tmp_path, env)
    assert good.returncode == 0, good.stderr
    no_injection(tmp_path)


def test_conftest_key_takes_hostile_values_literally(tmp_path):
    archive = tmp_path / spec_hostile("archive")
    archive.write_text("tree")
    out = sh(ops.conftest_key_command(str(archive), spec_hostile("release"), spec_hostile("cc"), spec_hostile("make_args"),
                                      modules_dir=str(tmp_path / spec_hostile("modules"))), tmp_path)
    assert out.returncode == 0 and len(out.stdout.strip()) == 64
    no_injection(tmp_path)


def test_kernel_build_start_takes_a_hostile_dir_literally(tmp_path):
    d = tmp_path / spec_hostile("build_dir")
    d.mkdir()
    (d / "build.sh").write_text('echo started > "$(dirname "$0")/ran"\n')
    done = sh(kernel.start_build_command(str(d), systemd=False), tmp_path)
    assert done.returncode == 0, done.stderr
    for _ in range(50):
        if (d / "ran").exists():
            break
        subprocess.run(["sleep", "0.1"])
    assert (d / "ran").read_text() == "started\n"
    no_injection(tmp_path)


def test_kernel_tarball_build_takes_hostile_values_literally(tmp_path):
    """A tarball build of a local source with a hostile name, the wrong sha256: the script copies
    the file by its literal name and stops at the checksum."""
    d = tmp_path / spec_hostile("build_dir")
    d.mkdir()
    src = tmp_path / spec_hostile("url")
    src.write_text("not the kernel")
    k = KernelSpec(version="6.1.192-x", source={"kind": "tarball", "url": f"file://{src}", "sha256": "0" * 64},
                   config_fragments=["CONFIG_VFIO=m"], ccache=False)
    (d / "build.sh").write_text(kernel.build_script(k, "running", 2, str(d)))
    done = subprocess.run(["sh", str(d / "build.sh")], capture_output=True, text=True, cwd=tmp_path, timeout=60)
    assert done.returncode != 0
    assert (d / "build.rc").read_text().strip() == str(done.returncode)
    log = (d / "build.log").read_text()
    assert "source.tar.part: FAILED" in log and (d / "source.tar.part").read_text() == "not the kernel"
    no_injection(tmp_path)
