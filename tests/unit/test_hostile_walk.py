"""Issue 31: the hostile-value walk. Thousands of generated values per field class are loaded
the way the CLI loads them (a YAML file through `spec.load.load_spec_file`'s two halves,
`_read_yaml` then `validate_spec`, as `inventory_hosts` does); each is refused with a sentence naming its host and field, or it is
accepted and then rendered by the real builders into every command and file it reaches, and
the rendered shell runs under `sh` with logging stand-ins for git, cp, curl, make … on PATH
(no real git or cp): each value arrives as exactly one argument, after the end of options
where the command takes one, and nothing in it runs. Where a value lands in a file another
program parses (the GRUB drop-in, /etc/kernel/cmdline, proxmoxer's URL), that program's
reading of it is modelled from its source and must give the value back.

The values are a base value of each field with one or two hostile fragments put before, in
or after it (shell and config metacharacters, quotes, line separators, NUL and control
characters, leading dashes, path tricks, IPv6 zone ids, long runs). Loading is batched: one
file holds a few hundred hosts, one value each; a file the YAML layer refuses as a whole is
loaded value by value. Running is batched too: one `sh` runs every accepted value's script of
a field, each with its own stand-in log; the values run are the accepted ones with distinct
character shapes (which characters, where), up to RUN_MAX per field.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import shlex
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import yaml

from facts import kernel as kernel_facts
from facts.nvidia import SOURCE_CACHE
from operations import kernel as kernel_ops
from operations import nvidia as nvidia_ops
from plan import boot as boot_plan
from plan import kernel as kernel_plan
from plan.render import operands, render_template
from spec.load import SpecError, _read_yaml, validate_spec
from spec.models import HostSpec, KernelSpec, NvidiaSpec, SourceSpec

FRAGMENTS = [
    ";", "&", "|", "<", ">", "$", "$(touch PWNa)", "`touch PWNb`", "'", '"', "\\", "{", "}", "#", " ", "\t", "\n",
    "\r", "\x00", "\x07", "\x0b", "\x1b", "\x7f", "\x85", "\u2028", "\ud800", "-", "--", "-o", "--upload-pack=x",
    "..", "../", "/", "//", "%", "%25", "%x]@evil.example:443#", "]", "[", "@", "@{", ":", "~", "^", "*", "?",
    "!", "=", ",", ".lock", "é", "\u00a0", "\u0120", "x" * 70, "y" * 300,  # U+0120: UTF-8 C4 A0, a kernel space byte
]
VALUES_PER_FIELD = 2000
RUN_MAX = 60
STANDINS = ("git", "cp", "curl", "wget", "make", "sha256sum", "xz", "tar", "mv")
STANDIN = r"""#!/bin/sh
# a logging stand-in: its name, its argument count, then each argument, NUL-terminated
# (one file per process: stand-ins in a pipeline run at the same time)
{ printf '%s\0' "${0##*/}" "$#"; for a in "$@"; do printf '%s\0' "$a"; done; } >> "$PVEGPU_STANDIN_LOG.$$"
case "${0##*/}" in
  git) [ "$1" = clone ] && { for last in "$@"; do :; done; mkdir -p "$last/.git"; }
       [ "$3" = config ] && cat "$PVEGPU_STANDIN_DIR/remote-url" ;;
  sha256sum) for a in "$@"; do [ "$a" = --status ] && exit 1; done ;;  # nothing is cached yet
esac
exit 0
"""



# digests that look like real ones (placeholders such as "c" * 64 are refused at load)
KERNEL_SHA = "257089c6a8a5623bf34734d59210d322076d3a0cbe69c7c0da6a5348ebb45762"
INSTALLER_SHA = "7b082bd9790d3fa9dbe3e814d0b3d1186576002c9ddb66e18d10bf641eda7adb"

def kernel_of(spec: HostSpec) -> KernelSpec:
    assert spec.kernel is not None
    return spec.kernel


def nvidia_of(spec: HostSpec) -> NvidiaSpec:
    assert spec.nvidia is not None
    return spec.nvidia


def installer_of(spec: HostSpec) -> SourceSpec:
    installer = nvidia_of(spec).installer
    assert installer is not None
    return installer

def generate(bases: list[str], count: int = VALUES_PER_FIELD) -> list[str]:
    """Each base alone, with each fragment before, inside and after it, then with pairs of
    fragments (one before or inside, one after), in a fixed order, up to `count` values."""
    out: dict[str, None] = dict.fromkeys(bases)
    for frag, base in itertools.product(FRAGMENTS, bases):
        mid = len(base) // 2
        out.update(dict.fromkeys([frag + base, base[:mid] + frag + base[mid:], base + frag, frag]))
    for (a, b), base in itertools.product(itertools.product(FRAGMENTS, FRAGMENTS), bases):
        if len(out) >= count:
            break
        mid = len(base) // 2
        out.update(dict.fromkeys([a + base + b, base[:mid] + a + base[mid:] + b]))
    return list(out)[:count]


# ------------------------------------------------------------------ loading as the CLI does

def load_values(tmp: Path, field: str, values: list, make_host) -> tuple[dict[int, HostSpec], int]:
    """{index: HostSpec} of the accepted values, and how many were refused; a refusal must be a
    SpecError whose message names the value's host and the field."""
    accepted: dict[int, HostSpec] = {}
    refused = 0
    # a value no UTF-8 text can hold (a lone surrogate) fails its whole file at the YAML layer
    # (written as an escape, spec.load refuses it there): those go one per file
    alone = [i for i, v in enumerate(values) if not _utf8(v)]
    together = [i for i in range(len(values)) if i not in set(alone)]
    batches = [together[k:k + 400] for k in range(0, len(together), 400)] + [[i] for i in alone]
    for indexes in batches:
        batch = {i: values[i] for i in indexes}
        data, problems = _load(tmp, {f"h{i}": make_host(v) for i, v in batch.items()})
        if problems is None:  # refused at the YAML layer (a lone value here)
            refused += len(batch)
            continue
        bad = {host for host, _, _ in problems}
        for host, path, _ in problems:
            assert path.startswith(f"hosts.{host}.{field}"), f"{field}: the refusal names {path}"
        refused += len(bad)
        good = {i for i in batch if f"h{i}" not in bad}
        if good:  # the accepted hosts, validated again without the refused ones (load_spec_file's second half)
            specs = validate_spec({"hosts": {f"h{i}": data["hosts"][f"h{i}"] for i in good}}, tmp / "walk.yml")
            accepted.update({i: specs[f"h{i}"] for i in good})
    return accepted, refused


def _utf8(value: object) -> bool:
    try:
        str(value).encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


def _load(tmp: Path, hosts: dict) -> tuple[dict, list | None]:
    """load_spec_file in its two halves (the parsed YAML is kept to validate the accepted hosts
    again): (the parsed data, the problems: empty when all were accepted, None when a problem
    is not a host's, i.e. the YAML layer refused the file)."""
    f = tmp / "walk.yml"
    f.write_text(yaml.safe_dump({"hosts": hosts}))  # escapes NUL, controls, lone surrogates
    data: dict = {}
    try:  # what load_spec_file does; any exception but SpecError fails the test here
        data = _read_yaml(f)
        validate_spec(data, f)
    except SpecError as exc:
        assert str(f) in str(exc) and "Traceback" not in str(exc)
        if any(host is None for host, _, _ in exc.problems):
            return data, None
        return data, exc.problems
    return data, []


# ------------------------------------------------------------------ running with stand-ins

def traits(value: str) -> set[str]:
    """What the shell (or a parser) can tell apart: each odd character, what it starts and ends
    with, and whether it is long."""
    odd = {f"has {c!r}" for c in value if not c.isalnum()}
    return odd | {f"starts {value[:1] if not value[:1].isalnum() else 'alnum'}",
                  f"ends {value[-1:] if not value[-1:].isalnum() else 'alnum'}", f"long {len(value) > 100}"}


