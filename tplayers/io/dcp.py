"""Sharded checkpoints of TP models that load at any TP size (DCP).

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

Integrity: the manifest records a sha256 per file and the save's id (``save_id``, drawn once per save);
every rank also writes ``[save_id, rank]`` into its own shard file (a tiny int64 tensor under
``tplayers.save_id.rank<r>``, a key only that rank holds). A load checks both, each rank a share of the
files, so a shard file copied in from another save is refused even when its digest was edited to match.
"""
from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn

from ..core.blocking import all_gather_tensor, gather_placed
from ..core.dtensors import shard_dtensor
from ..core.groups import collective_device
from ..core.placement import Sharded
from .stages import every_ranks, merged_tensors
from .publish import agree_token, coord_group, dcp_errors, fsync_dir, on_rank0, quiet, require_same_path, write_json
from .optim_state import merged_record, optimizer_entries, optimizer_record, optimizer_targets
from .unpickle import safe_reader
from .walk import CheckpointError, Entry, entries, parts_of, refuse_meta, tp_local, writable

__all__ = ["save_checkpoint", "load_checkpoint"]

MANIFEST = "tplayers.json"
FORMAT = "tplayers-dcp"
VERSION = 3  # 2: a sha256 per file ("files"); 3: the save's id ("save_id"), in every shard file too. 1 and 2 load
SAVE_ID = "tplayers.save_id."  # + "rank<r>": rank r's [save id, r], written into rank r's file (not a model tensor)


def _layout_record(e: Entry) -> Optional[Dict[str, Any]]:
    if e.layout is None:
        return None
    return {"dim": e.layout.dim, "parts": [part.size for part in e.layout.parts]}


