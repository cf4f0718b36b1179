"""facts.sections: the one section-marker convention (a fact's `@@ NAME`, a batched probe's
`@@pvegpu-section NAME` around whole facts' outputs)."""

import subprocess

from facts.sections import PROBE_SECTION, SECTION, parse_sections, section_echo, split_sections


def test_lines_before_the_first_marker_are_dropped_and_names_are_stripped():
    lines = ["noise", "@@ a ", "1", "@@ /etc/x y.conf", "2", "3"]
    assert split_sections(lines) == {"a": ["1"], "/etc/x y.conf": ["2", "3"]}


def test_a_probe_section_keeps_the_nested_facts_markers_for_its_parser():
    output = [f"{PROBE_SECTION}boot_loader", "@@ firmware", "uefi", f"{PROBE_SECTION}cmdline", "ro quiet"]
    probe = split_sections(output, PROBE_SECTION)
    assert probe == {"boot_loader": ["@@ firmware", "uefi"], "cmdline": ["ro quiet"]}
    assert split_sections(probe["boot_loader"]) == {"firmware": ["uefi"]}
    assert not PROBE_SECTION.startswith(SECTION) and not SECTION.startswith(PROBE_SECTION)


def test_section_echo_prints_exactly_the_marker_line():
    for name in ("nvidia", "ct 200", "it's $HOME `x`"):
        out = subprocess.run(["sh", "-c", section_echo(name)], capture_output=True, text=True, check=True).stdout
        assert split_sections(out.splitlines() + ["body"]) == {name: ["body"]}


def test_parse_sections_hands_each_named_section_to_its_parser_in_the_parsers_order():
    output = ["noise", "@@ b", "2", "3", "@@ unread", "x", "@@ a", "1", "@@ b", "4"]
    parsed = parse_sections(output, {"a": len, "b": list, "missing": list})
    assert parsed == {"a": 1, "b": ["2", "3", "4"], "missing": []}  # a repeated name continues its section
    assert list(parsed) == ["a", "b", "missing"]


def test_parse_sections_of_a_probe_leaves_the_nested_markers_to_the_section_parser():
    output = [f"{PROBE_SECTION}boot_loader", "@@ firmware", "uefi", f"{PROBE_SECTION}cmdline", "ro quiet"]
    parsed = parse_sections(output, {"boot_loader": split_sections, "cmdline": lambda lines: lines[0].split()},
                            PROBE_SECTION)
    assert parsed == {"boot_loader": {"firmware": ["uefi"]}, "cmdline": ["ro", "quiet"]}
    assert parse_sections(iter(output), {"cmdline": list}, PROBE_SECTION) == {"cmdline": ["ro quiet"]}  # any iterable
    assert parse_sections([], {"boot_loader": split_sections}) == {"boot_loader": {}}
