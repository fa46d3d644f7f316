"""Dense, unsharded safetensors in Hugging Face's layout: ``save_dense`` (rank 0 writes one file) and
``load_dense`` (a file, or an HF model directory sharded with an index or not; each rank reads only its
own slices with ``safe_open(...).get_slice``). GPT-2 ``Conv1D`` weights are stored ``(in, out)``."""
from __future__ import annotations

import copy
import json
import os
import uuid
from typing import Any, Dict, List, Mapping, Optional, Tuple

import torch
import torch.nn as nn

from .publish import coord_group, fsync_dir, on_rank0, require_same_path
from .walk import CheckpointError, Entry, dense_state_dict, entries, parts_of, refuse_meta, writable

__all__ = ["save_dense", "load_dense"]


def _safetensors() -> None:
    try:
        import safetensors  # noqa: F401
    except ImportError:
        raise ImportError("save_dense / load_dense need safetensors: pip install safetensors "
                          "(or tplayers[hf])") from None


def save_dense(model: nn.Module, path: str, *, group: Any = None, metadata: Optional[Dict[str, str]] = None,
               timeout: float = 300.0) -> None:
    """Write the unsharded state dict of ``model`` to one safetensors file (atomically, rank 0).

    Collective: every rank of ``group`` calls it (default: the whole world; the TP modules gather
    over their own TP groups, then rank 0 of ``group`` writes). The file is what the dense model's ``save_pretrained`` would write (Conv1D
    weights ``(in, out)``, tied weights once), so Hugging Face loads it. The directory is created
    if missing (as ``save_checkpoint`` does); a model with a Hugging Face ``config`` also gets its
    ``config.json`` beside the file, so ``from_pretrained(directory)`` loads a ``model.safetensors``.
    """
    _safetensors()
    from safetensors.torch import save_file

    path = os.path.abspath(os.fspath(path))
    if os.path.isdir(path):
        raise CheckpointError(f"save_dense: {path} is a directory; pass the file to write, e.g. {path}/model.safetensors")
    state = dense_state_dict(model)
    config = _hf_config(model)
    pg, rank = coord_group(group, "save_dense", timeout)
    require_same_path(pg, path, "save_dense")

    def write() -> None:
        directory = os.path.dirname(path)
        os.makedirs(directory, exist_ok=True)
        tmp = f"{path}.tmp-{uuid.uuid4().hex[:16]}"
        save_file({k: v.cpu() for k, v in state.items()}, tmp, metadata={"format": "pt", **(metadata or {})})
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
        if config is not None:
            tmp = os.path.join(directory, f"config.json.tmp-{uuid.uuid4().hex[:16]}")
            config.to_json_file(tmp)
            os.replace(tmp, os.path.join(directory, "config.json"))
        fsync_dir(directory)

    on_rank0(pg, rank, write)