def _dcp_state(model: nn.Module, *, for_save: bool, extra: Sequence[Entry] = ()
               ) -> Tuple[Dict[str, Any], List[Any]]:
    """The DCP state dict of ``model`` (and of ``extra`` entries: optimizer state) and, for loading,
    what to do after: (buffer, destination) copies, then functions to call (a wrapper's local pieces).

    Each part of a sharded parameter is a DTensor ``Shard(dim)`` over the TP group whose local
    tensor is this rank's piece (views of the parameters when loading, so DCP writes straight into
    them): a placement's piece of a part cut into p shards is exactly DTensor's chunk, padded
    vocabularies included. A part with replicas (fewer shards than ranks) is saved as the rank's
    sub-chunk when it divides, else (and an uneven part, whose pieces are not DTensor's chunks) as the
    full gathered part; it is loaded in full.
    """
    state: Dict[str, Any] = {}
    post: List[Tuple[torch.Tensor, torch.Tensor]] = []
    finishers: List[Any] = []
    for e in [*entries(model), *extra]:
        if for_save:
            t = tp_local(e)
        else:
            t, finish = writable(e)
            if finish is not None:
                finishers.append(finish)
        if e.layout is None:
            state[e.name] = t.clone() if for_save else t
            continue
        assert e.group is not None
        p, r, d = e.group.size, e.group.rank, e.layout.dim
        for key, full_off, part, piece in parts_of(e):
            local = t.narrow(d, piece.local_start, piece.length)
            if not for_save and piece.length < part.local_size:  # padding (uneven pieces, a padded vocabulary):
                pad = t.narrow(d, piece.local_start + piece.length, part.local_size - piece.length)
                post.append((torch.zeros_like(pad), pad))  # zero after the load, whatever to_empty left there
            shape = list(t.shape)
            shape[d] = part.size
            shape_t = tuple(shape)
            if p == 1:
                state[key] = local.clone() if for_save else local
            elif part.shards == p and part.counts is None:
                chunk = local.contiguous().clone() if for_save else local
                state[key] = shard_dtensor(chunk, e.group, d, shape_t)
            elif for_save and part.size % p == 0 and part.counts is None and part.holders is None:
                sub = local.chunk(p // part.shards, dim=d)[r % (p // part.shards)].contiguous().clone()
                state[key] = shard_dtensor(sub, e.group, d, shape_t)
            elif for_save:  # uneven pieces or replicas: the whole part, gathered (its padded local rows)
                padded = t.narrow(d, piece.local_start, part.local_size)
                state[key] = gather_placed(padded, Sharded(d, (part,)), group=e.group)
            else:
                full = torch.empty(shape_t, dtype=t.dtype, device=t.device)
                state[key] = full
                post.append((full.narrow(d, piece.start - full_off, piece.length), local))
    return state, [*post, *finishers]


def _manifest(model: nn.Module) -> Dict[str, Any]:
    tp_sizes = {e.group.size for e in entries(model) if e.group is not None}
    return {
        "format": FORMAT,
        "version": VERSION,
        "tp_size": max(tp_sizes) if tp_sizes else 1,
        "tensors": {e.name: {"shape": list(e.full_shape()), "dtype": str(e.tensor.dtype).replace("torch.", ""),
                             "layout": _layout_record(e), "aliases": list(e.aliases)}
                    for e in entries(model)},
    }


def save_checkpoint(model: nn.Module, path: str, *, optimizer: Optional[torch.optim.Optimizer] = None,
                    group: Any = None, timeout: float = 300.0) -> None:
    """Save ``model`` (TP or not, any TP size) as a DCP checkpoint directory at ``path``; with
    ``optimizer``, its state too (each moment split like its parameter, so it reshards with it; the
    groups' hyperparameters in the manifest).

    Collective: every rank of ``group`` calls it: the ranks that write this checkpoint together
    (default: the whole world, e.g. every TP and data-parallel rank), not the TP group; a rank that
    does not call it within ``timeout`` seconds is named in an error on the others (gloo groups).
    Replaces an existing checkpoint at
    ``path`` only once the new one is complete.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    path = os.path.abspath(os.fspath(path))
    pg, rank = coord_group(group, "save_checkpoint", timeout)
    require_same_path(pg, path, "save_checkpoint")
    save_id = agree_token(pg, rank)  # one per save, the same on every rank
    tmp = f"{path}.tmp-{save_id}"
    extra = [] if optimizer is None else optimizer_entries(entries(model), optimizer)
    state, _ = _dcp_state(model, for_save=True, extra=extra)
    state[f"{SAVE_ID}rank{rank}"] = _id_tensor(save_id, rank)  # only this rank holds the key: it lands in its file
    manifest = _manifest(model)
    per_rank = every_ranks(pg, manifest["tensors"])
    manifest["tensors"] = merged_tensors(per_rank, "save_checkpoint")  # (pipeline stages: every rank's)
    manifest["save_id"] = save_id
    if optimizer is not None:  # (pipeline stages: each rank's optimizer its stage's parameters, merged)
        records = every_ranks(pg, optimizer_record(entries(model), optimizer))
        manifest["optimizer"] = merged_record(records, "save_checkpoint")

    def publish() -> None:
        manifest["files"] = _file_digests(tmp)
        write_json(os.path.join(tmp, MANIFEST), manifest)
        fsync_dir(tmp)
        old = f"{path}.old-{os.path.basename(tmp)[-16:]}"
        if os.path.exists(path):
            os.rename(path, old)
        os.rename(tmp, path)
        fsync_dir(os.path.dirname(path))
        shutil.rmtree(old, ignore_errors=True)

    try:  # a save that raises (on any rank: DCP and on_rank0 raise on every rank) leaves no temporary behind
        with quiet(), dcp_errors("save_checkpoint", tmp):
            dcp.save(state, storage_writer=FileSystemWriter(tmp), process_group=pg, no_dist=pg is None)
        on_rank0(pg, rank, publish)
    except BaseException:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise


def _sha256(fpath: str) -> str:
    digest = hashlib.sha256()
    with open(fpath, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _file_digests(tmp: str) -> Dict[str, str]:
    """sha256 of every file of a written checkpoint (rank 0, before publishing). Also refuses to publish
    when a file DCP's metadata names is not visible here (ranks wrote to node-local directories)."""
    metadata = safe_reader(tmp).read_metadata()
    named = {str(info.relative_path) for info in metadata.storage_data.values()}
    missing = sorted(n for n in named if not os.path.isfile(os.path.join(tmp, n)))
    if missing:
        raise CheckpointError(f"{tmp}: files written by other ranks are not visible to rank 0: {missing[:4]}; the "
                              "path must be on a file system every rank shares")
    return {n: _sha256(os.path.join(tmp, n)) for n in sorted(os.listdir(tmp)) if n != MANIFEST}


def _id_tensor(save_id: str, rank: int) -> torch.Tensor:
    return torch.tensor([int(save_id, 16), rank], dtype=torch.int64)


def _carries_save_id(path: str, metadata: Any, name: str, save_id: str) -> bool:
    """Whether data file ``name`` holds this save's id under every id key the metadata places in it (at
    least one): ``[save_id, r]`` for ``...rank<r>``. Read by DCP alone on this rank (no collective)."""
    import torch.distributed.checkpoint as dcp

    keys = sorted({index.fqn for index, info in metadata.storage_data.items()
                   if index.fqn.startswith(SAVE_ID) and str(info.relative_path) == name})
    try:
        want = {k: _id_tensor(save_id, int(k[len(SAVE_ID) + len("rank"):])) for k in keys}
        got = {k: torch.zeros(2, dtype=torch.int64) for k in keys}
        if got:
            with quiet(), dcp_errors("load_checkpoint", path):
                dcp.load(got, storage_reader=safe_reader(path), no_dist=True)
    except Exception:  # noqa: BLE001 (a malformed key, an entry the file does not hold as written: not this save's)
        return False
    return bool(keys) and all(torch.equal(got[k], want[k]) for k in keys)


def _verify_files(manifest: Dict[str, Any], path: str, pg: Any, rank: int, metadata: Any) -> None:
    """Every file's sha256 against the manifest, and (version 3) every data file's save id against the
    manifest's, each rank checking a share of the files; the first bad file is named on every rank. A
    version-1 manifest has no digests, a version-2 one no save id: nothing to verify."""
    digests = manifest.get("files")
    if digests is None:
        return
    names = sorted(digests)
    size = 1 if pg is None else dist.get_world_size(pg)
    share = range(rank, len(names), size)
    bad = next((i for i in share if not os.path.isfile(os.path.join(path, names[i]))
                or _sha256(os.path.join(path, names[i])) != digests[names[i]]), len(names))
    verdict = 2 * bad  # 2 * index of the first bad file (+ 1: another save's), over all ranks the least
    if "save_id" in manifest:
        data = {str(info.relative_path) for info in metadata.storage_data.values()}
        foreign = next((i for i in share if i < bad and names[i] in data
                        and not _carries_save_id(path, metadata, names[i], manifest["save_id"])), None)
        verdict = verdict if foreign is None else 2 * foreign + 1
    first = torch.tensor([verdict], dtype=torch.int64)
    if pg is not None:
        first = all_gather_tensor(first.to(collective_device(pg)), 0, group=pg).min().cpu()
    index, foreign_save = divmod(int(first), 2)
    if index < len(names) and foreign_save:
        raise CheckpointError(f"{path}: file '{names[index]}' belongs to another save (or is another rank's file): "
                              f"it does not carry this checkpoint's save id {manifest['save_id']} (recorded in "
                              f"{MANIFEST}) for its rank; loaded, the model would mix two saves; refusing to load")
    if index < len(names):
        raise CheckpointError(f"{path}: file '{names[index]}' is missing or does not match the checksum the "
                              "checkpoint recorded (corrupted or partly overwritten); refusing to load")


def _manifest_bytes(path: str) -> bytes:
    """The manifest file as this rank reads it (b"" when there is none)."""
    try:
        with open(os.path.join(path, MANIFEST), "rb") as f:
            return f.read()
    except OSError:
        return b""


def _read_manifest(path: str, raw: bytes) -> Dict[str, Any]:
    if not os.path.isdir(path):
        raise CheckpointError(f"no checkpoint directory at {path}")
    mpath = os.path.join(path, MANIFEST)
    if not os.path.isfile(mpath) or not os.path.isfile(os.path.join(path, ".metadata")):
        raise CheckpointError(f"{path} is not a complete tplayers checkpoint (no {MANIFEST} or .metadata)")
    try:
        manifest = json.loads(raw.decode("utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{mpath}: the checkpoint manifest is not valid JSON ({e})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{mpath}: unknown checkpoint format "
                              f"{manifest.get('format') if isinstance(manifest, dict) else manifest!r}")
    version = manifest.get("version", 1)
    if not isinstance(version, int) or version > VERSION:
        raise CheckpointError(f"{mpath}: checkpoint version {version!r} is newer than this tplayers reads ({VERSION})")
    files = manifest.get("files")
    if version >= 2 and (not isinstance(files, dict) or not files):  # else every checksum would be skipped
        raise CheckpointError(f"{mpath}: a version-2 manifest lists every file's sha256 ('files'); this one has none "
                              "(edited or truncated): refusing to load unverified files")
    save_id = manifest.get("save_id")
    if version >= 3 and not (isinstance(save_id, str) and len(save_id) == 16
                             and all(c in "0123456789abcdef" for c in save_id)):
        raise CheckpointError(f"{mpath}: a version-3 manifest records its save's id ('save_id', 16 hex digits); "
                              f"this one has {save_id!r} (edited or truncated): refusing to load files it cannot "
                              "tie to one save")
    if version < 3:
        manifest.pop("save_id", None)  # written by no tplayers: nothing to check the files against
    return manifest


def _check_against(manifest: Dict[str, Any], model: nn.Module, path: str, pg: Any) -> None:
    """The model's tensors against the checkpoint's, every rank's together (each may hold a pipeline stage): the same
    error on every rank."""
    saved = manifest["tensors"]
    per_rank = every_ranks(pg, _manifest(model)["tensors"])
    held = merged_tensors(per_rank, "load_checkpoint")
    missing = sorted(set(held) - set(saved))
    unexpected = sorted(set(saved) - set(held))
    if missing or unexpected:
        raise CheckpointError(f"{path}: checkpoint and model hold different tensors: missing from the checkpoint "
                              f"{missing}, not in the model {unexpected}" + (" (on any rank)" if len(per_rank) > 1 else ""))
    for name, want in held.items():
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


def load_checkpoint(model: nn.Module, path: str, *, optimizer: Optional[torch.optim.Optimizer] = None,
                    group: Any = None, timeout: float = 300.0) -> None:
    """Load a :func:`save_checkpoint` directory into ``model`` at any TP size (bit-exact); with
    ``optimizer`` (built over ``model``'s parameters, in the saved groups' order), the saved optimizer
    state and hyperparameters too, resharded like the parameters.

    Collective over ``group`` (as in :func:`save_checkpoint`; default: the whole world). Raises :class:`CheckpointError`
    naming the tensor when names, full shapes or fused layouts differ, and naming the file when one is
    missing or its sha256 differs from the one recorded at save (each rank hashes a share of the files),
    or when a shard file does not carry the save id the manifest records (a file from another save).
    """
    import torch.distributed.checkpoint as dcp

    path = os.path.abspath(os.fspath(path))
    pg, rank = coord_group(group, "load_checkpoint", timeout)
    raw = _manifest_bytes(path)
    require_same_path(pg, path, "load_checkpoint", content=raw)  # node-local copies of another save caught here
    manifest = _read_manifest(path, raw)
    _check_against(manifest, model, path, pg)
    refuse_meta(entries(model), path)
    extra, hand_over = [], None
    if optimizer is not None:
        extra, hand_over = optimizer_targets(manifest.get("optimizer"), entries(model), optimizer, path, pg)
    reader = safe_reader(path)
    try:
        metadata = reader.read_metadata()  # refuse a tampered .metadata here, with a clear error, before DCP does
    except pickle.UnpicklingError as e:
        raise CheckpointError(f"{path}: refusing to load .metadata: {e}") from None
    _verify_files(manifest, path, pg, rank, metadata)  # after the metadata check: a forged manifest must not skip it
    state, post = _dcp_state(model, for_save=False, extra=extra)
    with torch.no_grad():
        with quiet(), dcp_errors("load_checkpoint", path):
            dcp.load(state, storage_reader=reader, process_group=pg, no_dist=pg is None)
        for then in post:
            then() if callable(then) else then[1].copy_(then[0])
    if hand_over is not None:
        hand_over()
