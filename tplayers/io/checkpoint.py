"""Checkpoints of TP models that load at any TP size, and dense safetensors import/export.

Sharded (``save_checkpoint`` / ``load_checkpoint``): a ``torch.distributed.checkpoint`` (DCP)
directory. Every TP parameter is stored as its *full* (dense) tensor, described to DCP as a
``DTensor`` sharded over the TP group, so each rank writes only its own shard, identical shards
of data-parallel replicas are written once, and a load at another TP size reads exactly the
bytes each rank needs (DCP's own resharding). Fused parameters (q/k/v, gate/up) are stored per
part (``<name>.__part<i>``), so a shard is always one contiguous block of one part. A small JSON
manifest (``tplayers.json``) records every tensor's full shape and layout; loading compares it
with the model first and reports mismatches by parameter name.

Safety: a save writes into ``<path>.tmp-<token>`` and renames it to ``<path>`` only after every
rank finished, so an interrupted save never leaves a partial directory at ``<path>`` (and a
directory without the manifest, written last, is refused). Replacing an existing checkpoint
takes two renames (old aside to ``<path>.old-<token>``, new into place; directories cannot be
swapped atomically): a crash between them leaves no ``<path>``, the old one under that name. Loading never unpickles arbitrary objects: DCP's
pickled metadata is read with an unpickler that only admits DCP's own metadata classes, any
non-tensor entry (which DCP would ``torch.load`` with ``weights_only=False``) is refused, and
tensor data is read by DCP with ``torch.load(weights_only=True)``.

Dense (``save_dense`` / ``load_dense``): one safetensors file (or a Hugging Face checkpoint
directory, sharded with an index or not) holding the unsharded state dict under the original
model's names and orientation (GPT-2 ``Conv1D`` weights stored ``(in, out)`` as HF does).
``load_dense`` reads only this rank's slices (``safe_open(...).get_slice``).
"""
from __future__ import annotations

import contextlib
import json
import os
import pickle
import shutil
import uuid
import warnings
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Mapping, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn

from ..core.comm import broadcast_tensor, gather_placed
from ..core.groups import TPGroup, collective_device
from ..core.placement import Sharded
from ..layers.base import TensorParallelModule, placements_of

__all__ = ["save_checkpoint", "load_checkpoint", "save_dense", "load_dense", "dense_state_dict", "CheckpointError"]

MANIFEST = "tplayers.json"
FORMAT = "tplayers-dcp"
VERSION = 1


class CheckpointError(ValueError):
    """A checkpoint is missing, incomplete, or does not fit the model (the message names what)."""


# ---------------------------------------------------------------------------- model walk


@dataclass
class _Entry:
    """One state-dict tensor of the model: where it lives and how it maps to the full tensor."""

    name: str
    tensor: torch.Tensor  # the local tensor (the parameter/buffer itself)
    layout: Optional[Sharded]  # None: replicated
    tp: Optional[TPGroup]
    transposed: bool  # dense form stores the transpose (GPT-2 Conv1D weight)
    aliases: Tuple[str, ...] = ()  # other names of the same (tied) tensor

    def full_shape(self) -> Tuple[int, ...]:
        return self.layout.full_shape(self.tensor.shape) if self.layout is not None else tuple(self.tensor.shape)


def _entries(model: nn.Module) -> List[_Entry]:
    """Every persistent parameter and buffer of ``model``, tied tensors once (first name wins)."""
    out: List[_Entry] = []
    seen: Dict[int, _Entry] = {}
    for mod_name, mod in model.named_modules():
        prefix = f"{mod_name}." if mod_name else ""
        layouts = placements_of(mod)
        tensors = [(n, t) for n, t in mod._parameters.items() if t is not None]
        tensors += [(n, t) for n, t in mod._buffers.items()
                    if t is not None and n not in mod._non_persistent_buffers_set]
        for pname, t in tensors:
            name = prefix + pname
            if type(t).__name__ == "DTensor" or type(getattr(t, "data", None)).__name__ == "DTensor":
                raise CheckpointError(f"'{name}' is a DTensor (FSDP2 or DTensor TP): tplayers checkpoints handle "
                                      "tplayers TP modules (plain or DDP-wrapped); use torch.distributed.checkpoint "
                                      "with get_model_state_dict for FSDP2-sharded models")
            if id(t) in seen:
                seen[id(t)].aliases += (name,)
                continue
            layout = layouts.get(pname)
            if layout is not None and not layout.is_sharded:
                layout = None
            tp = mod.tp if isinstance(mod, TensorParallelModule) else None
            e = _Entry(name, t, layout, tp, bool(getattr(mod, "dense_transposed", False)) and pname == "weight")
            seen[id(t)] = e
            out.append(e)
    return out


