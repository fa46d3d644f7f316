"""Floor 7, testing: verify TP modules the way tplayers verifies itself (public, for your modules).

    world.py        World: persistent spawned ranks (gloo on loopback), never a hang
    dense_match.py  assert_matches_dense: outputs, input and parameter gradients vs dense
"""
from .dense_match import MatchReport, assert_matches_dense, default_tolerance, dense_parameters
from .world import FORKSERVER_PRELOAD, RankFailed, World, WorldError, WorldTimeout, get_world, shutdown_worlds

__all__ = ["World", "FORKSERVER_PRELOAD", "WorldError", "RankFailed", "WorldTimeout", "get_world", "shutdown_worlds",
           "assert_matches_dense", "MatchReport", "dense_parameters", "default_tolerance"]