def _hf_config(model: nn.Module) -> Any:
    """A copy of ``model``'s Hugging Face config naming its class (as ``save_pretrained`` writes it),
    or None for a model without one. Head counts stay the dense ones: plans never change the config."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "to_json_file"):
        return None
    config = copy.deepcopy(config)
    if hasattr(model, "_no_split_modules") or hasattr(model, "base_model_prefix"):  # a PreTrainedModel
        config.architectures = [type(model).__name__]
    return config


def _dense_files(path: str) -> Dict[str, str]:
    """{tensor name: file} for a safetensors file or a (possibly sharded) Hugging Face directory."""
    if os.path.isfile(path):
        files = [path]
    elif os.path.isdir(path):
        index = os.path.join(path, "model.safetensors.index.json")
        single = os.path.join(path, "model.safetensors")
        if os.path.isfile(index):
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
            # An index is data: it must not make us read files elsewhere on the machine. Checked lexically
            # (no "..", no absolute path), so the Hugging Face cache's layout, whose snapshot files are
            # symlinks into ../../blobs/, loads.
            root = os.path.normpath(os.path.abspath(path))
            files = {k: os.path.join(path, v) for k, v in weight_map.items()}
            outside = sorted({v for v in weight_map.values()
                              if os.path.commonpath([root, os.path.normpath(os.path.join(root, v))]) != root})
            if outside:
                raise CheckpointError(f"{index}: the index names files outside {path}: {outside[:3]}")
            return files
        if not os.path.isfile(single):
            raise CheckpointError(f"{path} holds neither model.safetensors nor model.safetensors.index.json")
        files = [single]
    else:
        raise CheckpointError(f"no safetensors file or directory at {path}")
    from safetensors import safe_open

    out = {}
    for fpath in files:
        with safe_open(fpath, framework="pt") as f:
            for k in f.keys():
                out[k] = fpath
    return out


def _lookup(names: Tuple[str, ...], files: Mapping[str, str], prefix: Optional[str]) -> Optional[str]:
    for n in names:
        candidates = [n]
        if prefix:
            candidates += [n[len(prefix) + 1:]] if n.startswith(prefix + ".") else [f"{prefix}.{n}"]
        for c in candidates:
            if c in files:
                return c
    return None


def _read_local(f: Any, key: str, e: Entry) -> torch.Tensor:
    """This rank's local tensor for entry ``e``, read slice by slice from the open file ``f``."""
    sl = f.get_slice(key)
    shape = tuple(sl.get_shape())
    full = e.full_shape()
    want = tuple(reversed(full)) if e.transposed else full
    if shape != want:
        raise CheckpointError(f"'{e.name}': the dense checkpoint has shape {shape} (key '{key}'), "
                              f"the model expects {want}")
    if e.layout is None:
        t = f.get_tensor(key)
        return t.t() if e.transposed else t
    assert e.group is not None
    d = e.layout.dim
    file_dim = (1 - d) if e.transposed else d
    pieces = []
    for _, _, part, piece in parts_of(e):  # this rank's rows of each part, then the part's zero padding
        index = [slice(None)] * len(shape)
        index[file_dim] = slice(piece.start, piece.start + piece.length)
        rows = sl[tuple(index)]
        if piece.length < part.local_size:
            pad_shape = list(rows.shape)
            pad_shape[file_dim] = part.local_size - piece.length
            rows = torch.cat([rows, rows.new_zeros(pad_shape)], dim=file_dim)
        pieces.append(rows)
    t = torch.cat(pieces, dim=file_dim) if len(pieces) > 1 else pieces[0]
    return t.t() if e.transposed else t


def load_dense(model: nn.Module, path: str, *, strict: bool = True,
               group: Any = None) -> Tuple[List[str], List[str]]:
    """Load an unsharded safetensors checkpoint (a file, or a Hugging Face model directory) into a
    TP (or dense) model; each rank reads only its own slices.

    Not collective: no communication, so each rank may call it on its own. ``group`` is accepted so
    that the four save/load calls share a signature; it is only checked (a ProcessGroup, a 1-D
    DeviceMesh or None, with this rank a member), never communicated over.

    Returns ``(missing, unexpected)`` names; with ``strict`` a missing tensor raises. Names may
    differ by the model's ``base_model_prefix`` (``transformer.``, ``model.``) as in HF files.
    """
    _safetensors()
    from safetensors import safe_open

    coord_group(group, "load_dense")
    path = os.fspath(path)
    files = _dense_files(path)
    prefix = getattr(model, "base_model_prefix", None) or None
    walked = entries(model)
    refuse_meta(walked, path)
    missing, used = [], set()
    handles: Dict[str, Any] = {}
    try:
        plan = []
        for e in walked:
            key = _lookup((e.name,) + e.aliases, files, prefix)
            if key is None:
                missing.append(e.name)
                continue
            plan.append((e, key))
            used.add(key)
        if strict and missing:
            raise CheckpointError(f"{path}: the dense checkpoint has no tensor for {missing}")
        with torch.no_grad():
            for e, key in plan:
                fpath = files[key]
                if fpath not in handles:
                    handles[fpath] = safe_open(fpath, framework="pt").__enter__()
                local = _read_local(handles[fpath], key, e)
                if local.shape != e.tensor.shape:
                    raise CheckpointError(f"'{e.name}': local shard has shape {tuple(local.shape)}, "
                                          f"the model's is {tuple(e.tensor.shape)}")
                target, finish = writable(e)  # (under FSDP2: a buffer, then this rank's piece of it)
                target.copy_(local)
                if finish is not None:
                    finish()
    finally:
        for h in handles.values():
            h.__exit__(None, None, None)
    unexpected = sorted(set(files) - used)
    return missing, unexpected
