"""Twin fixtures for every test under tests/twin/ (see tests/twin/fixtures.py)."""

from tests.twin.fixtures import kpro6_installed_root, kpro6_tmp_root, twin_factory, twin_root_cache  # noqa: F401
