"""The atomic managed-file write: real shell, real files (no host needed)."""

import subprocess

from facts.files import ManagedFiles
from operations.files import sha256_text, write_file_command


def run(cmd):
    return subprocess.run(["sh", "-c", cmd], capture_output=True, text=True, check=True).stdout


def test_write_is_atomic_keeps_previous_and_quotes_paths(tmp_path):
    path = str(tmp_path / "dir with space" / "it's.conf")
    run(write_file_command(path, "one\n", "600"))
    assert open(path).read() == "one\n"
    run(write_file_command(path, "two; rm -rf /\n$(x)\n", "644"))
    assert open(path).read() == "two; rm -rf /\n$(x)\n"
    assert open(path + ".pvegpu-prev").read() == "one\n"
    assert not (tmp_path / "dir with space" / "it's.conf.pvegpu-tmp").exists()


def test_managed_files_fact_reads_state_in_one_command(tmp_path):
    a = tmp_path / "a.conf"
    a.write_text("hello\n")
    a.chmod(0o640)
    fact = ManagedFiles()
    out = run(fact.command([str(a), str(tmp_path / "missing")])).splitlines()
    state = fact.process(out)
    assert state == {str(a): {"mode": "640", "sha256": sha256_text("hello\n")}, str(tmp_path / "missing"): None}


def test_managed_files_fact_reports_symlink_targets(tmp_path):
    unit = tmp_path / "x.service"
    unit.write_text("[Unit]\n")
    link = tmp_path / "wants" / "x.service"
    link.parent.mkdir()
    link.symlink_to(unit)
    fact = ManagedFiles()
    state = fact.process(run(fact.command([str(link), str(unit)])).splitlines())
    assert state[str(link)] == {"link": str(unit)}
    assert state[str(unit)]["sha256"] == sha256_text("[Unit]\n")


def test_managed_files_fact_odd_names_and_both_output_forms(tmp_path):
    names = ["plain.conf", "with space.conf", "it's.conf", "back\\slash.conf", "$(touch x).conf"]
    paths = []
    for i, name in enumerate(names):
        f = tmp_path / name
        f.write_text(f"content {i}\n")
        f.chmod(0o600 + i)
        paths.append(str(f))
    paths.append(str(tmp_path / "missing one"))
    (tmp_path / "a dir").mkdir()
    paths.append(str(tmp_path / "a dir"))  # neither file nor link: None
    fact = ManagedFiles()
    state = fact.process(run(fact.command(paths)).splitlines())
    for i, path in enumerate(paths[:len(names)]):
        assert state[path] == {"mode": oct(0o600 + i)[2:], "sha256": sha256_text(f"content {i}\n")}, path
    assert state[paths[-2]] is None and state[paths[-1]] is None
    assert not (tmp_path / "x").exists()  # names are data, never commands
    # the form with mode and digest in each path's block (older recordings) reads the same
    old = [line for p in paths[:2] for line in ("==> pvegpu-file " + p, state[p]["mode"], state[p]["sha256"])]
    assert fact.process(old) == {p: state[p] for p in paths[:2]}


def test_managed_files_fact_runs_two_programs_for_any_number_of_files(tmp_path):
    """One stat and one sha256sum for all regular files (was stat, sha256sum and cut per file)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "calls"
    for prog in ("stat", "sha256sum", "cut", "readlink", "cat"):
        real = subprocess.run(["sh", "-c", f"command -v {prog}"], capture_output=True, text=True).stdout.strip()
        (bin_dir / prog).write_text(f'#!/bin/sh\necho {prog} >> "{log}"\nexec {real} "$@"\n')
        (bin_dir / prog).chmod(0o755)
    paths = []
    for i in range(12):
        (tmp_path / f"f{i}.conf").write_text(str(i))
        (tmp_path / f"f{i}.conf").chmod(0o644)
        paths.append(str(tmp_path / f"f{i}.conf"))
    fact = ManagedFiles()
    out = subprocess.run(["sh", "-c", fact.command(paths)], capture_output=True, text=True, check=True,
                         env={"PATH": f"{bin_dir}:/usr/bin:/bin"}).stdout
    assert sorted(log.read_text().split()) == ["sha256sum", "stat"]
    assert fact.process(out.splitlines())[paths[11]] == {"mode": "644", "sha256": sha256_text("11")}


def test_managed_files_fact_refuses_paths_with_line_breaks():
    import pytest

    with pytest.raises(ValueError, match="line break"):
        ManagedFiles().command(["/etc/a\nb"])
