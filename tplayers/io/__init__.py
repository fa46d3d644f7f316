"""Floor 6, io: sharded checkpoints that reshard (DCP) and dense safetensors import/export.

    walk.py         the model's persistent tensors with their placements; dense_state_dict
    publish.py      rank coordination: shared temporary names, rank-0 work raised everywhere, atomic renames
    unpickle.py     DCP metadata through an allow-list unpickler
    dcp.py          save_checkpoint / load_checkpoint at any TP size (optimizer= too)
    optim_state.py  an optimizer's state as checkpoint entries, each tensor placed like its parameter
    safetensors.py  save_dense / load_dense in Hugging Face's layout
    state_dict.py   pure whole-state-dict shard / unshard / reshard (tplayers.io.state_dict)
"""
from .dcp import load_checkpoint, save_checkpoint
from .safetensors import load_dense, save_dense
from .walk import CheckpointError, dense_state_dict

__all__ = ["save_checkpoint", "load_checkpoint", "save_dense", "load_dense", "dense_state_dict", "CheckpointError"]
