"""The ccache checks of tests/e2e/test_driver_build.py on real `ccache --print-stats` output
(issue 28 part 6): they fail where ccache was not used or answered nothing from its cache.

Recorded with Debian bookworm's ccache 4.7.5 (the twin root's), CCACHE_DIR a fresh directory:
EMPTY right after creating it; WARM after `ccache gcc -c a.c -o a.o` twice (one miss, one hit).
"""
import pytest

from tests.e2e.test_driver_build import ccache_compiles, ccache_counters, ccache_hits

EMPTY = """\
autoconf_test	0
bad_compiler_arguments	0
bad_output_file	0
cache_miss	0
cache_size_kibibyte	0
called_for_link	0
called_for_preprocessing	0
cleanups_performed	0
compile_failed	0
compiler_check_failed	0
compiler_produced_empty_output	0
compiler_produced_no_output	0
compiler_produced_stdout	0
could_not_find_compiler	0
could_not_use_modules	0
could_not_use_precompiled_header	0
direct_cache_hit	0
direct_cache_miss	0
error_hashing_extra_file	0
files_in_cache	0
internal_error	0
local_storage_hit	0
local_storage_miss	0
local_storage_read_hit	0
local_storage_read_miss	0
local_storage_write	0
missing_cache_file	0
multiple_source_files	0
no_input_file	0
output_to_stdout	0
preprocessed_cache_hit	0
preprocessed_cache_miss	0
preprocessor_error	0
recache	0
remote_storage_error	0
remote_storage_hit	0
remote_storage_miss	0
remote_storage_read_hit	0
remote_storage_read_miss	0
remote_storage_timeout	0
remote_storage_write	0
stats_updated_timestamp	0
stats_zeroed_timestamp	0
unsupported_code_directive	0
unsupported_compiler_option	0
unsupported_environment_variable	0
unsupported_source_language	0
"""

WARM = """\
autoconf_test	0
bad_compiler_arguments	0
bad_output_file	0
cache_miss	1
cache_size_kibibyte	8
called_for_link	0
called_for_preprocessing	0
cleanups_performed	0
compile_failed	0
compiler_check_failed	0
compiler_produced_empty_output	0
compiler_produced_no_output	0
compiler_produced_stdout	0
could_not_find_compiler	0
could_not_use_modules	0
could_not_use_precompiled_header	0
direct_cache_hit	1
direct_cache_miss	1
error_hashing_extra_file	0
files_in_cache	2
internal_error	0
local_storage_hit	1
local_storage_miss	1
local_storage_read_hit	2
local_storage_read_miss	2
local_storage_write	2
missing_cache_file	0
multiple_source_files	0
no_input_file	0
output_to_stdout	0
preprocessed_cache_hit	0
preprocessed_cache_miss	1
preprocessor_error	0
recache	0
remote_storage_error	0
remote_storage_hit	0
remote_storage_miss	0
remote_storage_read_hit	0
remote_storage_read_miss	0
remote_storage_timeout	0
remote_storage_write	0
stats_updated_timestamp	1796360634
stats_zeroed_timestamp	0
unsupported_code_directive	0
unsupported_compiler_option	0
unsupported_environment_variable	0
unsupported_source_language	0
"""


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
