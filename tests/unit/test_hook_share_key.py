"""The kernel hook's build key is the converge's (issue 41: "the next converge notices the hook
already built the same key elsewhere and does not build it again").

The hook (templates/kernel-postinst-nvidia.sh.j2, with templates/nvidia-share-key.sh.j2) is rendered
as operations/kernel_hook.py renders it, and its key computation is run in a shell against fixture
inputs: a compiler directory with `--version` banners, a kernel build tree with its
CONFIG_CC_VERSION_TEXT, dpkg-query's and uname's answers. The same inputs go through the facts'
parsers (facts/nvidia.py parse_host_state, facts/build_share.py parse_share_state) into
plan.build_share.build_inputs and build_key: the two keys and the two inputs texts are equal, or
both sides have none.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from facts.build_share import parse_share_state
from facts.nvidia import parse_host_state
from facts.sections import SECTION
from plan import build_share as shplan
from plan import render

VERSION, SHA = "595.45.04", "ab" * 32
RELEASE = "6.1.0-57-amd64"


def hook_text(tmp: Path, need_cxx: bool) -> str:
    example = render.SHELL_EXAMPLES["kernel-postinst-nvidia.sh.j2"][1 if need_cxx else 0]
    return render.render_template("kernel-postinst-nvidia.sh.j2", **{
        **example, "version": VERSION, "sha256": SHA, "need_cxx": need_cxx,
        "modules_dir": str(tmp / "lib/modules"), "compiler_dir": str(tmp / "usr/bin"),
        "key_parts": shplan.hook_key_parts(VERSION, SHA, need_cxx)})


def key_functions(hook: str) -> str:
    """The hook's key computation: from its JSON escaper to the end of share_inputs."""
    start = hook.index("share_js() {")
    start = hook.rindex("\n# ", 0, start) + 1
    end = hook.index("\n}\n", hook.index('SHARE_KEY=$(printf')) + 3
    return hook[start:end]