def _refuse_meta(entries: List[_Entry], path: str) -> None:
    """Loading into meta tensors is a silent no-op (copy_ into meta does nothing): refuse it."""
    meta = [e.name for e in entries if e.tensor.device.type == "meta"]
    if meta:
        raise CheckpointError(f"{path}: cannot load into tensors on the meta device {meta[:5]}"
                              f"{' ...' if len(meta) > 5 else ''}; allocate them first "
                              "(model.to_empty(device=...), then re-tie tied weights)")


def _parts(e: _Entry) -> Iterator[Tuple[str, int, Any, Any]]:
    """(key, full offset, Part, this rank's Piece) of each part of a sharded entry."""
    assert e.layout is not None and e.tp is not None
    multi = len(e.layout.parts) > 1
    full_off = 0
    for i, (part, piece) in enumerate(zip(e.layout.parts, e.layout.pieces(e.tp.rank, e.tp.size))):
        yield (f"{e.name}.__part{i}" if multi else e.name), full_off, part, piece
        full_off += part.size


def _layout_record(e: _Entry) -> Optional[Dict[str, Any]]:
    if e.layout is None:
        return None
    return {"dim": e.layout.dim, "parts": [part.size for part in e.layout.parts]}


# ---------------------------------------------------------------------------- DCP state dicts


def _mesh(tp: TPGroup, device: torch.device, cache: Dict[int, Any]) -> Any:
    from torch.distributed.device_mesh import DeviceMesh

    key = id(tp.process_group)
    if key not in cache:
        cache[key] = DeviceMesh.from_group(tp.process_group, device_type=device.type)
    return cache[key]


def _contiguous_stride(shape: Tuple[int, ...]) -> Tuple[int, ...]:
    stride, acc = [], 1
    for s in reversed(shape):
        stride.append(acc)
        acc *= s
    return tuple(reversed(stride))


