"""Floor 4, convert: parallelize an existing model from a plan; TP x DP meshes."""
from .parallelize import *  # noqa: F401,F403
from .parallelize import __all__ as _parallelize_all
from .mesh2d import Mesh2D, make_2d_mesh

__all__ = list(_parallelize_all) + ["Mesh2D", "make_2d_mesh"]
