"""The ccache checks of tests/e2e/test_driver_build.py on real `ccache --print-stats` output
(issue 28 part 6): they fail where ccache was not used or answered nothing from its cache.

The outputs (tests/fixtures/ccache/, headers say how each was recorded): Debian bookworm's ccache
4.7.5 (the twin root's), CCACHE_DIR a fresh directory: EMPTY right after creating it; WARM after
`ccache gcc -c a.c -o a.o` twice (one miss, one hit).
"""
from pathlib import Path

import pytest

from tests.e2e.test_driver_build import ccache_compiles, ccache_counters, ccache_hits


def fixture_text(relpath: str) -> str:
    """A recorded output without its two header lines (tests/fixtures/README.md)."""
    lines = (Path(__file__).resolve().parents[1] / "fixtures" / relpath).read_text().splitlines(keepends=True)
    return "".join(lines[2:])


EMPTY = fixture_text("ccache/print-stats-empty-4.7.5.txt")
WARM = fixture_text("ccache/print-stats-warm-4.7.5.txt")


def test_an_empty_cache_prints_cache_miss_too():
    """Why `"cache_miss" in stats` proved nothing: a cache never used prints it as well."""
    assert "cache_miss" in EMPTY
    assert ccache_counters(EMPTY)["cache_miss"] == 0 and ccache_hits(EMPTY) == 0 and ccache_compiles(EMPTY) == 0


def test_hits_show_only_after_a_compile_came_from_the_cache():
    assert ccache_counters(WARM)["cache_miss"] == 1
    assert ccache_hits(WARM) - ccache_hits(EMPTY) == 1  # the e2e's "hits > 0 on the rebuild"
    assert ccache_hits(EMPTY) - ccache_hits(EMPTY) == 0  # a rebuild that bypassed ccache fails it
    assert ccache_compiles(WARM) == 2 and ccache_compiles(WARM) != ccache_compiles(EMPTY)


@pytest.mark.parametrize("text", ["", "ccache: command not found\n", "cache_miss 0\n",
                                  "direct_cache_hit\t1\npreprocessed_cache_hit\t0\n"])
def test_text_that_is_not_ccache_stats_is_refused(text):
    with pytest.raises(ValueError):
        ccache_counters(text)