def _dcp_state(model: nn.Module, *, for_save: bool) -> Tuple[Dict[str, Any], List[Tuple[torch.Tensor, torch.Tensor]]]:
    """The DCP state dict of ``model`` and, for loading, (buffer, destination) copies to do after.

    Each part of a sharded parameter is a DTensor ``Shard(dim)`` over the TP group whose local
    tensor is this rank's piece (views of the parameters when loading, so DCP writes straight into
    them): a placement's piece of a part cut into p shards is exactly DTensor's chunk, padded
    vocabularies included. A part with replicas (fewer shards than ranks) is saved as the rank's
    sub-chunk when it divides, else as the full gathered part; it is loaded in full.
    """
    state: Dict[str, Any] = {}
    post: List[Tuple[torch.Tensor, torch.Tensor]] = []
    meshes: Dict[int, Any] = {}
    for e in _entries(model):
        t = e.tensor.detach()
        if e.layout is None:
            state[e.name] = t.clone() if for_save else t
            continue
        assert e.tp is not None
        p, r, d = e.tp.size, e.tp.rank, e.layout.dim
        for key, full_off, part, piece in _parts(e):
            local = t.narrow(d, piece.local_start, piece.length)
            shape = list(t.shape)
            shape[d] = part.size
            shape_t = tuple(shape)
            if p == 1:
                state[key] = local.clone() if for_save else local
            elif part.shards == p:
                chunk = local.contiguous().clone() if for_save else local
                state[key] = _dtensor(chunk, e.tp, d, shape_t, meshes)
            elif for_save and part.size % p == 0:
                sub = local.chunk(p // part.shards, dim=d)[r % (p // part.shards)].contiguous().clone()
                state[key] = _dtensor(sub, e.tp, d, shape_t, meshes)
            elif for_save:
                state[key] = gather_placed(local, Sharded.split(d, part.size, part.shards), group=e.tp)
            else:
                full = torch.empty(shape_t, dtype=t.dtype, device=t.device)
                state[key] = full
                post.append((full.narrow(d, piece.start - full_off, piece.length), local))
    return state, post


def _dtensor(local: torch.Tensor, tp: TPGroup, dim: int, shape: Tuple[int, ...], meshes: Dict[int, Any]) -> Any:
    """``local`` as this rank's ``Shard(dim)`` chunk of a DTensor of ``shape`` over the TP group."""
    from torch.distributed.tensor import DTensor, Shard

    return DTensor.from_local(local, _mesh(tp, local.device, meshes), [Shard(dim)], run_check=False,
                              shape=shape, stride=_contiguous_stride(shape))


def _manifest(model: nn.Module) -> Dict[str, Any]:
    tp_sizes = {e.tp.size for e in _entries(model) if e.tp is not None}
    return {
        "format": FORMAT,
        "version": VERSION,
        "tp_size": max(tp_sizes) if tp_sizes else 1,
        "tensors": {e.name: {"shape": list(e.full_shape()), "dtype": str(e.tensor.dtype).replace("torch.", ""),
                             "layout": _layout_record(e), "aliases": list(e.aliases)}
                    for e in _entries(model)},
    }


# ---------------------------------------------------------------------------- coordination


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """DCP warns that it runs single-process when torch.distributed is not initialized: intended here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _coord_group(process_group: Any) -> Tuple[Any, int]:
    """(group for the collective save/load, this process's rank in it); (None, 0) without dist."""
    if not (dist.is_available() and dist.is_initialized()):
        return None, 0
    pg = process_group if process_group is not None else dist.group.WORLD
    return pg, dist.get_rank(pg)


def _agree_token(pg: Any, rank: int) -> str:
    """A random token drawn on rank 0 and broadcast (all ranks name the same temporary dir)."""
    token = torch.tensor([uuid.uuid4().int % (2**62) if rank == 0 else 0], dtype=torch.int64)
    if pg is not None:
        token = broadcast_tensor(token.to(collective_device(pg)), 0, group=pg).cpu()
    return f"{int(token.item()):016x}"


def _on_rank0(pg: Any, rank: int, fn: Any) -> None:
    """Run ``fn`` on rank 0 only, then make every rank raise if it failed (no rank left waiting).

    Rank 0 re-raises its own exception; the others raise :class:`CheckpointError` carrying its
    message (broadcast as bytes), so an error on rank 0 alone never hangs the rest in a collective.
    """
    error: Optional[BaseException] = None
    if rank == 0:
        try:
            fn()
        except Exception as e:  # noqa: BLE001 (re-raised below, after the others heard of it)
            error = e
    if pg is None:
        if error is not None:
            raise error
        return
    msg = torch.zeros(1024, dtype=torch.uint8)
    if error is not None:
        text = f"{type(error).__name__}: {error}".encode()[:1023] or b"?"
        msg[:len(text)] = torch.tensor(list(text), dtype=torch.uint8)
    msg = broadcast_tensor(msg.to(collective_device(pg)), 0, group=pg).cpu()
    if error is not None:
        raise error
    if msg[0]:
        text = bytes(msg[msg.nonzero().flatten()].tolist()).decode(errors="replace")
        raise CheckpointError(f"rank 0 failed to finish the save: {text}")


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _write_json(path: str, obj: Any) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())


# ---------------------------------------------------------------------------- safe metadata


class _MetadataUnpickler(pickle.Unpickler):
    """Admits only what DCP's ``.metadata`` contains: its dataclasses, torch sizes/dtypes, paths.

    Names are matched exactly (an allowlist of ``(module, name)``): a dotted name would walk from an
    allowed module to anything it imports (``...filesystem`` -> ``subprocess.Popen``).
    """

    _ALLOWED = {
        "torch.distributed.checkpoint.metadata": {
            "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
            "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING"},
        "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
        "torch.serialization": {"_get_layout"},
        "torch": {"Size"},
        "pathlib": {"PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath", "Path"},
        "collections": {"OrderedDict"},
    }

    def find_class(self, module: str, name: str) -> Any:
        if name in self._ALLOWED.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format)):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"checkpoint metadata refers to {module}.{name}, which tplayers does not load")