def write_exe(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(0o755)


def fixture(tmp: Path, banners: dict[str, str], cc_text: str | None, dpkg: list[str], machine: str = "x86_64",
            config_file: str = "include/config/auto.conf") -> None:
    for program, banner in banners.items():
        write_exe(tmp / "usr/bin" / program, "#!/bin/sh\n[ \"$1\" = --version ] || exit 2\n"
                  f"cat <<'EOF'\n{banner}\nCopyright (C) 2022 Free Software Foundation, Inc.\nEOF\n")
    build = tmp / "lib/modules" / RELEASE / "build"
    (build / "include/config").mkdir(parents=True, exist_ok=True)
    (build / "Makefile").write_text("")
    if cc_text is not None:
        (build / config_file).write_text(f"CONFIG_CC_IS_GCC=y\nCONFIG_CC_VERSION_TEXT={cc_text}\n", encoding="utf-8")
    (tmp / "dpkg.txt").write_text("".join(f"{line}\n" for line in dpkg))
    # dpkg-query -W -f=... NAME...: the fixture's lines of the names asked
    write_exe(tmp / "bin/dpkg-query", "#!/bin/sh\nshift 2\nfor n in \"$@\"; do\n"
              f"  awk -v n=\"$n\" '$2 == n' {tmp}/dpkg.txt\ndone\n")
    write_exe(tmp / "bin/uname", f"#!/bin/sh\necho {machine}\n")


def hook_key(tmp: Path, cc: str, cxx: str | None) -> tuple[str, str] | None:
    script = (key_functions(hook_text(tmp, cxx is not None)) + f"R={RELEASE}\nCC={cc}\nCXX={cxx or ''}\n"
              "share_inputs || exit 1\nprintf '%s\\n%s\\n' \"$SHARE_KEY\" \"$SHARE_INPUTS\"\n")
    done = subprocess.run(["sh", "-c", script], capture_output=True, env={"PATH": f"{tmp}/bin:/usr/bin:/bin"},
                          timeout=60)
    if done.returncode:
        return None
    key, inputs = done.stdout.decode().splitlines()
    return key, inputs


def plan_key(tmp: Path, cc: str, cxx: str | None) -> tuple[str, str] | None:
    """The converge's key of the same host: the facts' readings of it, as their parsers take them."""
    banners = [f"{p.name}: {p.read_text().splitlines()[3]}" for p in sorted((tmp / "usr/bin").iterdir())]
    build = tmp / "lib/modules" / RELEASE / "build"
    conf = next((line for f in ("include/config/auto.conf", ".config") if (build / f).exists()
                 for line in (build / f).read_text().splitlines() if line.startswith("CONFIG_CC_VERSION_TEXT=")), None)
    nv_state = parse_host_state([f"{SECTION}compilers", *banners, f"{SECTION}release {RELEASE}", "headers: yes",
                                 *([conf] if conf else [])])
    installed = [" ".join(line.split()[1:3]) for line in (tmp / "dpkg.txt").read_text().splitlines()
                 if line.split()[0][1:2] == "i"]
    share_state = parse_share_state([f"{SECTION}machine", (tmp / "bin/uname").read_text().split()[-1],
                                     f"{SECTION}headers", *installed])
    inputs, _ = shplan.build_inputs(VERSION, SHA, RELEASE, nv_state, share_state, {"cc": cc, "cxx": cxx})
    return (shplan.build_key(inputs), shplan.inputs_text(inputs)) if inputs else None


GCC = "gcc-12 (Debian 12.2.0-14) 12.2.0"
CASES: dict[str, dict] = {
    "debian-headers": dict(banners={"gcc-12": GCC}, cc_text='"gcc-12 (Debian 12.2.0-14) 12.2.0"',
                           dpkg=[f"ii  linux-headers-{RELEASE} 6.1.158-1"], cc="gcc-12", cxx=None),
    "open-tree-proxmox-headers-dotconfig": dict(
        banners={"gcc-12": GCC, "g++-12": "g++-12 (Debian 12.2.0-14) 12.2.0"},
        cc_text=' "gcc-12 (Debian 12.2.0-14) 12.2.0" ', config_file=".config",
        dpkg=[f"ii  proxmox-headers-{RELEASE} 6.1.158-1~bpo12+1", f"rc  linux-headers-{RELEASE} 6.1.100-1"],
        cc="gcc-12", cxx="g++-12"),
    "non-ascii-banner": dict(
        banners={"gcc": "gcc (Débian «12.2.0-14» \"q\" \\ \t 😀 \x7f) 12.2.0"},
        cc_text="gcc (Débian «12.2.0-14» \"q\" \\ \t 😀 \x7f) 12.2.0",
        dpkg=[f"ii  linux-headers-{RELEASE} 6.1.158-1"], cc="gcc", cxx=None, machine="aarch64"),
    "no-headers-package": dict(banners={"gcc-12": GCC}, cc_text=GCC, dpkg=[], cc="gcc-12", cxx=None),
    "headers-removed-config-kept": dict(banners={"gcc-12": GCC}, cc_text=GCC,
                                        dpkg=[f"rc  linux-headers-{RELEASE} 6.1.158-1"], cc="gcc-12", cxx=None),
    "no-cxx-banner": dict(banners={"gcc-12": GCC}, cc_text=GCC, dpkg=[f"ii  linux-headers-{RELEASE} 6.1.158-1"],
                          cc="gcc-12", cxx="g++-12"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_hook_computes_the_converge_s_key(tmp_path, case):
    args = dict(CASES[case])
    cc, cxx = args.pop("cc"), args.pop("cxx")
    fixture(tmp_path, **args)
    hook, plan = hook_key(tmp_path, cc, cxx), plan_key(tmp_path, cc, cxx)
    assert hook == plan
    if case in ("no-headers-package", "headers-removed-config-kept", "no-cxx-banner"):
        assert plan is None
    else:
        assert plan is not None and plan[1].isascii()


def test_the_key_s_parts_are_build_inputs_own():
    """The hook's static text is plan's JSON of those inputs: version and source sha256 in it, each
    value the hook reads named once in its place."""
    parts = shplan.hook_key_parts(VERSION, SHA, True)
    text = "".join(p for kind, p in parts if kind == "text")
    assert f'"source_sha256":"{SHA}","version":"{VERSION}"}}' in text and '; strip --strip-debug"' in text
    assert {p for kind, p in parts if kind == "var"} == set(shplan.HOOK_KEY_VARS)
    assert not any(kind == "var" and p.startswith("cxx") for kind, p in shplan.hook_key_parts(VERSION, SHA, False))


def test_the_shell_examples_key_parts_are_plan_s():
    """plan/render.py spells the hook's example key_parts out (it imports no plan module): they are
    hook_key_parts' own."""
    example = render.SHELL_EXAMPLES["nvidia-share-key.sh.j2"][0]["key_parts"]
    assert example == shplan.hook_key_parts("595.45.04", "a" * 64, False)
