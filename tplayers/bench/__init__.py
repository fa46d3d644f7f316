"""Floor 7, bench: timing over ranks and the overlap microbenchmark."""
from .overlap import *  # noqa: F401,F403
