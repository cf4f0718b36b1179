from tests.twin.fixtures import *  # noqa: F401,F403  (twin_factory, twin_root_cache)
