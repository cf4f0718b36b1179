"""The spec file is parsed by libyaml where PyYAML has it, and means and is refused exactly as
with PyYAML's pure-Python loader.

Every case is read twice, by the libyaml path and by the pure-Python one (`spec.load._LIBYAML`
set false, as on a PyYAML built without libyaml), and the two outcomes (the data, or the whole
SpecError message) must be equal. The cases are the loader's refusals (duplicate keys, keys equal
once coerced, constructor errors at their line, lone surrogates, characters PyYAML's reader
refuses, nesting, aliases that multiply or never end, empty and non-mapping files) and the texts
the two parsers read differently (yaml-test-suite cases and mutated inventories showed them):
those must go to the pure-Python path.
"""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest
import yaml

import spec.load as L
from spec.load import MAX_DEPTH, SpecError

REPO = Path(__file__).resolve().parents[3]
INVENTORIES = sorted((REPO / "inventories").glob("*.yml"))
needs_libyaml = pytest.mark.skipif(not yaml.__with_libyaml__, reason="this PyYAML is built without libyaml")


def outcome(path: Path, libyaml: bool, monkeypatch: pytest.MonkeyPatch) -> tuple:
    """("ok", data) or ("refused", message) of _read_yaml, and how often PyYAML's pure-Python
    scanner ran."""
    calls = []
    fetch = yaml.scanner.Scanner.fetch_more_tokens

    def counted(self):
        calls.append(1)
        return fetch(self)

    with monkeypatch.context() as m:
        m.setattr(yaml.scanner.Scanner, "fetch_more_tokens", counted)
        if not libyaml:
            m.setattr(L, "_LIBYAML", False, raising=False)
        try:
            got: tuple = ("ok", _typed(L._read_yaml(path)))
        except SpecError as exc:
            got = ("refused", str(exc))
    return got, len(calls)