def to_run(accepted: dict[int, HostSpec], value_of) -> dict[int, HostSpec]:
    """The accepted values that together show every trait any accepted value has (greedy, in
    the order generated), at most RUN_MAX of them."""
    left = {i: traits(value_of(spec)) for i, spec in accepted.items()}
    missing = set().union(*left.values()) if left else set()
    chosen: list[int] = []
    while missing and len(chosen) < RUN_MAX:
        best = max(left, key=lambda i: len(left[i] & missing))
        chosen.append(best)
        missing -= left.pop(best)
    return {i: accepted[i] for i in sorted(chosen)}


def run_scripts(tmp: Path, scripts: dict[int, tuple[str, Path]], remote_url: dict[int, str] | None = None) -> dict[int, list]:
    """Run each (script, cwd) under sh with the stand-ins; {index: [(command, [args])]}."""
    bin_dir = tmp / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name in STANDINS:
        (bin_dir / name).write_text(STANDIN)
        (bin_dir / name).chmod(0o755)
    driver = []
    for i, (script, cwd) in scripts.items():
        cwd.mkdir(parents=True, exist_ok=True)
        (tmp / f"s{i}.sh").write_text(script)
        d = tmp / f"d{i}"
        d.mkdir(exist_ok=True)
        (d / "remote-url").write_text((remote_url or {}).get(i, "") + "\n")
        driver.append(f"(cd {shlex.quote(str(cwd))} && PVEGPU_STANDIN_LOG={shlex.quote(str(tmp / f'log{i}'))} "
                      f"PVEGPU_STANDIN_DIR={shlex.quote(str(d))} sh {shlex.quote(str(tmp / f's{i}.sh'))}) "
                      ">/dev/null 2>&1 || true")
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    subprocess.run(["sh", "-c", "\n".join(driver)], env=env, check=True, timeout=120)
    assert not list(tmp.rglob("PWN*")), "a value was run as a command"
    return {i: parse_log(tmp / f"log{i}") for i in scripts}


def parse_log(path: Path) -> list[tuple[str, list[str]]]:
    fields = []
    for one in sorted(path.parent.glob(path.name + ".*"), key=lambda p: int(p.suffix[1:])):
        fields += one.read_bytes().split(b"\0")[:-1]
    calls, k = [], 0
    while k < len(fields):
        name, n = fields[k].decode(), int(fields[k + 1])
        calls.append((name, [f.decode("utf-8", "surrogateescape") for f in fields[k + 2:k + 2 + n]]))
        k += 2 + n
    return calls


def calls_of(calls: list, name: str, first: str | None = None) -> list[list[str]]:
    return [args for cmd, args in calls if cmd == name and (first is None or first in args)]


# ------------------------------------------------------------------ the consumers' readings

# follows grub-core/script/yylex.l: a word's characters are its CHAR class (not {}|&$;<>, blanks,
# newline, quotes or backslash); a '#' that starts a word starts a comment
GRUB_CHAR = re.compile(r"^[^{}|&$;<> \t\n'\"\\]+$")


def grub_linux_words(args: str) -> list[str]:
    """The words GRUB's lexer makes of util/grub.d/10_linux.in's `linux … ro ${args}` line
    (args written unquoted); fails when a word is anything but plain characters."""
    words = [w for w in re.split(r"[ \t]+", args) if w]
    for w in words:
        assert GRUB_CHAR.match(w) and not w.startswith("#") and w not in ("{", "}", "[[", "]]"), w
    return words


def kernel_words(line: str) -> list[str]:
    """linux lib/cmdline.c next_arg(): whitespace splits, '"' quotes; kernel/params.c
    parse_args() stops at a lone '--'. Fails on a quote or a '--' (the word would not arrive)."""
    words = line.split()
    assert not any('"' in w for w in words) and "--" not in words, line
    return words


# ------------------------------------------------------------------ the fields

def kernel_host(**source) -> dict:
    return {"kernel": {"version": "6.14.11-4-pve",
                       "source": {"kind": "proxmox-git", "url": "git://git.proxmox.com/git/pve-kernel.git",
                                  "ref": "ad58d1445425ea4742e3470b2edbee35df0657e9", **source}}}


def test_walk_kernel_source_ref(tmp_path):
    # issue 39 item 3: only a full commit id is accepted; tags stay among the bases, all refused
    values = generate(["v6.14.11-4", "refs/tags/v6.14.11-4", "a" * 40, "ad58d1445425ea4742e3470b2edbee35df0657e9"])
    accepted, refused = load_values(tmp_path, "kernel.source.ref", values, lambda v: kernel_host(ref=v))
    assert len(values) >= 1500 and refused and accepted
    run = to_run(accepted, lambda s: kernel_of(s).source.ref)
    scripts = {i: (kernel_ops.build_script(kernel_of(s), "running", 2, str(tmp_path / f"b{i}")), tmp_path / f"b{i}")
               for i, s in run.items()}
    logs = run_scripts(tmp_path, scripts)
    for i, spec in run.items():
        ref = kernel_of(spec).source.ref
        assert calls_of(logs[i], "git", "checkout") == [["checkout", "--force", ref, "--"]], (ref, logs[i])
    facts_run(tmp_path / "facts", run)


def test_walk_kernel_source_url(tmp_path):
    values = generate(["git://git.proxmox.com/git/pve-kernel.git", "https://git.example:8443/a/b.git",
                       "/srv/pve-kernel", "file:///srv/pve-kernel", "ssh://git@git.example/p.git"])
    accepted, refused = load_values(tmp_path, "kernel.source.url", values, lambda v: kernel_host(url=v))
    assert len(values) >= 1500 and refused and accepted
    run = to_run(accepted, lambda s: kernel_of(s).source.url)
    scripts = {i: (kernel_ops.build_script(kernel_of(s), "running", 2, str(tmp_path / f"b{i}")), tmp_path / f"b{i}")
               for i, s in run.items()}
    logs = run_scripts(tmp_path, scripts)
    for i, spec in run.items():
        assert calls_of(logs[i], "git", "clone") == [["clone", "--", kernel_of(spec).source.url, "src"]], logs[i]
    facts_run(tmp_path / "facts", run)


def facts_run(tmp: Path, run: dict[int, HostSpec]) -> None:
    """facts/kernel.py source_makefile_command: the clone's remote URL compares equal to the
    spec's (one literal word), then cat-file and show get the ref after --end-of-options."""
    tmp.mkdir()
    scripts, urls = {}, {}
    for i, spec in run.items():
        root = tmp / f"r{i}"
        (root / "x" / "src" / ".git").mkdir(parents=True)
        src = kernel_of(spec).source
        scripts[i] = (kernel_facts.source_makefile_command(src.url, src.ref or "").replace(
            kernel_plan.BUILD_ROOT, str(root)), root)
        urls[i] = src.url
    logs = run_scripts(tmp, scripts, urls)
    for i, spec in run.items():
        wanted = f"{kernel_of(spec).source.ref}:Makefile"
        assert [a[2:] for a in calls_of(logs[i], "git", "cat-file")] == [["cat-file", "-e", "--end-of-options", wanted]]
        assert [a[2:] for a in calls_of(logs[i], "git", "show")] == [["show", "--end-of-options", wanted]]


def test_walk_kernel_tarball_url_and_base_config(tmp_path):
    values = generate(["/srv/linux.tar.xz", "file:///srv/linux.tar.xz", "https://cdn.example/v6.x/linux-6.1.tar.xz"])

    def host(v: str) -> dict:
        h = kernel_host(kind="tarball", url=v, sha256=KERNEL_SHA)
        h["kernel"]["source"].pop("ref")
        h["kernel"]["base_config"] = "/root/" + v.rsplit("/", 1)[-1] if "/" in v else v
        return h

    accepted, refused = load_values(tmp_path, "kernel", values, host)
    assert len(values) >= 1500 and refused and accepted
    run = to_run(accepted, lambda s: kernel_of(s).source.url + kernel_of(s).base_config)
    scripts = {i: (kernel_ops.build_script(kernel_of(s), kernel_of(s).base_config, 2, str(tmp_path / f"b{i}")),
                   tmp_path / f"b{i}") for i, s in run.items()}
    logs = run_scripts(tmp_path, scripts)
    for i, spec in run.items():
        url, base = kernel_of(spec).source.url, kernel_of(spec).base_config
        if url.startswith(("http://", "https://")):
            assert calls_of(logs[i], "curl") == [["-fL", "--retry", "3", "-o", "source.tar.part", url]], logs[i]
        else:
            assert ["--", url.removeprefix("file://"), "source.tar.part"] in calls_of(logs[i], "cp"), logs[i]
        assert ["--", base, ".config"] in calls_of(logs[i], "cp"), logs[i]


