"""facts.sections: the one section-marker convention (a fact's `@@ NAME`, a batched probe's
`@@pvegpu-section NAME` around whole facts' outputs)."""

import subprocess

from facts.sections import PROBE_SECTION, SECTION, section_echo, split_sections


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
