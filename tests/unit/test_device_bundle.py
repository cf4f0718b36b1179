"""bench/device_bundle.py: which entries of a twin's root a strace of its life keeps."""

from __future__ import annotations

import os

from bench import device_bundle as bundle


def _root(tmp_path):
    root = tmp_path / "root"
    (root / "usr/lib/x86_64-linux-gnu").mkdir(parents=True)
    (root / "usr/bin").mkdir(parents=True)
    (root / "etc/ssh").mkdir(parents=True)
    os.symlink("usr/lib", root / "lib")  # merged /usr, as in Debian 12
    os.symlink("/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2", root / "usr/bin/loader")  # absolute link
    (root / "usr/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2").write_bytes(b"\x7fELF")
    (root / "usr/lib/x86_64-linux-gnu/libc.so.6").write_bytes(b"\x7fELF")
    (root / "usr/lib/x86_64-linux-gnu/unused.so").write_bytes(b"\x7fELF")
    (root / "usr/bin/sshd").write_bytes(b"\x7fELF")
    (root / "etc/ssh/sshd_config").write_text("Port 2222\n")
    return root


def test_paths_from_the_trace(tmp_path):
    twin_root = f"{bundle.REPO}/.twin/t-1/root"
    trace = tmp_path / "trace.txt"
    trace.write_text("\n".join([
        '101 execve("/usr/bin/sshd", ["sshd", "-D"], 0x7ffd /* 5 vars */) = 0',
        '101 openat(AT_FDCWD, "/lib/x86_64-linux-gnu/libc.so.6", O_RDONLY|O_CLOEXEC) = 3',
        '102 openat(AT_FDCWD, "relative/path", O_RDONLY) = -1 ENOENT (No such file or directory)',
        f'103 openat(AT_FDCWD, "{twin_root}/etc/ssh/sshd_config", O_WRONLY|O_CREAT, 0644) = 4',
        f'104 newfstatat(AT_FDCWD, "{bundle.REPO}/deploy.py", {{st_mode=S_IFREG|0644}}, 0) = 0',
        '105 renameat2(AT_FDCWD, "/etc/a.tmp", AT_FDCWD, "/etc/a", RENAME_NOREPLACE) = 0',
        "105 +++ exited with 0 +++",
    ]) + "\n")
    assert bundle.traced_paths(trace) == {
        "/usr/bin/sshd", "/lib/x86_64-linux-gnu/libc.so.6", "/etc/ssh/sshd_config", "/etc/a.tmp", "/etc/a"}


def test_kept_entries_follow_links_inside_the_root(tmp_path):
    root = _root(tmp_path)
    kept = bundle.keep_in_root(root, {"/lib/x86_64-linux-gnu/libc.so.6", "/usr/bin/loader", "/usr/bin/sshd",
                                      "/etc/ssh/sshd_config", "/nowhere/at/all"})
    assert kept == sorted([
        "/lib", "/usr", "/usr/lib", "/usr/lib/x86_64-linux-gnu", "/usr/lib/x86_64-linux-gnu/libc.so.6",
        "/usr/bin", "/usr/bin/loader", "/usr/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2", "/usr/bin/sshd",
        "/etc", "/etc/ssh", "/etc/ssh/sshd_config"])
    assert "/usr/lib/x86_64-linux-gnu/unused.so" not in kept  # a directory's other entries stay out