def test_walk_kernel_version(tmp_path):
    values = generate(["6.14.11-4-pve", "6.1.192-pvegpu+ci~1", "6.12.118+deb12-amd64"])
    accepted, refused = load_values(tmp_path, "kernel.version", values, lambda v: {
        **kernel_host(kind="tarball", url="/srv/l.tar.xz", sha256=KERNEL_SHA), "kernel": {
            "version": v, "base_config": "tinyconfig",
            "source": {"kind": "tarball", "url": "/srv/l.tar.xz", "sha256": KERNEL_SHA}}})
    assert len(values) >= 1500 and refused and accepted
    for spec in accepted.values():  # the build directory: one file name, within NAME_MAX
        name = kernel_plan.build_dir(kernel_of(spec), "tinyconfig").removeprefix(kernel_plan.BUILD_ROOT + "/")
        assert "/" not in name and len(name.encode()) <= 255
    run = to_run(accepted, lambda s: kernel_of(s).version)
    scripts = {i: (kernel_ops.build_script(kernel_of(s), "tinyconfig", 2, str(tmp_path / f"b{i}")), tmp_path / f"b{i}")
               for i, s in run.items()}
    logs = run_scripts(tmp_path, scripts)
    for i, spec in run.items():
        lv = kernel_plan.localversion(kernel_of(spec))
        assert ["-s", f"LOCALVERSION={lv}", "kernelrelease"] in calls_of(logs[i], "make"), logs[i]


def test_walk_nvidia_source_url(tmp_path):
    values = generate(["https://us.download.nvidia.com/XFree86/Linux-x86_64/595.71.05/NVIDIA-Linux-x86_64-595.71.05.run",
                       "/opt/nvidia/NVIDIA-Linux-x86_64-595.71.05.run", "file:///opt/nvidia/x.run"])
    accepted, refused = load_values(tmp_path, "nvidia.installer.url", values, lambda v: {
        "nvidia": {"version": "595.71.05", "installer": {"url": v, "sha256": INSTALLER_SHA}}})
    assert len(values) >= 1500 and refused and accepted
    from operations import containers as ct_ops

    with one_word_each() as check:
        for spec in accepted.values():  # the cached file (and its .part) is one file name within NAME_MAX
            cached = nvidia_ops.cached_source(installer_of(spec))
            assert len((cached.rsplit("/", 1)[-1] + ".part").encode()) <= 255
            # the host's installer commands and the CT install take the cached path (and the URL) as one word
            for script in (nvidia_ops.installer_version_command(cached, "595.71.05"), nvidia_ops.userspace_command(cached),
                           ct_ops.install_command(200, "595.71.05", installer_of(spec).url, INSTALLER_SHA, cached, True)):
                check(script, [cached, installer_of(spec).url])
            assert nvidia_ops.userspace_command(cached).startswith(f"sh -- {shlex.quote(cached)} ")
    run = to_run(accepted, lambda s: installer_of(s).url)
    scripts = {}
    for i, spec in run.items():
        src = installer_of(spec)
        dest = nvidia_ops.cached_source(src).replace(SOURCE_CACHE, str(tmp_path / f"c{i}"))
        scripts[i] = (nvidia_ops.fetch_source_command(src.url, src.sha256, dest), tmp_path / f"b{i}")
    logs = run_scripts(tmp_path, scripts)
    for i, spec in run.items():
        url = installer_of(spec).url
        dest = nvidia_ops.cached_source(installer_of(spec)).replace(SOURCE_CACHE, str(tmp_path / f"c{i}"))
        if url.startswith(("http://", "https://")):
            assert calls_of(logs[i], "curl") == [["-fsSL", "--retry", "3", "-o", dest + ".part", url]], logs[i]
        else:
            assert calls_of(logs[i], "cp") == [["-f", "--", url.removeprefix("file://"), dest + ".part"]], logs[i]


def test_walk_kernel_cmdline_words(tmp_path):
    values = generate(["pci=realloc", "vfio-pci.ids=10de:2204,10de:1aef", "console=ttyS0,115200n8"])
    accepted, refused = load_values(tmp_path, "iommu.params", values, lambda v: {
        "iommu": {"vendor": "amd", "params": ["pcie_aspm=off", v]}})
    assert len(values) >= 1500 and refused and accepted
    grub_files = [("/etc/default/grub", ['GRUB_CMDLINE_LINUX_DEFAULT="quiet"', 'GRUB_CMDLINE_LINUX=""'])]
    dropins = {}
    for i, spec in accepted.items():
        desired = boot_plan.desired_params(spec, None)
        # /etc/kernel/cmdline (systemd-boot): the kernel reads the file's words
        content = render_template("kernel-cmdline.j2", cmdline=boot_plan.merge_cmdline("root=ZFS=rpool/ROOT/pve-1 boot=zfs",
                                                                                          desired, spec))
        assert kernel_words(content)[2:] == desired
        # GRUB: the drop-in grub-mkconfig sources, then 10_linux's unquoted `linux … ro ${args}`
        values_ = boot_plan.grub_dropin_values(grub_files, desired, spec)
        dropins[i] = (render_template("grub-pvegpu.cfg.j2", values={k: boot_plan.sh_double_quoted(v)
                                                                     for k, v in values_.items()}), desired)
    script = []
    for i, (content, _) in dropins.items():
        (tmp_path / f"g{i}.cfg").write_text(content)
        script.append(f'(GRUB_CMDLINE_LINUX=""; . {shlex.quote(str(tmp_path / f"g{i}.cfg"))}; '
                      f'printf "%s\\0" "$GRUB_CMDLINE_LINUX $GRUB_CMDLINE_LINUX_DEFAULT")')
    out = subprocess.run(["sh", "-c", "\n".join(script)], capture_output=True, check=True, cwd=tmp_path,
                         timeout=120).stdout.decode().split("\0")[:-1]
    assert not list(tmp_path.rglob("PWN*"))
    for (_content, desired), args in zip(dropins.values(), out, strict=True):
        words = grub_linux_words(f"/vmlinuz-6.14.11-4-pve root=/dev/sda1 ro {args}")[3:]
        assert kernel_words(" ".join(words)) == ["quiet", *desired]


# linux lib/ctype.c: isspace() is true for ' ', \t \n \v \f \r and byte 0xA0 (Latin-1 NBSP), which
# also occurs inside UTF-8 sequences
KERNEL_SPACE = frozenset(b" \t\n\v\f\r\xa0")


def module_options(text: str) -> list[tuple[str, str | None]]:
    """The (param, value) pairs the kernel's module loader gets from a modprobe.d `options` line:
    kmod (libkmod-config.c) takes what follows `options <module>` as one string (a '#' comments
    only at a line's start), the kernel splits its bytes with lib/cmdline.c next_arg():
    isspace() outside double quotes, quotes around a value dropped."""
    out: list[tuple[str, str | None]] = []
    for line in text.splitlines():
        if not line.startswith("options nvidia "):
            continue
        rest = line[len("options nvidia "):].encode()
        while rest and rest[0] in KERNEL_SPACE:
            rest = rest[1:]
        while rest:
            i, in_quote, equals = 0, False, -1
            while i < len(rest) and (in_quote or rest[i] not in KERNEL_SPACE):
                if equals < 0 and rest[i] == ord("="):
                    equals = i
                if rest[i] == ord('"'):
                    in_quote = not in_quote
                i += 1
            word, rest = rest[:i], rest[i:]
            while rest and rest[0] in KERNEL_SPACE:
                rest = rest[1:]
            if equals < 0:
                out.append((word.decode(), None))
                continue
            value = word[equals + 1:]
            if value.startswith(b'"'):
                value = value[1:-1] if value.endswith(b'"') and len(value) > 1 else value[1:]
            out.append((word[:equals].decode(), value.decode()))
    return out