def _typed(value):
    """The data with every value's type beside it (True == 1 == 1.0 in Python)."""
    if isinstance(value, dict):
        return {_typed(k): _typed(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_typed(v) for v in value]
    return (type(value).__name__, value if value == value else repr(value))  # NaN


def both(tmp_path: Path, text: str, monkeypatch: pytest.MonkeyPatch) -> tuple[tuple, int]:
    f = tmp_path / "site.yml"
    f.write_bytes(text.encode("utf-8", "surrogatepass"))
    fast, python_scans = outcome(f, True, monkeypatch)
    slow, _ = outcome(f, False, monkeypatch)
    assert fast == slow
    return fast, python_scans


# ------------------------------------------------------------------ libyaml reads the specs

@needs_libyaml
@pytest.mark.parametrize("inventory", INVENTORIES, ids=lambda p: p.name)
def test_the_inventories_are_parsed_by_libyaml_and_read_as_before(inventory, monkeypatch):
    fast, python_scans = outcome(inventory, True, monkeypatch)
    slow, slow_scans = outcome(inventory, False, monkeypatch)
    assert fast[0] == "ok" and fast == slow
    assert python_scans == 0 and slow_scans > 50


@needs_libyaml
def test_reading_a_spec_takes_a_fraction_of_the_pure_python_time(monkeypatch):
    path = REPO / "inventories" / "twin.yml"
    L._read_yaml(path)
    fast, slow = [], []
    for _ in range(7):  # alternated, the fastest of each: what the machine's load adds falls out
        start = time.perf_counter()
        L._read_yaml(path)
        fast.append(time.perf_counter() - start)
        with monkeypatch.context() as m:
            m.setattr(L, "_LIBYAML", False, raising=False)
            start = time.perf_counter()
            L._read_yaml(path)
            slow.append(time.perf_counter() - start)
    assert min(fast) < 0.5 * min(slow), (min(fast), min(slow))  # ~0.25 measured


# ------------------------------------------------------------------ the same refusals from both

DEEP_BLOCK = "hosts:\n" + "".join("  " * i + f"k{i}:\n" for i in range(1, MAX_DEPTH + 2)) + "  " * (MAX_DEPTH + 2) + "x\n"
LAUGHS = ("a: &a [x,x,x,x,x,x,x,x,x]\n" + "".join(
    f"{n}: &{n} [{', '.join(['*' + p] * 9)}]\n" for p, n in zip("abcdef", "bcdefg", strict=True)) + "hosts: {kpro6: {iommu: {params: *g}}}\n")


@needs_libyaml
@pytest.mark.parametrize("text, words", [
    ("hosts:\n  kpro6: {}\n  kpro6: {}\n", "key 'kpro6' appears twice (first on line 2)"),
    ("hosts:\n  kpro6:\n    containers:\n      200: {}\n      \"200\": {}\n", "key '200' and key 200 (line 4) are the same key once read as int"),
    ("hosts:\n  kpro6: {}\n  !!binary a3BybzY=: {}\n", "same key once read as str"),
    ("hosts: {é: 1, é: 2}\n", "appears twice (first on line 1); each key, e.g. a GPU address or guest ID, may appear "
                             "once (line 1, column 15)"),
    ("hosts:\n  kpro6:\n    node: !!int abc\n", "'abc' is not a valid !!int (invalid literal"),
    ("hosts:\n  kpro6:\n    node: !!bool maybe\n", "'maybe' is not a valid !!bool"),
    ("hosts:\n  kpro6:\n    node: " + "9" * 4301 + "\n", "more than 4300 digits"),
    ("hosts:\n  kpro6:\n    node: \"\\ud800\"\n", "lone UTF-16 surrogate (written as an escape like \\ud800) is no "
                                                "character; no file or SSH command can hold it (line 3, column 11)"),
    ("hosts:\n  kpro6:\n    node: !!python/object:os.system x\n", "could not determine a constructor"),
    ("hosts:\n  ? [a, b]\n  : {}\n", "a key here is a list or mapping"),
    ("hosts:\n  kpro6:\n    node: a\x00b\n", "line 3: the character U+0000 is not allowed"),
    ("hosts:\n  kpro6:\n    node: a\x1bb\n", "the character U+001B is not allowed"),
    ("# \x07 in a comment\nhosts: {kpro6: {}}\n", "line 1: the character U+0007 is not allowed"),
    ("hosts: {kpro6: [unclosed}\n" + "# \x07\n", "U+0007 is not allowed"),  # the character, not the syntax error
    ("hosts: {kpro6: {node: \uffff}}\n", "U+FFFF is not allowed"),
    ("hosts: {kpro6: {iommu: {params: " + "[" * 5000 + "]" * 5000 + "}}}\n", f"nested more than {MAX_DEPTH} levels"),
    (DEEP_BLOCK, f"nested more than {MAX_DEPTH} levels deep (line {MAX_DEPTH + 1})"),
    (LAUGHS, f"expands to more than {L.MAX_NODES} values"),
    ("hosts: &h\n  kpro6: {iommu: {params: *h}}\n", "an alias on line 1 refers to a node that contains it"),
    ("", "is empty"),
    ("# only a comment\n", "is empty"),
    ("hosts: {kpro6: {}}\n---\nhosts: {kpro7: {}}\n", "expected a single document in the stream (line 1, column 1); "
                                                      "but found another document (line 2, column 1)"),
    ("hosts: {kpro6: {ssh: {hostname: [unclosed}}\n", "expected ',' or ']', but got '}' (line 1, column 42)"),
    ("hosts:\n  kpro6: node: a\n", "mapping values are not allowed here (line 2, column 14)"),  # libyaml: "in this context"
    ("hosts:\n  kpro6: {node: *nowhere}\n", "found undefined alias 'nowhere'"),
    ("hosts:\n  kpro6: {a: &x 1, b: &x 2}\n", "found duplicate anchor 'x'; first occurrence (line 2, column 14)"),
])
def test_each_refusal_is_the_same_sentence_from_both_readers(tmp_path, monkeypatch, text, words):
    got, _ = both(tmp_path, text, monkeypatch)
    assert got[0] == "refused" and words in got[1], got


# The texts the two parsers read differently (libyaml's scanner.c and parser.c against PyYAML's
# scanner.py and parser.py; found on yaml-test-suite's cases and mutated inventories): each is
# read by the pure-Python parser, as it was before libyaml read specs.
@needs_libyaml
@pytest.mark.parametrize("text", [
    "hosts: {kpro6: {iommu: {params: [pci?x]}}}\n",  # libyaml: a plain scalar; PyYAML: a key
    "hosts: {kpro6: {node: a?b}}\n",
    "hosts:\n  kpro6:\n    node: !\n",  # null to PyYAML, "" to libyaml
    "%YAML 1.1#x\n---\nhosts: {kpro6: {}}\n",  # libyaml takes the directive, PyYAML refuses it
    "%FOO bar\n---\nhosts: {kpro6: {}}\n",  # PyYAML takes an unknown directive, libyaml refuses it
    "hosts:\n  kpro6:\n    node: |-#c\n      a\n",  # a comment to libyaml, an error to PyYAML
    "hosts:\n  kpro6:\n    iommu: {params: [a,\tb]}\n",  # libyaml skips the tab, PyYAML refuses it
    "hosts:\n  kpro6:\n    node:\ta\n",
    "hosts:\n\ufeff  kpro6: {}\n",  # libyaml skips a BOM at each line's start, PyYAML only at the text's
    "hosts:\n  kpro6: {node: a\x85b}\n",
    "hosts:\n  kpro6: {node: a\u2028b}\n",
    "hosts:\n  kpro6:\n    node: a\u2029  b\n",
])
def test_text_the_parsers_read_differently_is_read_by_pyyaml(tmp_path, monkeypatch, text):
    _, python_scans = both(tmp_path, text, monkeypatch)
    assert python_scans > 0


@needs_libyaml
def test_a_bom_at_the_start_and_text_beyond_ascii_stay_with_libyaml(tmp_path, monkeypatch):
    got, python_scans = both(tmp_path, "\ufeffhosts:\n  kpro6: {node: \"é😀\", nvidia: {nvreg: {x: 'y'}}}\n", monkeypatch)
    assert got == ("ok", {("str", "hosts"): {("str", "kpro6"): {
        ("str", "node"): ("str", "é😀"), ("str", "nvidia"): {("str", "nvreg"): {("str", "x"): ("str", "y")}}}}})
    assert python_scans == 0


@needs_libyaml
def test_nesting_is_refused_before_libyaml_composes(tmp_path, monkeypatch):
    """libyaml's composer is C recursing once per level with no limit of its own (PyYAML's
    _yaml.pyx, CParser._compose_node); only some libyaml builds stop at 1000 levels."""
    composed = []

    class Spy(L._CUniqueKeyLoader):
        def get_single_node(self):
            composed.append(1)
            return super().get_single_node()

    monkeypatch.setattr(L, "_CUniqueKeyLoader", Spy)
    f = tmp_path / "site.yml"
    f.write_text(DEEP_BLOCK)
    with pytest.raises(SpecError, match=f"nested more than {MAX_DEPTH} levels deep"):
        L._read_yaml(f)
    assert composed == []
    f.write_text("hosts: {kpro6: {}}\n")
    assert L._read_yaml(f) == {"hosts": {"kpro6": {}}} and composed == [1]


@needs_libyaml
def test_mutated_inventories_are_read_alike_by_both(tmp_path, monkeypatch):
    """Inventories with a few YAML-significant characters inserted, deleted or replaced (seeded):
    every outcome equal, and many read by libyaml alone (what libyaml refuses, PyYAML reads again)."""
    rnd = random.Random(26)
    texts = [p.read_text() for p in INVENTORIES]
    alphabet = list(" \n-:,[]{}#&*'\"\\\ra0é") + [": ", "- ", "\n  ", "&a ", "*a", "---\n", "...\n"]
    alphabet += list("?!%|>\t\ufeff\x85")  # each sends the text to PyYAML (test above)
    by_libyaml = 0
    for _ in range(120):
        text = rnd.choice(texts)
        for _ in range(rnd.randint(1, 3)):
            pos = rnd.randrange(len(text) + 1)
            text = text[:pos] + rnd.choice(alphabet) + text[pos + rnd.choice([0, 1, 2]):]
        got, python_scans = both(tmp_path, text, monkeypatch)
        by_libyaml += python_scans == 0
    assert by_libyaml > 30, by_libyaml
