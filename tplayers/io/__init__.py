"""Floor 5, io: sharded checkpoints that reshard (DCP) and dense safetensors import/export."""
from .checkpoint import *  # noqa: F401,F403
from .checkpoint import __all__ as _checkpoint_all

__all__ = list(_checkpoint_all)