def test_walk_nvreg_values(tmp_path):
    """nvidia.nvreg string values: the modprobe.d line gives the module exactly the value."""
    from plan import nvidia as nvidia_plan

    values = generate(["RmMsg=:0x40", "0x1;2", "a/b,c"])
    accepted, refused = load_values(tmp_path, "nvidia.nvreg", values, lambda v: {
        "nvidia": {"version": "595.71.05", "nvreg": {"NVreg_RegistryDwords": v}}})
    assert len(values) >= 1500 and refused and accepted
    for spec in accepted.values():
        nvreg = dict(nvidia_of(spec).nvreg)
        text = nvidia_plan.render_modprobe_conf(False, "", nvreg)
        assert module_options(text) == [(k, str(v)) for k, v in sorted(nvreg.items())], text
    # kmod itself (the twin root's Debian kmod, `modprobe -C DIR -c`) reads each file's options line whole
    kmod = sorted((Path(__file__).resolve().parents[2] / ".cache/twin").glob("root-*/bin/kmod"))
    if not kmod:
        return  # no twin root cached here: the model above stands alone
    root = kmod[0].parent.parent
    for i, spec in to_run(accepted, lambda s: str(nvidia_of(s).nvreg["NVreg_RegistryDwords"])).items():
        text = nvidia_plan.render_modprobe_conf(False, "", dict(nvidia_of(spec).nvreg))
        (tmp_path / f"m{i}").mkdir()
        (tmp_path / f"m{i}" / "nvidia.conf").write_text(text)
        shown = subprocess.run([str(root / "lib64/ld-linux-x86-64.so.2"), "--library-path", str(root / "lib/x86_64-linux-gnu"),
                                "--argv0", "modprobe", str(kmod[0]), "-C", str(tmp_path / f"m{i}"), "-c"],
                               capture_output=True, text=True, timeout=30)
        ours = [line for line in text.splitlines() if line.startswith("options nvidia ")]
        # (kmod also lists the kernel command line's nvidia.* parameters as options lines: ours must be there)
        assert ours and set(ours) <= set(shown.stdout.splitlines()), (ours, shown.stdout[:400], shown.stderr)


GOOD_HOSTS = ["fe80::1%vmbr0", "2001:db8::1", "10.0.0.1", "kpro6.lab.internal"]


@pytest.mark.parametrize("field", ["proxmox_api.host", "ssh.hostname"])
def test_walk_hosts(tmp_path, field):
    """Every accepted host is exactly the host of the URL proxmoxer's https backend builds
    (requests sends the token there), and a bare host for paramiko (no '%' beyond a zone id
    that is an interface name, no URL or ssh_config characters)."""
    urllib3 = pytest.importorskip("urllib3")
    from proxmoxer.backends.https import Backend

    values = generate(GOOD_HOSTS)
    section, key = field.split(".")
    accepted, refused = load_values(tmp_path, field, values, lambda v: {section: {
        key: v, **({"token_name": "pvegpu", "token_env": "PVE_TOKEN"} if section == "proxmox_api" else {})}})
    assert len(values) >= 1500 and refused and accepted
    for spec in accepted.values():
        host = getattr(getattr(spec, section), key)
        assert re.match(r"^[A-Za-z0-9.:-]+(%[A-Za-z0-9_.-]{1,15})?$", host), host
        url = Backend(host=host, port=8006, user="root@pam", token_name="t", token_value="x").get_base_url()
        parsed = urllib3.util.parse_url(url)
        assert parsed.host == (f"[{host}]" if ":" in host else host) and parsed.auth is None and parsed.port == 8006


def test_operands_end_options_or_refuse_a_dash():
    assert operands(["-oProxyCommand=x", "src"]) == "-- -oProxyCommand=x src"
    assert operands("v1:Makefile", "--end-of-options") == "--end-of-options v1:Makefile"
    assert operands("v 1", "") == "'v 1'"
    bad_calls: list[tuple[str | list[str], str]] = [("-b", ""), ("--", ""), ("x", "-e"), ([], "--")]
    for bad in bad_calls:
        with pytest.raises(ValueError):
            operands(*bad)


# ------------------------------------------------------------------ NCCL: nccl.conf and the drop-ins

def nccl_file_values(text: str, skips_comments: bool) -> dict[str, str]:
    """What NCCL sets from an nccl.conf (src/misc/param.cc setEnvFile): lines split at '\\n' only
    (getline/fgets), a trailing '\\r' dropped (2.26+), '#' lines skipped only from 2.26 (before,
    a comment with '=' sets a variable), the name up to the first '=', the rest the value, both
    cut at 1023 bytes; a line without '=' is skipped."""
    out: dict[str, str] = {}
    for line in text.split("\n"):
        if skips_comments:
            line = line.removesuffix("\r")
            if line.startswith("#"):
                continue
        if "=" not in line:
            continue
        name, value = line.split("=", 1)
        cut = lambda s: s.encode()[:1023].decode("utf-8", "replace")  # noqa: E731
        out.setdefault(cut(name), cut(value))  # setenv(..., 0): the first line of a name wins
    return out


SYSTEMD_WS = " \t\n\r"
SYSTEMD_ESCAPES = {"a": "\a", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t", "v": "\v", "\\": "\\",
                   '"': '"', "'": "'", "s": " "}


def systemd_lines(text: str) -> list[tuple[str, str]]:
    """(section, 'Key=value') assignments of a unit file as systemd's conf-parser.c config_parse()
    reads it: a line whose first non-blank is '#' or ';' is a comment (also inside a
    continuation), a line ending in an unescaped '\\' continues on the next (the '\\' becomes a
    space), then the line is stripped; '[Section]' lines switch sections."""
    out, section, cont = [], "", None
    for raw in text.split("\n"):
        if raw.lstrip(SYSTEMD_WS)[:1] in ("#", ";"):
            continue
        line = raw if cont is None else cont + raw
        escaped = False
        for ch in line:
            escaped = not escaped and ch == "\\"
        if escaped:
            cont = line[:-1] + " "
            continue
        cont, line = None, line.strip(SYSTEMD_WS)
        if not line:
            continue
        if line.startswith("[") and line.endswith("]"):
            section = line[1:-1]
            continue
        out.append((section, line))
    return out


def systemd_words(rvalue: str) -> list[str] | None:
    """extract-word.c extract_first_word(EXTRACT_UNQUOTE|EXTRACT_CUNESCAPE), word after word:
    blanks separate, '...' and "..." quote (the other quote is plain inside), '\\' escapes as
    escape.c cunescape_one() reads them (an unknown escape or an open quote: the whole value is
    ignored, None)."""
    words: list[str] = []
    i, n = 0, len(rvalue)
    while True:
        while i < n and rvalue[i] in SYSTEMD_WS:
            i += 1
        if i >= n:
            return words
        word, quote = [], None
        while i < n and (quote or rvalue[i] not in SYSTEMD_WS):
            c = rvalue[i]
            if c == "\\":
                if i + 1 >= n:
                    return None
                e = rvalue[i + 1]
                if e in SYSTEMD_ESCAPES:
                    word.append(SYSTEMD_ESCAPES[e])
                    i += 2
                elif e == "x" and re.match(r"[0-9a-fA-F]{2}", rvalue[i + 2:i + 4]):
                    word.append(chr(int(rvalue[i + 2:i + 4], 16)))
                    i += 4
                elif re.match(r"[0-7]{3}", rvalue[i + 1:i + 4]):
                    word.append(chr(int(rvalue[i + 1:i + 4], 8)))
                    i += 4
                else:
                    return None
            elif quote is None and c in "'\"":
                quote, i = c, i + 1
            elif c == quote:
                quote, i = None, i + 1
            else:
                word.append(c)
                i += 1
        if quote:
            return None
        words.append("".join(word))


