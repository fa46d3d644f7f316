"""Floor 6, testing: the persistent rank world and assert_matches_dense (public, for your modules)."""
from .world import *  # noqa: F401,F403
from .world import __all__
