"""compat.jinja_cache: a template compiled once is read back compiled by the next process's
environment; a changed template is compiled again; an unusable cache costs a compile, never
the render."""

from __future__ import annotations

import os
import stat

import jinja2
import pytest

from compat.jinja_cache import cache_dir, use_template_cache
from plan import render


@pytest.fixture
def compiles(monkeypatch):
    count = []
    original = jinja2.Environment.compile

    def counting(self, *args, **kwargs):
        count.append(args[1] if len(args) > 1 else kwargs.get("name"))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(jinja2.Environment, "compile", counting)
    return count


def _render(env: jinja2.Environment, name: str, **context) -> str:
    return env.get_template(name).render(**context)


def test_a_template_compiled_once_is_read_back_by_a_new_environment(tmp_path, compiles):
    (tmp_path / "t.j2").write_text("x={{ v | q }}\n")
    first = render.environment(tmp_path)
    assert use_template_cache(first, tmp_path / "cache") is True
    assert _render(first, "t.j2", v="a b") == "x='a b'\n" and compiles == ["t.j2"]
    assert list((tmp_path / "cache").iterdir()), "the compiled code is kept"
    second = render.environment(tmp_path)  # as the next run's process
    use_template_cache(second, tmp_path / "cache")
    assert _render(second, "t.j2", v="c") == "x=c\n" and compiles == ["t.j2"], "read back, not compiled"
    (tmp_path / "t.j2").write_text("y={{ v | q }}\n")
    third = render.environment(tmp_path)
    use_template_cache(third, tmp_path / "cache")
    assert _render(third, "t.j2", v="c") == "y=c\n" and compiles == ["t.j2", "t.j2"], "a changed template compiles"
    assert stat.S_IMODE((tmp_path / "cache").stat().st_mode) == 0o700


def test_a_broken_cache_file_is_compiled_again(tmp_path, compiles):
    (tmp_path / "t.j2").write_text("x={{ v }}\n")
    env = render.environment(tmp_path)
    use_template_cache(env, tmp_path / "cache")
    _render(env, "t.j2", v=1)
    for f in (tmp_path / "cache").iterdir():
        f.write_bytes(f.read_bytes()[:20] + b"\x00garbage")
    again = render.environment(tmp_path)
    use_template_cache(again, tmp_path / "cache")
    assert _render(again, "t.j2", v=2) == "x=2\n" and len(compiles) == 2


def test_a_directory_that_cannot_be_made_gives_no_cache(tmp_path):
    (tmp_path / "file").write_text("")
    env = render.environment(tmp_path)
    assert use_template_cache(env, tmp_path / "file" / "jinja") is False and env.bytecode_cache is None


def test_a_full_disk_costs_only_the_compile(tmp_path, monkeypatch):
    (tmp_path / "t.j2").write_text("x={{ v }}\n")
    env = render.environment(tmp_path)
    use_template_cache(env, tmp_path / "cache")

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("tempfile.NamedTemporaryFile", full)
    assert _render(env, "t.j2", v=3) == "x=3\n"


def test_the_cache_lives_in_the_users_cache_directory(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cache_dir() == tmp_path / "pvegpu" / "jinja"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir() == tmp_path / "home" / ".cache" / "pvegpu" / "jinja"


# -- issue 39 item 2: only the runner's own compiled code is run ---------------------------------

OTHER_UID = 4242  # an account that is not the one running the tests


def _planted(tmp_path):
    """The cache of t.j2 filled by a first environment, then its file replaced by code that
    renders 'PLANTED' (a bytecode file as another account could write it)."""
    (tmp_path / "t.j2").write_text("x={{ v }}\n")
    evil = tmp_path / "evil"
    evil.mkdir()
    (evil / "t.j2").write_text("PLANTED\n")
    env = render.environment(tmp_path)
    use_template_cache(env, tmp_path / "cache")
    _render(env, "t.j2", v=1)
    # the same template name and source checksum, compiled from other code: what jinja2 would run
    bad = render.environment(evil)
    assert env.bytecode_cache is not None
    bucket = jinja2.bccache.Bucket(bad, "t.j2", env.bytecode_cache.get_source_checksum("x={{ v }}\n"))
    bucket.code = bad.compile("PLANTED\n", "t.j2", "t.j2")
    (cache_file,) = (tmp_path / "cache").iterdir()
    with open(cache_file, "wb") as f:
        bucket.write_bytecode(f)
    return cache_file


def test_a_planted_file_is_run_when_it_is_the_runners_own(tmp_path):
    # the control: the planted file is a working exploit when nothing else is wrong with it
    _planted(tmp_path)
    env = render.environment(tmp_path)
    use_template_cache(env, tmp_path / "cache")
    assert _render(env, "t.j2", v=2) == "PLANTED\n"


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid needs root")
def test_a_cache_file_owned_by_another_uid_is_not_run(tmp_path, compiles):
    cache_file = _planted(tmp_path)
    os.chown(cache_file, OTHER_UID, -1)
    os.chmod(cache_file, 0o600)
    env = render.environment(tmp_path)
    assert use_template_cache(env, tmp_path / "cache") is True
    assert _render(env, "t.j2", v=2) == "x=2\n", "compiled fresh, not the planted code"


@pytest.mark.parametrize("mode", [0o620, 0o602, 0o666], ids=oct)
def test_a_cache_file_others_can_write_is_not_run(tmp_path, compiles, mode):
    cache_file = _planted(tmp_path)
    os.chmod(cache_file, mode)
    env = render.environment(tmp_path)
    use_template_cache(env, tmp_path / "cache")
    assert _render(env, "t.j2", v=2) == "x=2\n"


def test_a_cache_file_that_is_a_link_is_not_followed(tmp_path):
    cache_file = _planted(tmp_path)
    elsewhere = tmp_path / "elsewhere"
    cache_file.rename(elsewhere)
    cache_file.symlink_to(elsewhere)
    env = render.environment(tmp_path)
    use_template_cache(env, tmp_path / "cache")
    assert _render(env, "t.j2", v=2) == "x=2\n"


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid needs root")
def test_a_cache_directory_of_another_uid_is_not_used(tmp_path):
    _planted(tmp_path)
    os.chown(tmp_path / "cache", OTHER_UID, -1)
    env = render.environment(tmp_path)
    assert use_template_cache(env, tmp_path / "cache") is False and env.bytecode_cache is None
    assert _render(env, "t.j2", v=2) == "x=2\n"


@pytest.mark.parametrize("mode", [0o770, 0o707, 0o777, 0o1777], ids=oct)
def test_a_cache_directory_others_can_write_is_not_used(tmp_path, mode):
    _planted(tmp_path)
    os.chmod(tmp_path / "cache", mode)
    env = render.environment(tmp_path)
    assert use_template_cache(env, tmp_path / "cache") is False
    assert _render(env, "t.j2", v=2) == "x=2\n"


def test_a_cache_directory_that_is_a_link_is_not_used(tmp_path):
    _planted(tmp_path)
    (tmp_path / "cache").rename(tmp_path / "real")
    (tmp_path / "cache").symlink_to(tmp_path / "real")
    env = render.environment(tmp_path)
    assert use_template_cache(env, tmp_path / "cache") is False
    assert _render(env, "t.j2", v=2) == "x=2\n"