def _safe_reader(path: str) -> Any:
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata

    class _SafeReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            with open(os.path.join(str(self.path), ".metadata"), "rb") as f:
                metadata = _MetadataUnpickler(f).load()
            if not isinstance(metadata, Metadata):
                raise pickle.UnpicklingError(f".metadata holds a {type(metadata).__name__}, not DCP Metadata")
            for key, md in metadata.state_dict_metadata.items():
                # DCP loads non-tensor ("bytes") entries with torch.load(weights_only=False): refuse them
                if not isinstance(md, TensorStorageMetadata):
                    raise pickle.UnpicklingError(f"entry '{key}' is not a tensor ({type(md).__name__}); "
                                                 "tplayers checkpoints hold tensors only")
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return _SafeReader(path)


# ---------------------------------------------------------------------------- public API


def save_checkpoint(model: nn.Module, path: str, *, process_group: Any = None) -> None:
    """Save ``model`` (TP or not, any TP size) as a DCP checkpoint directory at ``path``.

    Collective: every rank of ``process_group`` (default: the whole world) calls it. Replaces an
    existing checkpoint at ``path`` only once the new one is complete.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    path = os.path.abspath(os.fspath(path))
    pg, rank = _coord_group(process_group)
    tmp = f"{path}.tmp-{_agree_token(pg, rank)}"
    state, _ = _dcp_state(model, for_save=True)
    manifest = _manifest(model)
    with _quiet():
        dcp.save(state, storage_writer=FileSystemWriter(tmp), process_group=pg, no_dist=pg is None)

    def publish() -> None:
        _write_json(os.path.join(tmp, MANIFEST), manifest)
        _fsync_dir(tmp)
        old = f"{path}.old-{os.path.basename(tmp)[-16:]}"
        if os.path.exists(path):
            os.rename(path, old)
        os.rename(tmp, path)
        _fsync_dir(os.path.dirname(path))
        shutil.rmtree(old, ignore_errors=True)

    _on_rank0(pg, rank, publish)


def _read_manifest(path: str) -> Dict[str, Any]:
    if not os.path.isdir(path):
        raise CheckpointError(f"no checkpoint directory at {path}")
    mpath = os.path.join(path, MANIFEST)
    if not os.path.isfile(mpath) or not os.path.isfile(os.path.join(path, ".metadata")):
        raise CheckpointError(f"{path} is not a complete tplayers checkpoint (no {MANIFEST} or .metadata)")
    with open(mpath) as f:
        manifest = json.load(f)
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"{path}: unknown checkpoint format {manifest.get('format')!r}")
    return manifest


def _check_against(manifest: Dict[str, Any], model: nn.Module, path: str) -> None:
    saved = manifest["tensors"]
    mine = _manifest(model)["tensors"]
    missing = sorted(set(mine) - set(saved))
    unexpected = sorted(set(saved) - set(mine))
    if missing or unexpected:
        raise CheckpointError(f"{path}: checkpoint and model hold different tensors: missing from the checkpoint "
                              f"{missing}, not in the model {unexpected}")
    for name, want in mine.items():
        have = saved[name]
        if have["shape"] != want["shape"]:
            raise CheckpointError(f"{path}: '{name}' has full shape {tuple(have['shape'])} in the checkpoint, "
                                  f"the model expects {tuple(want['shape'])}")
        lh, lw = have["layout"], want["layout"]
        parts_h = lh["parts"] if lh else [None]
        parts_w = lw["parts"] if lw else [None]
        if (len(parts_h) > 1 or len(parts_w) > 1) and lh != lw:
            raise CheckpointError(f"{path}: '{name}' was saved with TP layout {lh} (fused parts along dim), "
                                  f"the model's layer has {lw}")


def load_checkpoint(model: nn.Module, path: str, *, process_group: Any = None) -> None:
    """Load a :func:`save_checkpoint` directory into ``model`` at any TP size (bit-exact).

    Collective over ``process_group`` (default: the whole world). Raises :class:`CheckpointError`
    naming the tensor when names, full shapes or fused layouts differ.
    """
    import torch.distributed.checkpoint as dcp

    path = os.path.abspath(os.fspath(path))
    _check_against(_read_manifest(path), model, path)
    _refuse_meta(_entries(model), path)
    reader = _safe_reader(path)
    try:
        reader.read_metadata()  # refuse a tampered .metadata here, with a clear error, before DCP reads it
    except pickle.UnpicklingError as e:
        raise CheckpointError(f"{path}: refusing to load .metadata: {e}") from None
    pg, _ = _coord_group(process_group)
    state, post = _dcp_state(model, for_save=False)
    with torch.no_grad():
        with _quiet():
            dcp.load(state, storage_reader=reader, process_group=pg, no_dist=pg is None)
        for src, dst in post:
            dst.copy_(src)


# ---------------------------------------------------------------------------- dense (safetensors)


def _full_tensor(e: _Entry) -> torch.Tensor:
    """The dense tensor of one entry, in the original model's orientation (collective over its TP group)."""
    t = e.tensor.detach()
    if e.layout is not None:
        assert e.tp is not None
        t = gather_placed(t, e.layout, group=e.tp)
    if e.transposed:
        t = t.t()
    return t.contiguous()