def systemd_environment(text: str) -> dict[str, str]:
    """The Environment= of a drop-in's [Service] as systemd gets it (load-fragment.c
    config_parse_environ: each word unquoted and unescaped, then its %-specifiers resolved
    (specifier.c specifier_printf: '%%' is '%', a '%' at the very end stays; any other '%x' is
    replaced or an error, so here it marks the value as changed), then kept when env_assignment_is_valid; a later one replaces an earlier)."""
    env: dict[str, str] = {}
    for section, line in systemd_lines(text):
        key, _, rvalue = line.partition("=")
        if section != "Service" or key.strip(SYSTEMD_WS) != "Environment":
            continue
        for word in systemd_words(rvalue.strip(SYSTEMD_WS)) or []:
            resolved = re.sub(r"%(.)", lambda m: "%" if m.group(1) == "%" else f"<specifier %{m.group(1)}>", word)
            name, eq, value = resolved.partition("=")
            if eq and re.match(r"^[A-Za-z_][A-Za-z0-9_]*$", name) and not any(ord(c) < 32 or c == "\x7f" for c in value):
                env[name] = value
    return env


def test_systemd_model_reads_what_systemd_reads():
    """The model against the examples systemd.exec(5) and the drop-in test give (and an
    escape done wrong, which it must read differently)."""
    text = ('[Service]\n# a comment \\\nEnvironment="A=x y" B=\'c "d"\' "C=100%% \\\\"\n'
            "; another\nEnvironment=D=1 \\\n  E=2\n")
    assert systemd_environment(text) == {"A": "x y", "B": 'c "d"', "C": "100% \\", "D": "1", "E": "2"}
    assert systemd_environment('[Service]\nEnvironment="A=100%h"\n')["A"] != "100%h"
    assert systemd_environment('[Service]\nEnvironment="A=100%"\n')["A"] == "100%"  # a stray '%' at the end stays
    assert systemd_environment('[Service]\nEnvironment="A=a\\zb"\n') == {}  # \z: no such escape
    assert nccl_file_values("# x=1\nNCCL_A= b\r\n", True) == {"NCCL_A": " b"}
    assert nccl_file_values("# x=1\nNCCL_A= b\r\n", False) == {"# x": "1", "NCCL_A": " b\r"}


def nccl_want(spec: HostSpec) -> dict:
    """The NCCL stage's files for `spec` on the recorded kpro6 (operations.nccl.desired)."""
    from operations import nccl as nccl_ops
    from tests.unit.test_topology_report import kpro6_hardware

    return nccl_ops.desired(spec, kpro6_hardware(), rdma_devices=[])


def test_walk_nccl_values(tmp_path):
    """nccl.overrides values: NCCL reads each from /etc/nccl.conf as written (both line readers),
    and systemd gives each service exactly the same value through the drop-in's Environment=;
    systemd-analyze verify (the real parser) takes every drop-in without a word."""
    values = generate(["INIT,NET", "^INIT", "/tmp/nccl %h.%p", "eth0,eth1", "=x"])
    accepted, refused = load_values(tmp_path, "nccl.overrides", values, lambda v: {
        "nccl": {"overrides": {"NCCL_DEBUG_SUBSYS": v}, "services": ["vllm"]}})
    assert len(values) >= 1500 and refused and accepted
    dropins = {}
    for i, spec in accepted.items():
        value = spec.nccl.overrides["NCCL_DEBUG_SUBSYS"]
        want = nccl_want(spec)
        env = {name: entry["value"] for name, entry in want["plan"]["host"].items()}
        assert env["NCCL_DEBUG_SUBSYS"] == value
        assert nccl_file_values(want["host"], skips_comments=True) == env, value
        assert nccl_file_values(want["host"], skips_comments=False) == env, value
        (unit, text), = want["dropins"].values()
        assert systemd_environment(text) == env, (value, text)
        dropins[i] = text
    run = to_run(accepted, lambda s: str(s.nccl.overrides["NCCL_DEBUG_SUBSYS"]))
    systemd_verify(tmp_path / "root", {f"w{i}.service": dropins[i] for i in run})


