"""Fact fixture tests in pyinfra's own style: every folder tests/unit/facts/<module>.<Fact>/
holds YAML cases (command, output, fact) built from real outputs in tests/fixtures/
(see tests/unit/facts/generate_cases.py); pyinfra-testing runs each case through the fact."""

from pathlib import Path

from pyinfra_testing.facts import make_fact_tests

CASES = Path(__file__).parent / "facts"

for _folder in sorted(p for p in CASES.iterdir() if p.is_dir() and "." in p.name):
    _test_class = make_fact_tests("facts", _folder.name, _folder)
    globals()[f"TestFact_{_folder.name.replace('.', '_')}"] = _test_class

del _folder, _test_class
