"""Twin fixtures for every test under tests/twin/ (see tests/twin/fixtures.py)."""

from tests.twin.fixtures import twin_factory, twin_root_cache  # noqa: F401