def systemd_verify(root: Path, dropins: dict[str, str]) -> None:
    """systemd-analyze verify (systemd's own unit loader) of one unit per drop-in: no warning."""
    if not shutil.which("systemd-analyze") or not Path("/lib/systemd/system/sysinit.target").exists():
        return  # the model above still ran; this is the real parser where the machine has it
    shutil.copytree("/lib/systemd/system", root / "lib/systemd/system", symlinks=True)
    (root / "usr/bin").mkdir(parents=True)
    (root / "usr/bin/true").write_text("#!/bin/sh\n")
    (root / "usr/bin/true").chmod(0o755)
    units = root / "etc/systemd/system"
    for unit, text in dropins.items():
        (units / f"{unit}.d").mkdir(parents=True)
        (units / unit).write_text("[Unit]\nDescription=x\n[Service]\nExecStart=/usr/bin/true\n")
        (units / f"{unit}.d" / "pvegpu-nccl.conf").write_text(text)
    done = subprocess.run(["systemd-analyze", "verify", "--man=no", f"--root={root}",
                           *(f"/etc/systemd/system/{u}" for u in dropins)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stderr == "", done.stderr


def test_walk_nccl_services(tmp_path):
    """nccl.services: each accepted name is one unit whose drop-in directory is one file name
    under /etc/systemd/system; the drop-in's comment lines name it and stay comments."""
    from operations import nccl as nccl_ops

    values = generate(["vllm", "vllm@1.service", "sglang.service", "a:b-c_d.e\\x2d"])
    accepted, refused = load_values(tmp_path, "nccl.services", values, lambda v: {
        "nccl": {"overrides": {"NCCL_DEBUG": "WARN"}, "services": [v]}})
    assert len(values) >= 1500 and refused and accepted
    for spec in accepted.values():
        want = nccl_want(spec)
        (path, (unit, text)), = want["dropins"].items()
        assert path == nccl_ops.dropin_path(nccl_ops.unit_name(spec.nccl.services[0]))
        directory = path.removeprefix(nccl_ops.SYSTEMD_DIR + "/").removesuffix("/" + nccl_ops.DROPIN_NAME)
        assert directory == f"{unit}.d" and "/" not in directory and len(directory.encode()) <= 255
        env = {name: entry["value"] for name, entry in want["plan"]["host"].items()}
        assert systemd_environment(text) == env and env["NCCL_DEBUG"] == "WARN"
        assert [line for line in text.split("\n") if unit in line and not line.startswith("#")] == []


# ------------------------------------------------------------------ udev rule and initramfs hook

def udev_rule_tokens(line: str) -> list[tuple[str, str | None, str, str]]:
    """(key, attr, op, value) of one rule line as systemd's src/udev/udev-rules.c reads it
    (parse_line/parse_value): KEY{attr}OP"value" pairs separated by ',' and blanks; a value is
    double-quoted and a '\\"' inside stays a quote. Fails on anything else."""
    tokens, rest = [], line.strip()
    pair = re.compile(r'([A-Z_]+)(?:\{([^}]*)\})?(==|!=|\+=|-=|:=|=)"((?:[^"\\]|\\.)*)"\s*(?:,\s*|$)')
    while rest:
        m = pair.match(rest)
        assert m, f"udev would not read {rest!r}"
        tokens.append((m.group(1), m.group(2), m.group(3), m.group(4).replace('\\"', '"')))
        rest = rest[m.end():]
    return tokens


def test_walk_gpu_bdfs(tmp_path):
    """gpus keys (PCI addresses): the udev rule names each by KERNEL=="<bdf>" exactly (no glob
    character fnmatch would widen, no $/% udev would substitute), and the initramfs hook that
    copies the rule file runs with its path as one argument."""
    from operations import gpus as gpu_ops
    from plan.gpus import desired_bindings

    values = generate(["0000:01:00.0", "0000:c1:00.1", "abcd:ff:1f.7"])
    accepted, refused = load_values(tmp_path, "gpus", values, lambda v: {"gpus": {v: "unused"}})
    assert len(values) >= 1500 and refused and accepted
    for spec in accepted.values():
        (bdf,) = spec.gpus
        text = gpu_ops.binding_rules(desired_bindings(spec, {bdf: {}}))
        rules = [udev_rule_tokens(line) for line in text.splitlines() if line and not line.startswith("#")]
        assert rules == [[("ACTION", None, "==", "add"), ("SUBSYSTEM", None, "==", "pci"), ("KERNEL", None, "==", bdf),
                          ("ATTR", "driver_override", "=", "vfio-pci")]], text
        assert not set(bdf) & set("*?[]|$%\\\"")
    # the hook: its rules path (a constant) as one argument of cp, whatever it holds
    hook = render_template("initramfs-gpu-binding-hook.j2", rules_path=str(tmp_path / "r s;$(touch PWNh)'x"))
    lib = tmp_path / "hook-functions"
    lib.write_text(":\n")
    (tmp_path / "r s;$(touch PWNh)'x").write_text("rule\n")
    script = hook.replace("/usr/share/initramfs-tools/hook-functions", str(lib))
    (tmp_path / "hook").write_text(script)
    logs = run_scripts(tmp_path, {0: (f"DESTDIR={shlex.quote(str(tmp_path / 'dest'))} sh {tmp_path / 'hook'}\n", tmp_path)})
    assert calls_of(logs[0], "cp") == [["-p", "--", str(tmp_path / "r s;$(touch PWNh)'x"),
                                        f"{tmp_path / 'dest'}/lib/udev/rules.d/"]], logs[0]


# ------------------------------------------------------------------ the other templates

@contextlib.contextmanager
def one_word_each() -> Iterator[Callable[[str, list[str]], None]]:
    """Yields check(script, values); when the block ends, every script checked parses (sh -n,
    each on its own) and every character of each of its values that the shell would act on sits
    inside single quotes wherever the value occurs (tests/unit/test_shell_templates.py's lexer;
    a value holding "'" is checked piece by piece, as shlex.quote splits it). The checks are
    gathered so that one sh starts the `sh -n` of every script: a walk checks thousands."""
    from tests.unit.test_shell_templates import single_quoted

    checks: list[tuple[str, list[str]]] = []
    yield lambda script, values: checks.append((script, list(values)))
    assert checks, "nothing was checked"
    each_parses([script for script, _ in checks])
    for script, values in checks:
        quoted = single_quoted(script)
        for value in values:
            for piece in value.split("'"):
                if re.fullmatch(r"[A-Za-z0-9._+~:/=@%,-]*", piece):
                    continue  # nothing in it a shell acts on
                at = script.find(piece)
                while at != -1:
                    assert all(quoted[at:at + len(piece)]), f"{piece!r} unquoted in: {script[max(0, at - 60):at + 60]!r}"
                    at = script.find(piece, at + 1)


def each_parses(scripts: list[str]) -> None:
    """`sh -n` of each script on its own (the same script once), all started by one sh."""
    unique = list(dict.fromkeys(scripts))
    with tempfile.TemporaryDirectory(prefix="pvegpu-walk-") as tmp:
        for k, script in enumerate(unique):
            Path(tmp, f"{k}.sh").write_text(script, encoding="utf-8")
        done = subprocess.run(["sh", "-c", 'for f in "$1"/*.sh; do sh -n "$f" 2>"$f.err" || echo "${f##*/}"; done',
                               "sh", tmp], capture_output=True, text=True, check=True, timeout=600)
        bad = done.stdout.split()
        assert not bad, [(Path(tmp, f"{b}.err").read_text(), unique[int(b.removesuffix(".sh"))][:2000]) for b in bad[:3]]
        assert len(list(Path(tmp).glob("*.sh.err"))) == len(unique)  # every script was checked


def test_walk_kernel_release_files(tmp_path):
    """kernel.version into the trial entry, the ZFS guard, the detached build's start and the
    build manifest: every accepted release is shell-inert (the kernel-release rule), each script
    parses, and the manifest (JSON, read back by facts.kernel) gives every value back."""
    import json

    values = generate(["6.14.11-4-pve", "6.1.192-pvegpu+ci~1"], 600)
    accepted, refused = load_values(tmp_path, "kernel.version", values, lambda v: {"kernel": {
        "version": v, "base_config": "tinyconfig", "config_fragments": ['CONFIG_LOCALVERSION="-x;$(touch PWNf)"'],
        "source": {"kind": "tarball", "url": "/srv/l.tar.xz", "sha256": KERNEL_SHA}}})
    assert refused and accepted
    with one_word_each() as check:
        for spec in accepted.values():
            k = kernel_of(spec)
            assert re.fullmatch(r"[0-9A-Za-z.+~-]+", k.version) and k.version[0].isdigit(), k.version
            for script in (kernel_plan.trial_entry_command(k.version, "arm", 10), kernel_plan.zfs_guard_command(k.version),
                           kernel_ops.start_build_command(kernel_plan.build_dir(k, "tinyconfig"), True, 1024),
                           # issue 41: the kept build and its verified copy (node to node)
                           kernel_ops.publish_command(kernel_plan.build_dir(k, "tinyconfig"), "tarball", k.version, "a" * 64),
                           kernel_ops.receive_command("tarball", k.version, kernel_plan.build_dir(k, "tinyconfig"), "a" * 64,
                                                      "kpro5", via={"node": "kpro5", "ip": "10.0.0.5"})):
                check(script, [k.version])
            manifest = render_template("kernel-build-manifest.json.j2", build_id=kernel_plan.build_id(k, "tinyconfig"),
                                       version=k.version, kind=k.source.kind, url=k.source.url, ref=k.source.sha256,
                                       base_config="tinyconfig", fragments=list(k.config_fragments), jobs=2)
            data = json.loads(manifest.replace("@OBJECTS@", "0"))
            assert (data["version"], data["url"], data["fragments"]) == (k.version, k.source.url, list(k.config_fragments))


def test_walk_kernel_config_fragments(tmp_path):
    """kernel.config_fragments: the build writes each accepted line to pvegpu.config as written
    (printf of one word per line, run under sh with the stand-ins)."""
    values = generate(['CONFIG_LOCALVERSION="-pvegpu"', "CONFIG_VFIO=m", "# CONFIG_DEBUG_INFO is not set"])
    accepted, refused = load_values(tmp_path, "kernel.config_fragments", values, lambda v: {"kernel": {
        "version": "6.1.192-x", "base_config": "tinyconfig", "config_fragments": [v],
        "source": {"kind": "tarball", "url": "/srv/l.tar.xz", "sha256": KERNEL_SHA}}})
    assert len(values) >= 1500 and refused and accepted
    run = to_run(accepted, lambda s: kernel_of(s).config_fragments[0])
    scripts = {i: (kernel_ops.build_script(kernel_of(s), "tinyconfig", 2, str(tmp_path / f"b{i}")), tmp_path / f"b{i}")
               for i, s in run.items()}
    run_scripts(tmp_path, scripts)
    for i, spec in run.items():
        written = (tmp_path / f"b{i}" / "src" / "pvegpu.config")
        if not written.exists():
            written = next((tmp_path / f"b{i}").rglob("pvegpu.config"))
        assert written.read_text() == "".join(f"{line}\n" for line in kernel_of(spec).config_fragments)


def test_walk_nvidia_signing_paths(tmp_path, monkeypatch):
    """nvidia.signing.key/.cert (absolute paths, anything but control characters): the build
    script, the kernel hook and the verify script hold each as one word, and the build run with
    stand-ins (sign-file logging) gets each as exactly one argument."""
    from operations import kernel_hook
    from tests.unit import test_shell_templates as shell_tests

    values = generate(["/root/mok.key", "/etc/pvegpu/signing key.pem"])
    accepted, refused = load_values(tmp_path, "nvidia.signing", values, lambda v: {"nvidia": {
        "version": "595.71.05", "signing": {"key": v, "cert": v + ".der"},
        "modules_source": {"url": "/srv/open-gpu-kernel-modules-595.71.05.tar.gz", "sha256": INSTALLER_SHA}}})
    assert len(values) >= 1500 and refused and accepted
    with one_word_each() as check:
        for spec in accepted.values():
            sig = nvidia_of(spec).signing
            assert sig is not None
            build = nvidia_ops.build_command("/a.tgz", "595.71.05", "6.14.8-2-pve", "gcc", 2, True,
                                             signing=(sig.key, sig.cert))
            check(build, [sig.key, sig.cert])
            assert f"{shlex.quote(sig.key)} {shlex.quote(sig.cert)}" in build
            check(kernel_hook.hook_script(spec, 2, True), [sig.key, sig.cert])
    # the build runs for a few of them (each is a tar, a fake make and sign-file)
    run = list(to_run(accepted, lambda s: getattr(nvidia_of(s).signing, "key", "")).values())[:6]
    for n, spec in enumerate(run):
        sig = nvidia_of(spec).signing
        assert sig is not None
        root = tmp_path / f"run{n}"
        root.mkdir()
        monkeypatch.setattr(nvidia_ops, "CCACHE_DIR", str(root / "ccache"))
        archive = shell_tests.nvidia_kernel_archive(root, monkeypatch)
        env = {**shell_tests.tools(root), "REL": "6.14.8-2-pve", "VER": "595.71.05"}
        # the key's owner/mode check (issue 39 item 4) stats a host path: a stand-in logs its operands and
        # answers root's 0600
        real_stat = shutil.which("stat")
        (root / "tools/stat").write_text(f"#!/bin/sh\n[ \"$3\" = '%u %a' ] || exec {real_stat} \"$@\"\n"
                                         f"printf '%s\\0' \"$@\" > {shlex.quote(str(root / 'stat.args'))}\n"
                                         "echo '0 600'\n")
        (root / "tools/stat").chmod(0o755)
        command = nvidia_ops.build_command(str(archive), "595.71.05", "6.14.8-2-pve", "gcc", 2, ccache=False,
                                           signing=(sig.key, sig.cert))
        (root / "lib/modules/6.14.8-2-pve/build/scripts").mkdir(parents=True)
        (root / "lib/modules/6.14.8-2-pve/build/scripts/sign-file").symlink_to(root / "tools/sign-file")
        done = shell_tests.sh(command.replace("/lib/modules", str(root / "lib/modules")), root, env)
        assert done.returncode == 0, done.stderr
        signed = [c for c in shell_tests.calls(root) if c[0] == "sign-file"]
        assert signed and signed[0][1:4] == ["sha256", sig.key, sig.cert], signed
        assert (root / "stat.args").read_text().split("\0")[:-1] == ["-L", "-c", "%u %a", "--", sig.key]
    assert not list(tmp_path.rglob("PWN*"))


def test_walk_nvidia_version_and_releases(tmp_path):
    """nvidia.version and nvidia.releases into the build, install, verify and conftest-key
    scripts and the kernel hook: every accepted value is shell-inert and each script parses."""
    from operations import build_share, kernel_hook

    values = generate(["595.71.05", "550.54"], 600)
    accepted, refused = load_values(tmp_path, "nvidia.version", values, lambda v: {"nvidia": {
        "version": v, "releases": ["6.14.8-2-pve"],
        "modules_source": {"url": "/srv/o.tar.gz", "sha256": INSTALLER_SHA}}})
    releases = generate(["6.14.8-2-pve", "6.12.118+deb12-amd64"], 600)
    accepted_r, refused_r = load_values(tmp_path, "nvidia.releases", releases, lambda v: {"nvidia": {
        "version": "595.71.05", "releases": [v]}})
    assert refused and accepted and refused_r and accepted_r
    with one_word_each() as check:
        for spec in [*accepted.values(), *accepted_r.values()]:
            nv = nvidia_of(spec)
            assert nv.releases
            words = [nv.version, *nv.releases]
            assert all(re.fullmatch(r"[0-9A-Za-z.+~-]+", w) and w[0].isdigit() for w in words), words
            for release in nv.releases:
                for script in (nvidia_ops.build_command("/a.tgz", nv.version, release, "gcc", 2, True),
                               nvidia_ops.build_command("/a.tgz", nv.version, release, "gcc", 2, True, share_key="a" * 64,
                                                       share_inputs=f'{{"version":"{nv.version}"}}'),
                               build_share.receive_command(nv.version, release, "a" * 64, "kpro5",
                                                           via={"node": "kpro5", "ip": "10.0.0.5"}),
                               nvidia_ops.install_command(nv.version, release),
                               nvidia_ops.verify_command(nv.version, nv.releases, True, ["gsp.bin"]),
                               nvidia_ops.conftest_key_command("/a.tgz", release, "gcc", "modules"),
                               nvidia_ops.cleanup_command(nv.version)):
                    check(script, words)
            if nv.modules_source is not None:
                check(kernel_hook.hook_script(spec, 2, True), words)


def test_walk_rebind_script(tmp_path):
    """gpus keys and guest ids into the rebind runner (rebind.sh.j2): every accepted address is
    shell-inert, the runner parses and names it."""
    from operations import gpus as gpu_ops
    from plan.gpus import Move, RebindPlan

    values = generate(["0000:01:00.0", "abcd:ff:1f.7"], 600)
    accepted, refused = load_values(tmp_path, "gpus", values, lambda v: {"gpus": {v: "unused"}})
    assert refused and accepted
    with one_word_each() as check:
        for spec in accepted.values():
            (bdf,) = spec.gpus
            assert re.fullmatch(r"[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]", bdf)
            script = gpu_ops.rebind_script(RebindPlan([Move(bdf, "nvidia", "vfio-pci")], [("qemu", 300)], [], True),
                                           {bdf: {"minor": 0}}, "tx")
            check(script, [bdf])
            assert bdf in script


def test_walk_kernel_signing_paths(tmp_path):
    """kernel.signing.key/.cert (host paths) into the kernel image's signing script (sbsign): each
    stays one word of the rendered script, which parses."""
    values = generate(["/root/mok.pem", "/etc/pvegpu/kernel key.pem"], 600)
    accepted, refused = load_values(tmp_path, "kernel.signing", values, lambda v: {"kernel": {
        "version": "6.14.11-9-bpo12-pvegpu-pve", "signing": {"key": v, "cert": v + ".der"},
        "source": {"kind": "tarball", "url": "/srv/l.tar.xz", "sha256": KERNEL_SHA}}})
    assert refused and accepted
    with one_word_each() as check:
        for spec in accepted.values():
            k = kernel_of(spec)
            assert k.signing is not None
            check(render_template("kernel-sign.sh.j2", release=k.version, key=k.signing.key, cert=k.signing.cert),
                  [k.version, k.signing.key, k.signing.cert])


def test_walk_kernel_release_into_the_grub_trial_and_the_driver_gate(tmp_path):
    """kernel.version into the GRUB trial entry script (/etc/grub.d/42_pvegpu_trial) and the driver
    x kernel gate (which includes the NVIDIA build script): one word each, scripts that parse."""
    from operations import kernel as kernel_stage

    values = generate(["6.14.11-4-pve", "6.1.192-pvegpu+ci~1"], 400)
    accepted, refused = load_values(tmp_path, "kernel.version", values, lambda v: {
        "kernel": {"version": v, "source": {"kind": "tarball", "url": "/srv/l.tar.xz", "sha256": KERNEL_SHA}},
        "nvidia": {"version": "595.71.05", "modules_source": {"url": "/srv/open-gpu-kernel-modules-595.71.05.tar.gz",
                                                               "sha256": INSTALLER_SHA}}})
    assert refused and accepted
    with one_word_each() as check:
        for spec in accepted.values():
            k = kernel_of(spec)
            check(render_template("grub-trial-entry.sh.j2", release=k.version, panic_s=10), [k.version])
            check(render_template("grub-esp-oneshot.sh.j2", mode="arm", entry=f"pvegpu-trial-{k.version}",
                                  keep_id=f"gnulinux-advanced-7f3c>gnulinux-{k.version}-advanced-7f3c"),
                  [f"pvegpu-trial-{k.version}", f"gnulinux-advanced-7f3c>gnulinux-{k.version}-advanced-7f3c"])
            check(kernel_stage.gate_script(spec, "/var/lib/pvegpu/kernel-build/b", 2, "gcc-12", "g++-12"), [k.version])


def test_walk_gpu_pool_into_the_mapping_merge(tmp_path):
    """vms[].pool (a Proxmox mapping id) and the node name into the mapping merge script
    (templates/mapping-merge.sh.j2, run over SSH): one word each, a script that parses."""
    from operations.guests import mapping_merge_command
    from plan.guests import MappingChange

    values = generate(["rtx6000", "h200_pool-2"], 600)
    accepted, refused = load_values(tmp_path, "vms[300].pool", values, lambda v: {
        "gpus": {"0000:81:00.0": {"role": "vm:300"}}, "vms": {300: {"gpus": ["0000:81:00.0"], "pool": v}}})
    assert refused and accepted
    with one_word_each() as check:
        for spec in accepted.values():
            pool = spec.vms[300].pool
            assert pool is not None and re.fullmatch(r"[A-Za-z][A-Za-z0-9_-]+", pool)
            change = MappingChange(id=pool, action="merge", node=spec.node or "kpro6",
                                   maps=[{"id": "10de:2bb5", "iommugroup": "3", "node": "kpro6", "path": "0000:81:00"}],
                                   reason="walk", description="pvegpu-gpu-pool")
            script = mapping_merge_command(change)
            inner = shlex.split(script)[2]
            check(inner, [pool])


# templates whose text takes no value from the spec: their context (if any) is pvegpu's own constants
NO_SPEC_VALUE = {
    "blacklist-nouveau.conf.j2": set(),
    "nvidia-device-nodes.service.j2": set(),
    "nvidia-persistenced.service.j2": set(),
    "modules-load-vfio.conf.j2": {"modules"},  # operations/boot.py: vfio module names, by PVE version
    "nvidia-first-error.sh.j2": set(),  # reads a build log named at run time (the gate's and the hook's)
    "root-dir.sh.j2": set(),  # a shell function; its directories come from its callers, each walked
    "kernel-headers-apt.conf.j2": {"path", "hook"},  # operations/kernel_hook.py HEADERS_CONF, HOOK
    "host-checks-loop.sh.j2": set(),  # plan.kernel HOST_CHECKS_LOOP: reads its lines from stdin
    # plan.kernel trial_up_files: facts.kernel's fixed paths only
    "kernel-trial-up.sh.j2": {"marker", "up", "checks_file"},
    "kernel-trial-up.service.j2": {"marker", "script"},
    # issue 40 item 1, plan/upgrade_perform.py: its constants and what the facts read (pins)
    "pve-upgrade.sh.j2": {"state_dir", "unpin", "efi_default", "unset_saved"},
    "pve-upgrade-start.sh.j2": {"state_dir", "lock", "script", "unit"},
    # (lxc|qemu, int id) pairs: the spec's guest ids are ints (plan.upgrade_perform.parse_stopped_guests)
    "pve-upgrade-guests.j2": {"guests"},
    # (what, kind or HA sid, int id, node) from operations/reboot.py clear_guests' moves: node names read
    # from pmxcfs's .members, HA sids from ha-manager; read back through plan.upgrade_perform.parse_moved
    "pve-upgrade-moved.j2": {"moved"},
}


def test_templates_without_spec_values_take_none():
    import jinja2.meta

    from plan.render import _env

    for name, allowed in NO_SPEC_VALUE.items():
        source = (Path(__file__).resolve().parents[2] / "templates" / name).read_text()
        assert jinja2.meta.find_undeclared_variables(_env.parse(source)) == allowed, name
    assert render_template("modules-load-vfio.conf.j2", modules=["vfio", "vfio_pci"]).splitlines()[-2:] == ["vfio", "vfio_pci"]


# Every template in templates/ and the walks that render it from hostile spec values (each test
# here loads its values as the CLI does and renders them with the real builders).
WALKS = {
    "kernel-build.sh.j2": ["test_walk_kernel_source_ref", "test_walk_kernel_source_url", "test_walk_kernel_version",
                           "test_walk_kernel_tarball_url_and_base_config", "test_walk_kernel_config_fragments"],
    "kernel-build-start.sh.j2": ["test_walk_kernel_release_files"],
    "kernel-build-manifest.json.j2": ["test_walk_kernel_release_files"],
    "kernel-publish.sh.j2": ["test_walk_kernel_release_files"],
    "kernel-receive.sh.j2": ["test_walk_kernel_release_files"],
    # included by nvidia-receive.sh.j2 and kernel-receive.sh.j2
    "share-copy.sh.j2": ["test_walk_nvidia_version_and_releases", "test_walk_kernel_release_files"],
    "kernel-trial-entry.sh.j2": ["test_walk_kernel_release_files"],
    "kernel-zfs-guard.sh.j2": ["test_walk_kernel_release_files"],
    "kernel-cmdline.j2": ["test_walk_kernel_cmdline_words"],
    "grub-pvegpu.cfg.j2": ["test_walk_kernel_cmdline_words"],
    "nvidia-fetch-source.sh.j2": ["test_walk_nvidia_source_url"],
    "nvidia-build.sh.j2": ["test_walk_nvidia_signing_paths", "test_walk_nvidia_version_and_releases"],
    "nvidia-install.sh.j2": ["test_walk_nvidia_version_and_releases"],
    "nvidia-receive.sh.j2": ["test_walk_nvidia_version_and_releases"],
    "nvidia-verify.sh.j2": ["test_walk_nvidia_version_and_releases"],
    "nvidia-conftest-key.sh.j2": ["test_walk_nvidia_version_and_releases"],
    "nvidia-toolchain-check.sh.j2": ["test_walk_nvidia_version_and_releases"],  # included by the hook and the gate
    "nvidia-toolchain-pick.sh.j2": ["test_walk_nvidia_version_and_releases"],  # included by the hook (no spec value in it)
    "kernel-postinst-nvidia.sh.j2": ["test_walk_nvidia_signing_paths", "test_walk_nvidia_version_and_releases"],
    "nvidia-share-key.sh.j2": ["test_walk_nvidia_version_and_releases"],  # included by the hook (its key)
    "modprobe-nvidia.conf.j2": ["test_walk_nvreg_values"],
    "nccl.conf.j2": ["test_walk_nccl_values"],
    "nccl-service-dropin.conf.j2": ["test_walk_nccl_values", "test_walk_nccl_services"],
    "gpu-binding.rules.j2": ["test_walk_gpu_bdfs"],
    "initramfs-gpu-binding-hook.j2": ["test_walk_gpu_bdfs"],
    "rebind.sh.j2": ["test_walk_rebind_script"],
    "kernel-sign.sh.j2": ["test_walk_kernel_signing_paths"],
    # included by nvidia-build.sh.j2 (its key) and kernel-sign.sh.j2 (kernel.signing.key)
    "signing-key-check.sh.j2": ["test_walk_nvidia_signing_paths", "test_walk_kernel_signing_paths"],
    "grub-trial-entry.sh.j2": ["test_walk_kernel_release_into_the_grub_trial_and_the_driver_gate"],
    "grub-esp-oneshot.sh.j2": ["test_walk_kernel_release_into_the_grub_trial_and_the_driver_gate"],
    "kernel-nvidia-gate.sh.j2": ["test_walk_kernel_release_into_the_grub_trial_and_the_driver_gate"],
    "mapping-merge.sh.j2": ["test_walk_gpu_pool_into_the_mapping_merge"],
    **{name: ["test_templates_without_spec_values_take_none"] for name in NO_SPEC_VALUE},
}


def test_every_template_is_walked():
    """A template added to templates/ fails here until a walk renders it (or it takes no spec value)."""
    names = {p.name for p in (Path(__file__).resolve().parents[2] / "templates").iterdir() if p.is_file()}
    assert set(WALKS) == names, f"not walked: {sorted(names - set(WALKS))}; gone: {sorted(set(WALKS) - names)}"
    for tests in WALKS.values():
        assert all(callable(globals().get(t)) for t in tests), tests