def dense_state_dict(model: nn.Module) -> Dict[str, torch.Tensor]:
    """The unsharded state dict of a TP model, as the dense model would name and shape it.

    Collective over the model's TP groups. Tied tensors appear once, under their first name.
    """
    return {e.name: _full_tensor(e) for e in _entries(model)}


def _safetensors() -> None:
    try:
        import safetensors  # noqa: F401
    except ImportError:
        raise ImportError("save_dense / load_dense need safetensors: pip install safetensors "
                          "(or tplayers[hf])") from None


def save_dense(model: nn.Module, path: str, *, process_group: Any = None,
               metadata: Optional[Dict[str, str]] = None) -> None:
    """Write the unsharded state dict of ``model`` to one safetensors file (atomically, rank 0).

    Collective: every rank calls it. The file is what the dense model's ``save_pretrained``
    would write (Conv1D weights ``(in, out)``, tied weights once), so Hugging Face loads it.
    """
    _safetensors()
    from safetensors.torch import save_file

    path = os.path.abspath(os.fspath(path))
    state = dense_state_dict(model)
    pg, rank = _coord_group(process_group)

    def write() -> None:
        tmp = f"{path}.tmp-{uuid.uuid4().hex[:16]}"
        save_file({k: v.cpu() for k, v in state.items()}, tmp, metadata={"format": "pt", **(metadata or {})})
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _fsync_dir(os.path.dirname(path))

    _on_rank0(pg, rank, write)


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
            return {k: os.path.join(path, v) for k, v in weight_map.items()}
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


def _read_local(f: Any, key: str, e: _Entry) -> torch.Tensor:
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
    assert e.tp is not None
    d = e.layout.dim
    file_dim = (1 - d) if e.transposed else d
    pieces = []
    for _, _, part, piece in _parts(e):  # this rank's rows of each part, then the part's zero padding
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


def load_dense(model: nn.Module, path: str, *, strict: bool = True) -> Tuple[List[str], List[str]]:
    """Load an unsharded safetensors checkpoint (a file, or a Hugging Face model directory) into a
    TP (or dense) model; each rank reads only its own slices. No communication.

    Returns ``(missing, unexpected)`` names; with ``strict`` a missing tensor raises. Names may
    differ by the model's ``base_model_prefix`` (``transformer.``, ``model.``) as in HF files.
    """
    _safetensors()
    from safetensors import safe_open

    path = os.fspath(path)
    files = _dense_files(path)
    prefix = getattr(model, "base_model_prefix", None) or None
    entries = _entries(model)
    _refuse_meta(entries, path)
    missing, used = [], set()
    handles: Dict[str, Any] = {}
    try:
        plan = []
        for e in entries:
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
                e.tensor.copy_(local)
    finally:
        for h in handles.values():
            h.__exit__(None, None, None)
    unexpected = sorted(set(files) - used)
    return missing, unexpected
