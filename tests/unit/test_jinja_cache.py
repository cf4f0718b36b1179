"""compat.jinja_cache: a template compiled once is read back compiled by the next process's
environment; a changed template is compiled again; an unusable cache costs a compile, never
the render."""

from __future__ import annotations

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
