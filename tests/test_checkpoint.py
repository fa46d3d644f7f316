"""Checkpoints: a DCP checkpoint saved at one TP size loads bit-exactly at TP 1, 2 and 4; atomic
saves; no arbitrary unpickling; mismatches named; dense safetensors round trip."""
import importlib.util
import os
import pickle

import pytest
import torch
import torch.nn as nn

import tplayers
from tplayers.io import CheckpointError, dense_state_dict
from tplayers.core.groups import resolve_group
from tplayers.core.placement import Sharded
from tplayers.layers import TensorParallelModule
from tplayers.layers.base import placements_of
from tplayers.convert import Column
from tplayers.io.state_dict import qkv_layout
from tplayers.testing import get_world

HEADS, KV_HEADS, HEAD_DIM = 4, 1, 2  # GQA with one KV head: replicated KV shards at TP > 1
VOCAB = 31  # divides no TP size > 1: the embedding's rows are padded


class _GQAProj(TensorParallelModule):
    """A fused q/k/v weight whose single KV head is replicated across ranks (checkpoint test only)."""

    def __init__(self, full: torch.Tensor, group) -> None:
        super().__init__()
        self.group = resolve_group(group)
        self.weight = nn.Parameter(self._layout().shard(full, self.group.rank, self.group.size).clone())

    def _layout(self) -> Sharded:
        return qkv_layout(HEADS, KV_HEADS, HEAD_DIM, self.group.size)

    def param_placements(self):
        return {"weight": self._layout()}


class Toy(nn.Module):
    def __init__(self, hidden: int = 8) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, hidden)  # vocabulary padded to the TP degree at TP 2 and 4
        self.qkv = nn.Linear(hidden, 3 * hidden)  # fused, equal thirds
        self.up = nn.Linear(hidden, 4 * hidden)
        self.down = nn.Linear(4 * hidden, hidden)
        self.norm = nn.LayerNorm(hidden)
        self.gqa = nn.Linear(hidden, (HEADS + 2 * KV_HEADS) * HEAD_DIM, bias=False)
        self.register_buffer("step", torch.zeros((), dtype=torch.int64))
        self.register_buffer("scratch", torch.zeros(3), persistent=False)


def _build(group, seed: int, hidden: int = 8) -> nn.Module:
    torch.manual_seed(seed)
    model = Toy(hidden)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
        model.step.fill_(seed)
    tplayers.parallelize(model, {"emb": "vocab_embedding", "qkv": Column(parts=3), "up": "column", "down": "row"},
                         group=group)
    model.gqa = _GQAProj(model.gqa.weight.detach(), group)
    return model


def _local(model: nn.Module) -> list:
    """This rank's own tensors (its shards, as its layers hold them), in order: for comparing two models on
    one rank (state_dict() refuses the fused and replicated layouts this model has: no DTensor says them)."""
    return [t.detach() for t in list(model.parameters()) + list(model.buffers())]


def _padded_and_replicated(model: nn.Module) -> tuple:
    """(the vocabulary is padded, a KV part is replicated): what the reshard test must exercise."""
    emb, gqa = placements_of(model.emb)["weight"], placements_of(model.gqa)["weight"]
    size = model.emb.group.size
    return (emb.parts[0].padded and emb.parts[0].local_size * size > VOCAB,
            any(part.shards < size for part in gqa.parts))


def _save(group, path: str, seed: int):
    model = _build(group, seed)
    tplayers.save_checkpoint(model, path)
    return dense_state_dict(model), _padded_and_replicated(model)


def _load(group, path: str, seed: int, hidden: int = 8):
    model = _build(group, seed, hidden)
    tplayers.load_checkpoint(model, path)
    return dense_state_dict(model)


@pytest.mark.parametrize("save_tp", [2, 4])
def test_checkpoint_reshards_bit_exactly(tmp_path, save_tp):
    path = str(tmp_path / "ckpt")
    saved, exercised = get_world(save_tp).run(_save, path, seed=1)[0]
    assert exercised == (True, True)  # padded vocabulary, replicated KV head
    assert set(saved) == {"emb.weight", "qkv.weight", "qkv.bias", "up.weight", "up.bias", "down.weight",
                          "down.bias", "norm.weight", "norm.bias", "gqa.weight", "step"}
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]  # no temporary left behind
    for tp in (1, 2, 4):
        for rank, loaded in enumerate(get_world(tp).run(_load, path, seed=2)):
            assert set(loaded) == set(saved)
            for name, t in saved.items():
                assert torch.equal(loaded[name], t), f"TP {save_tp} -> {tp}, rank {rank}: {name} differs"


def _load_expect_error(group, path: str):
    model = _build(group, 3, hidden=16)
    with pytest.raises(CheckpointError) as info:
        tplayers.load_checkpoint(model, path)
    return str(info.value)


def test_checkpoint_shape_mismatch_names_parameter(tmp_path):
    path = str(tmp_path / "ckpt")
    get_world(2).run(_save, path, seed=1)
    msg = get_world(2).run(_load_expect_error, path)[0]
    assert "full shape" in msg and "'" in msg and ".weight" in msg


def _single(seed: int) -> nn.Module:
    return _build(None, seed)


def test_interrupted_save_leaves_previous_checkpoint(tmp_path, monkeypatch):
    from torch.distributed.checkpoint import FileSystemWriter

    path = str(tmp_path / "ckpt")
    tplayers.save_checkpoint(_single(1), path)

    def crash(self, *args, **kwargs):
        raise OSError("disk full (simulated)")

    monkeypatch.setattr(FileSystemWriter, "write_data", crash)
    with pytest.raises(BaseException, match="disk full"):  # DCP's CheckpointException is a BaseException
        tplayers.save_checkpoint(_single(5), path)
    monkeypatch.undo()
    model = _single(9)
    tplayers.load_checkpoint(model, path)
    want = dense_state_dict(_single(1))
    assert all(torch.equal(t, want[k]) for k, t in dense_state_dict(model).items())
    # a save that raised leaves no temporary directory (before: <path>.tmp-* stayed); one torn by a crash (its
    # process killed before the manifest, written last) never loads
    assert [p for p in os.listdir(tmp_path) if ".tmp-" in p] == []
    import shutil

    torn = str(tmp_path / "ckpt.tmp-torn")
    shutil.copytree(path, torn)
    os.remove(os.path.join(torn, "tplayers.json"))
    with pytest.raises(CheckpointError, match="not a complete"):
        tplayers.load_checkpoint(_single(9), torn)


class _Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned > /dev/null",))


def test_load_never_unpickles_arbitrary_objects(tmp_path):
    path = str(tmp_path / "ckpt")
    tplayers.save_checkpoint(_single(1), path)
    with open(os.path.join(path, ".metadata"), "wb") as f:
        pickle.dump(_Evil(), f)
    with pytest.raises(CheckpointError, match="posix.system|os.system"):
        tplayers.load_checkpoint(_single(2), path)


def _stack_global_call(module: str, name: str, *args: str) -> bytes:
    """A protocol-4 pickle calling ``module``'s (dotted) ``name`` with string args."""
    def text(x: str) -> bytes:
        b = x.encode()
        return b"\x8c" + bytes([len(b)]) + b  # SHORT_BINUNICODE
    return b"\x80\x04" + text(module) + text(name) + b"\x93" + b"(" + b"".join(map(text, args)) + b"tR."


@pytest.mark.parametrize("name", ["torch.utils.collect_env.subprocess.Popen", "os.sys.modules",
                                  "FileSystemWriter", "__builtins__"])
def test_metadata_unpickler_refuses_dotted_and_foreign_names(tmp_path, name):
    """A dotted name walks from an allowed DCP module to anything it imports (subprocess.Popen)."""
    import torch.utils.collect_env  # noqa: F401  (make the Popen path resolvable, as it is after DCP imports)

    path = str(tmp_path / "ckpt")
    tplayers.save_checkpoint(_single(1), path)
    marker = tmp_path / "pwned"
    with open(os.path.join(path, ".metadata"), "wb") as f:
        f.write(_stack_global_call("torch.distributed.checkpoint.filesystem", name, "touch", str(marker)))
    with pytest.raises(CheckpointError, match="does not load"):
        tplayers.load_checkpoint(_single(2), path)
    assert not marker.exists()


def _dense_roundtrip(group, path: str):
    model = _build(group, 4)
    tplayers.save_dense(model, path)
    other = _build(group, 6)
    missing, unexpected = tplayers.load_dense(other, path)
    assert missing == [] and unexpected == []
    return dense_state_dict(other), dense_state_dict(model)


def test_dense_safetensors_roundtrip_across_tp(tmp_path):
    pytest.importorskip("safetensors", reason="dense export needs the hf extra (safetensors)")
    from safetensors.torch import load_file

    path = str(tmp_path / "dense.safetensors")
    got, want = get_world(2).run(_dense_roundtrip, path)[1]
    assert all(torch.equal(got[k], want[k]) for k in want)
    on_disk = load_file(path)
    assert set(on_disk) == set(want) and all(torch.equal(on_disk[k], want[k]) for k in want)
    # the same file loads into a TP-4 model slice by slice
    results = get_world(4).run(_load_dense_tp4, path)
    assert all(torch.equal(model[k], want[k]) for model, _ in results for k in want)
    # the four ranks' vocabulary reads tile the 31 rows: 8, 8, 8 and the last rank's 7 (+ 1 padding row)
    assert [rows for _, rows in results] == [(0, 8), (8, 16), (16, 24), (24, VOCAB)]


class _RecordingSlice:
    """A safetensors slice that records the index of every read."""

    def __init__(self, key, sl, reads):
        self._key, self._slice, self._reads = key, sl, reads

    def __getitem__(self, index):
        self._reads.append((self._key, index))
        return self._slice[index]

    def __getattr__(self, name):
        return getattr(self._slice, name)


class _RecordingHandle:
    """A safetensors handle that records which tensors were read whole, and which slices were read."""

    def __init__(self, handle, whole, sliced):
        self._handle, self._whole, self._sliced = handle, whole, sliced

    def get_tensor(self, key):
        self._whole.append(key)
        return self._handle.get_tensor(key)

    def get_slice(self, key):
        return _RecordingSlice(key, self._handle.get_slice(key), self._sliced)

    def __getattr__(self, name):
        return getattr(self._handle, name)


def _load_dense_tp4(group, path: str):
    import safetensors

    whole, sliced, real_open = [], [], safetensors.safe_open

    class _Open:
        def __init__(self, *args, **kwargs):
            self._ctx = real_open(*args, **kwargs)

        def __enter__(self):
            return _RecordingHandle(self._ctx.__enter__(), whole, sliced)

        def __exit__(self, *exc):
            return self._ctx.__exit__(*exc)

    model = _build(group, 8)
    safetensors.safe_open = _Open
    try:
        tplayers.load_dense(model, path)
    finally:
        safetensors.safe_open = real_open
    # only replicated tensors are read whole: the padded vocabulary is read as this rank's rows
    assert "emb.weight" not in whole and "up.weight" not in whole, whole
    rows = [(index[0].start, index[0].stop) for key, index in sliced if key == "emb.weight"]
    (piece,) = placements_of(model.emb)["weight"].pieces(model.emb.group.rank, model.emb.group.size)
    assert rows == [(piece.start, piece.start + piece.length)], rows
    assert not model.emb.weight[piece.length:].any()  # the padding rows past the vocabulary stay zero
    return dense_state_dict(model), rows[0]


def test_fused_layout_mismatch_names_parameter(tmp_path):
    path = str(tmp_path / "ckpt")
    tplayers.save_checkpoint(_single(1), path)  # qkv saved as three fused parts
    torch.manual_seed(0)
    plain = Toy()
    tplayers.parallelize(plain, {"emb": "vocab_embedding", "qkv": "column", "up": "column", "down": "row"},
                         group=None)
    plain.gqa = _GQAProj(plain.gqa.weight.detach(), None)
    with pytest.raises(CheckpointError, match=r"'qkv.weight' was saved with TP layout .*parts.*\[8, 8, 8\]"):
        tplayers.load_checkpoint(plain, path)


GPT_CFG = dict(vocab_size=30, hidden=16, n_heads=4, n_kv_heads=1, ffn_hidden=32, n_layers=2,
               activation="swiglu", norm="rmsnorm")


def _gpt(group, path: str, seed: int, save: bool):
    """A ParallelGPT drawn from ``seed``, saved to or loaded from ``path``; its weights and loss."""
    torch.manual_seed(seed)
    model = tplayers.ParallelGPT(tplayers.GPTConfig(**GPT_CFG), group=group).double()
    (tplayers.save_checkpoint if save else tplayers.load_checkpoint)(model, path)
    ids = torch.randint(0, 30, (2, 8), generator=torch.Generator().manual_seed(0))
    return dense_state_dict(model), model.loss(ids, ids).detach()


def test_parallel_gpt_with_replicated_kv_heads_reshards(tmp_path):
    """tplayers' own GPT (one KV head: replicated at TP > 1; padded vocabulary) from TP 2 to TP 4."""
    path = str(tmp_path / "gpt")
    saved, out = get_world(2).run(_gpt, path, seed=7, save=True)[0]
    for loaded, out_loaded in get_world(4).run(_gpt, path, seed=8, save=False):
        assert all(torch.equal(loaded[k], saved[k]) for k in saved)
        torch.testing.assert_close(out_loaded, out, rtol=1e-10, atol=1e-10)


@pytest.mark.filterwarnings("ignore:Detected an existing checkpoint")
def test_load_refuses_non_tensor_entries(tmp_path):
    """DCP would torch.load(weights_only=False) a 'bytes' entry: a checkpoint holding one is refused."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    path = str(tmp_path / "ckpt")
    tplayers.save_checkpoint(_single(1), path)
    from tplayers.io.dcp import _dcp_state
    from tplayers.io.publish import quiet

    state, _ = _dcp_state(_single(1), for_save=True)
    state["step"] = "not a tensor"  # stored by DCP as pickled bytes
    with quiet():
        dcp.save(state, storage_writer=FileSystemWriter(path, overwrite=True), no_dist=True)
    with pytest.raises(CheckpointError, match="'step' is not a tensor"):
        tplayers.load_checkpoint(_single(2), path)


def _save_with_rank0_failure(group, path: str, what: str):
    """Rank 0 alone fails while finishing the save: every rank must raise, none may wait forever."""
    import tplayers.io.dcp
    import tplayers.io.safetensors

    def fail(*args, **kwargs):
        raise OSError("read-only file system (simulated)")

    ck, name = (tplayers.io.dcp, "write_json") if what == "checkpoint" else (tplayers.io.safetensors, "fsync_dir")
    saved = getattr(ck, name)
    if resolve_group(group).rank == 0:
        setattr(ck, name, fail)
    try:
        if what == "checkpoint":
            tplayers.save_checkpoint(_build(group, 1), path)
        else:
            tplayers.save_dense(_build(group, 1), path)
    except (OSError, CheckpointError) as e:
        return str(e)
    finally:
        setattr(ck, name, saved)
    return None


@pytest.mark.parametrize("what", ["checkpoint", "dense"])
def test_save_error_on_rank0_raises_on_every_rank(tmp_path, what):
    if what == "dense":
        pytest.importorskip("safetensors", reason="dense export needs the hf extra (safetensors)")
    errors = get_world(2).run(_save_with_rank0_failure, str(tmp_path / "out"), what, timeout=30)
    assert all(e is not None and "read-only" in e for e in errors), errors


def test_loading_into_meta_tensors_is_refused(tmp_path):
    """copy_ into a meta tensor does nothing: load_dense used to return ([], []) having loaded nothing."""
    path = str(tmp_path / "ckpt")
    tplayers.save_checkpoint(_single(1), path)
    with torch.device("meta"):
        model = _single(2)
    with pytest.raises(CheckpointError, match=r"meta device \[.*'emb.weight'.*to_empty"):
        tplayers.load_checkpoint(model, path)
    if importlib.util.find_spec("safetensors") is not None:
        tplayers.save_dense(_single(1), str(tmp_path / "dense.safetensors"))
        with pytest.raises(CheckpointError, match=r"meta device \[.*'emb.weight'"):
            tplayers.load_dense(model, str(tmp_path / "dense.safetensors"))


def _group_keyword(group, root):
    """Each collective save / load takes its ranks as ``group=`` (the one name; ``process_group=`` is refused)."""
    model, fresh = _build(group, seed=3), _build(group, seed=4)
    ckpt, dense = os.path.join(root, "ck"), os.path.join(root, "dense.safetensors")
    calls = [(tplayers.save_checkpoint, model, ckpt), (tplayers.load_checkpoint, fresh, ckpt)]
    if importlib.util.find_spec("safetensors") is not None:
        calls.append((tplayers.save_dense, model, dense))
    for fn, m, path in calls:
        fn(m, path, group=group)
        with pytest.raises(TypeError, match="process_group"):
            fn(m, path, process_group=group)
    same = all(torch.equal(a, b) for a, b in zip(_local(model), _local(fresh)))
    if len(calls) == 3:  # load_dense takes group= too (checked only: it needs no communication)
        other = _build(group, seed=5)
        assert tplayers.load_dense(other, dense, group=group) == ([], [])
        same = same and all(torch.equal(a, b) for a, b in zip(_local(model), _local(other)))
        with pytest.raises(TypeError, match="load_dense: group must be None"):
            tplayers.load_dense(other, dense, group="world")
    return same


def test_saves_and_loads_take_their_ranks_as_group(tmp_path):
    assert all(get_world(2).run(_group_keyword, str(tmp_path)))


def _save_to_per_rank_paths(group, root):
    rank = resolve_group(group).rank
    model = _build(group, seed=5)
    path = os.path.join(root, f"node{rank}", "ck")  # node-local paths: rank 0's directory would miss rank 1's shards
    errors = []
    for call in (lambda: tplayers.save_checkpoint(model, path), lambda: tplayers.load_checkpoint(model, path)):
        with pytest.raises(CheckpointError, match=r"passed a different path than rank 0"):
            call()
        errors.append(True)
    return errors, os.path.exists(path)


@pytest.mark.parametrize("tp", [2, 4])
def test_checkpoint_paths_that_differ_across_ranks_are_refused(tmp_path, tp):
    for errors, written in get_world(tp).run(_save_to_per_rank_paths, str(tmp_path)):
        assert errors == [True, True] and not written


def _corrupt_and_load(group, path, how):
    import json as _json

    model = _build(group, seed=6)
    tplayers.save_checkpoint(model, path)
    if resolve_group(group).rank == 0:
        shard = sorted(f for f in os.listdir(path) if f.endswith(".distcp"))[-1]
        if how == "flip_byte":
            with open(os.path.join(path, shard), "r+b") as f:
                f.seek(os.path.getsize(os.path.join(path, shard)) // 2)
                byte = f.read(1)
                f.seek(-1, 1)
                f.write(bytes([byte[0] ^ 0x01]))
        elif how == "missing":
            os.remove(os.path.join(path, shard))
        elif how == "garbled_manifest":
            with open(os.path.join(path, "tplayers.json"), "w") as f:
                f.write('{"format": "tplayers-dcp", "tens')
        elif how == "no_files":  # the digests deleted from a version-2 manifest: every checksum skipped, before
            manifest = _json.load(open(os.path.join(path, "tplayers.json")))
            manifest.pop("files")
            _json.dump(manifest, open(os.path.join(path, "tplayers.json"), "w"))
        elif how == "no_save_id":  # the save id deleted from a version-3 manifest: every id check skipped
            manifest = _json.load(open(os.path.join(path, "tplayers.json")))
            manifest.pop("save_id")
            _json.dump(manifest, open(os.path.join(path, "tplayers.json"), "w"))
        elif how == "version1":  # a checkpoint written before per-file digests existed still loads
            manifest = _json.load(open(os.path.join(path, "tplayers.json")))
            manifest.pop("files")
            manifest.pop("save_id")
            manifest["version"] = 1
            _json.dump(manifest, open(os.path.join(path, "tplayers.json"), "w"))
        elif how == "version2":  # one written before save ids existed (digests, no save id) still loads
            manifest = _json.load(open(os.path.join(path, "tplayers.json")))
            manifest.pop("save_id")
            manifest["version"] = 2
            _json.dump(manifest, open(os.path.join(path, "tplayers.json"), "w"))
    tplayers.core.blocking.barrier(group)  # rank 0 has damaged it before anyone loads
    fresh = _build(group, seed=7)
    try:
        tplayers.load_checkpoint(fresh, path)
    except CheckpointError as e:
        return str(e)
    return all(torch.equal(a, b) for a, b in zip(_local(model), _local(fresh)))


@pytest.mark.parametrize("how, expected", [
    ("flip_byte", r"file '__\d_0\.distcp' is missing or does not match the checksum"),
    ("missing", r"file '__\d_0\.distcp' is missing or does not match the checksum"),
    ("garbled_manifest", r"tplayers\.json: the checkpoint manifest is not valid JSON"),
    ("no_files", r"tplayers\.json: a version-2 manifest lists every file's sha256 \('files'\); this one has none"),
    ("no_save_id", r"tplayers\.json: a version-3 manifest records its save's id \('save_id'.*this one has None"),
])
@pytest.mark.parametrize("tp", [2, 4])
def test_corrupted_checkpoints_fail_to_load_naming_the_file(tmp_path, how, expected, tp):
    import re

    for result in get_world(tp).run(_corrupt_and_load, str(tmp_path / "ck"), how):
        assert isinstance(result, str) and re.search(expected, result), result


@pytest.mark.parametrize("version", ["version1", "version2"])
def test_checkpoints_without_digests_still_load(tmp_path, version):
    assert get_world(2).run(_corrupt_and_load, str(tmp_path / "ck"), version) == [True, True]


def _shard_from_another_save(group, root, source):
    """Two saves A and B of one model layout (different weights); B's rank-1 shard file is copied into
    A and A's manifest digest for it edited to match, so every sha256 checks out. Before, A loaded
    silently as a model mixed from both saves (rank 1's shards from B). Refused on every rank now,
    naming the file: each shard file carries its save's id (and rank), checked against the manifest's.
    (``source="other_rank"``: A's own rank-0 file copied over its rank-1 file, refused alike.)"""
    import hashlib
    import json as _json
    import shutil

    from tplayers.io.unpickle import safe_reader

    a, b = os.path.join(root, "a"), os.path.join(root, "b")
    saved = _build(group, seed=13)
    tplayers.save_checkpoint(saved, a)
    tplayers.save_checkpoint(_build(group, seed=14), b)
    shard = "__1_0.distcp"
    if resolve_group(group).rank == 0:
        files = {index.fqn: str(info.relative_path)
                 for index, info in safe_reader(a).read_metadata().storage_data.items()}
        # each rank's id sits in its own file, and the id keys never reach the model's manifest entry
        assert {k: v for k, v in files.items() if k.startswith("tplayers.save_id.")} == {
            "tplayers.save_id.rank0": "__0_0.distcp", "tplayers.save_id.rank1": "__1_0.distcp"}
        with open(os.path.join(a, "tplayers.json")) as f:
            manifest = _json.load(f)
        assert manifest["save_id"] and not any("save_id" in name for name in manifest["tensors"])
        src = os.path.join(b, shard) if source == "other_save" else os.path.join(a, "__0_0.distcp")
        shutil.copyfile(src, os.path.join(a, shard))
        with open(src, "rb") as f:
            manifest["files"][shard] = hashlib.sha256(f.read()).hexdigest()
        with open(os.path.join(a, "tplayers.json"), "w") as f:
            _json.dump(manifest, f)
    tplayers.core.blocking.barrier(group)  # rank 0 has mixed the saves before anyone loads
    fresh = _build(group, seed=15)
    try:
        tplayers.load_checkpoint(fresh, a)
    except CheckpointError as e:
        return str(e)
    same = all(torch.equal(x, y) for x, y in zip(_local(saved), _local(fresh)))
    return f"loaded without an error (this rank's tensors {'equal' if same else 'differ from'} save A's)"


@pytest.mark.parametrize("source", ["other_save", "other_rank"])
def test_a_shard_file_of_another_save_is_refused(tmp_path, source):
    for message in get_world(2).run(_shard_from_another_save, str(tmp_path), source):
        assert "file '__1_0.distcp' belongs to another save" in message, message


def test_dcp_base_exceptions_become_checkpoint_errors():
    """DCP's CheckpointException derives from BaseException: `except Exception` in a training loop
    would miss it, so tplayers re-raises it as a CheckpointError (an Exception) naming the path."""
    from torch.distributed.checkpoint.api import CheckpointException

    from tplayers.io.publish import dcp_errors

    with pytest.raises(CheckpointError, match=r"load_checkpoint: torch.distributed.checkpoint failed for /x/ck: "
                                              r"CheckpointException"):
        with dcp_errors("load_checkpoint", "/x/ck"):
            raise CheckpointException("boom", {0: (OSError("disk"), None)})
    with pytest.raises(KeyboardInterrupt):
        with dcp_errors("load_checkpoint", "/x/ck"):
            raise KeyboardInterrupt


def test_load_dense_refuses_index_entries_outside_the_directory(tmp_path):
    pytest.importorskip("safetensors", reason="dense import needs the hf extra (safetensors)")
    import json

    from safetensors.torch import save_file

    outside = tmp_path / "elsewhere.safetensors"
    save_file({"weight": torch.zeros(2, 2)}, str(outside))
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"weight": "../elsewhere.safetensors"}}))
    with pytest.raises(CheckpointError, match=r"the index names files outside .*model"):
        tplayers.load_dense(nn.Linear(2, 2, bias=False), str(model_dir))


def test_load_dense_reads_the_hugging_face_cache_layout(tmp_path):
    """A hub snapshot's files are symlinks into ../../blobs/ (every sharded model in the HF cache):
    loaded, while an index entry that names a file outside the directory is still refused (above).
    (Before: "the index names files outside ..." for every sharded hub snapshot.)"""
    pytest.importorskip("safetensors", reason="dense import needs the hf extra (safetensors)")
    import json

    from safetensors.torch import save_file

    blobs, snapshot = tmp_path / "blobs", tmp_path / "snapshots" / "abc123"
    blobs.mkdir()
    snapshot.mkdir(parents=True)
    weight = torch.arange(4.0).reshape(2, 2)
    save_file({"weight": weight}, str(blobs / "9f1e"))
    (blobs / "77aa").write_text(json.dumps({"weight_map": {"weight": "model-00001-of-00001.safetensors"}}))
    (snapshot / "model-00001-of-00001.safetensors").symlink_to("../../blobs/9f1e")
    (snapshot / "model.safetensors.index.json").symlink_to("../../blobs/77aa")
    model = nn.Linear(2, 2, bias=False)
    assert tplayers.load_dense(model, str(snapshot)) == ([], [])
    assert torch.equal(model.weight.detach(), weight)


def _mlp(group, seed: int) -> nn.Module:
    """Column -> row: layouts a DTensor describes, so state_dict() hands them out (labelled)."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))
    return tplayers.parallelize(model, {"0": "column", "2": "row"}, group=group, audit=False)


def _load_rank0_state_dict(group, path):
    """The DDP idiom on a TP model: rank 0 saves model.state_dict() with torch.save, every rank loads
    it. Rank 1 would compute with rank 0's shards (off by 0.5 on this model, no error, before): its
    load is refused naming both shards and the fix; rank 0's own shards load; per-rank files load."""
    g = resolve_group(group)
    model = _mlp(group, seed=8)
    if g.rank == 0:
        torch.save(model.state_dict(), path)
    torch.save(model.state_dict(), f"{path}.{g.rank}")
    tplayers.core.blocking.barrier(group)
    fresh = _mlp(group, seed=9)
    try:
        fresh.load_state_dict(torch.load(path))
        refused = ""
    except RuntimeError as e:
        refused = str(e)
    fresh.load_state_dict(torch.load(f"{path}.{g.rank}"))  # each rank its own: fine
    same = all(torch.equal(a, b) for a, b in zip(_local(model), _local(fresh)))
    return g.rank, refused, same


def test_a_state_dict_of_another_rank_is_refused(tmp_path):
    for rank, refused, same in get_world(2).run(_load_rank0_state_dict, str(tmp_path / "rank0.pt")):
        assert same
        if rank == 0:
            assert refused == ""
        else:
            assert "holds TP rank 0 of 2's shard; this module is TP rank 1 of 2" in refused, refused
            assert "tplayers.save_checkpoint" in refused


def _node_local_copies(group, root):
    """Node-local checkpoint directories behind one path string: rank 1's node holds a copy of another
    save (simulated: rank 1 reads the other save's directory through the same path string). Each copy
    is internally consistent, so per-file digests pass; before, each rank loaded a different model.
    Refused on every rank, naming the rank that sees another checkpoint."""
    from tplayers.io import dcp as dcp_module

    g = resolve_group(group)
    first, second = os.path.join(root, "ck"), os.path.join(root, "ck-node1")
    tplayers.save_checkpoint(_build(group, seed=10), first)
    tplayers.save_checkpoint(_build(group, seed=11), second)
    if g.rank == 1:  # this "node" mounts the other save at the same path
        real = dcp_module._manifest_bytes
        dcp_module._manifest_bytes = lambda path: real(second if path == first else path)
    try:
        tplayers.load_checkpoint(_build(group, seed=12), first)
        return ""
    except CheckpointError as e:
        return str(e)
    finally:
        if g.rank == 1:
            dcp_module._manifest_bytes = real


def test_node_local_checkpoints_behind_one_path_are_refused(tmp_path):
    for message in get_world(2).run(_node_local_copies, str(tmp_path)):
        assert "rank(s) [1] see a different checkpoint at" in message and "ck" in message, message


def _save_on_rank0_only(group, path):
    """save_checkpoint called by rank 0 only (`if rank == 0: save`): before, rank 0 waited out the
    process group's timeout (30 minutes by default) with a message that never said the save is
    collective. Now it names the missing rank within the call's timeout."""
    import time

    g = resolve_group(group)
    if g.rank != 0:
        return None
    model, t0 = _build(None, seed=1), time.monotonic()
    try:
        tplayers.save_checkpoint(model, path, timeout=2)
    except RuntimeError as e:
        return str(e), time.monotonic() - t0
    return "saved", time.monotonic() - t0


def test_a_save_called_on_rank_0_only_names_the_missing_rank(tmp_path):
    from tplayers.testing import World

    with World(2) as world:  # a fresh world: the failed barrier leaves its process group unusable
        message, seconds = world.run(_save_on_rank0_only, str(tmp_path / "ck"))[0]
    assert "save_checkpoint is collective: every rank of its group must call it" in message, message
    assert "Ranks 1 failed to pass monitoredBarrier" in message and seconds < 30, (message, seconds)


def _one_rank_fails_to_write(group, path):
    """A write error on rank 1 only (a full disk, a file-size limit on its node)."""
    import torch.distributed as dist
    from torch.distributed.checkpoint import FileSystemWriter

    model = _build(group, seed=1)
    original = FileSystemWriter.write_data

    def fail(self, *args, **kwargs):
        raise OSError(27, "File too large (simulated)")
    if dist.get_rank() == 1:
        FileSystemWriter.write_data = fail
    try:
        tplayers.save_checkpoint(model, path)
        error = ""
    except CheckpointError as e:
        error = str(e)
    finally:
        FileSystemWriter.write_data = original
    tplayers.core.blocking.barrier(group)
    return error, sorted(os.listdir(os.path.dirname(path)))


def test_a_write_failing_on_one_rank_raises_on_every_rank_and_leaves_nothing(tmp_path):
    """Before: the <path>.tmp-* directory stayed behind."""
    for error, left in get_world(2).run(_one_rank_fails_to_write, str(tmp_path / "ckpt")):
        assert "save_checkpoint" in error and "File too large" in error, error
        assert left == [], left


def _save_past_a_file_size_limit(group, path):
    import resource

    torch.manual_seed(0)
    model = tplayers.parallelize(nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64)),
                                 {"0": "column", "2": "row"}, group=group, audit=False)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    if torch.distributed.get_rank() == 1:
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, hard))  # ulimit -f on one node
    try:
        tplayers.save_checkpoint(model, path)
        return "no error", os.path.exists(path)
    except tplayers.io.CheckpointError as e:
        return str(e), os.path.exists(path)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))


def test_a_file_size_limit_hit_mid_save_is_named_on_every_rank(tmp_path):
    """Before: the limit was a hint at the end of DCP's traceback ("unexpected pos"), on no rank its value."""
    for rank, (message, published) in enumerate(get_world(2).run(_save_past_a_file_size_limit, str(tmp_path / "ck"))):
        assert message.startswith("save_checkpoint: rank(s) [1] could not write their part of the checkpoint: a "
                                  "write stopped short"), message
        assert "file-size limit" in message and "nothing was published" in message, message
        assert ("This rank's file-size limit (ulimit -f) is 4096 bytes" in message) == (rank == 1), message
        assert not published


def _save_on_rank_0_only(group, path):
    """Rank 0 saves; rank 1 goes on training (as a loop that guards the save with `if rank == 0` does)."""
    torch.manual_seed(0)
    model = tplayers.parallelize(nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8)).double(),
                                 {"0": "column", "2": "row"}, group=group)
    x = torch.randn(2, 8, dtype=torch.float64)
    try:
        if torch.distributed.get_rank() == 0:
            tplayers.save_checkpoint(model, path, timeout=2)
        else:
            model(x).sum().backward()
    except Exception as e:  # noqa: BLE001 - the message is what is tested
        return f"{type(e).__name__}: {e}"
    return "no error"


def test_save_checkpoint_on_rank_0_only_is_named_on_both_ranks(tmp_path):
    """Issue 53: the rank that saves names the collective and the rank that did not come; the other names the
    closed connection and where to look (before the World reported ranks' deaths: 'Connection closed by peer')."""
    from tplayers.testing import World

    with World(2) as world:  # a fresh world: the abandoned collective leaves its group unusable
        saver, trainer = world.run(_save_on_rank_0_only, str(tmp_path / "ck"), timeout=60)
    assert "save_checkpoint is collective: every rank of its group must call it" in saver and "Ranks 1" in saver, saver
    assert "another rank of the TP group closed its connection" in trainer and "look at that rank's output" in trainer, \
        trainer


class _Stages(nn.Module):
    """A 4-layer model cut into pipeline stages by hand (torchtitan style: a stage keeps the full model's names and
    holds only its own layers)."""

    def __init__(self, keep):
        super().__init__()
        self.layers = nn.ModuleDict({str(i): nn.Linear(8, 8, dtype=torch.float64) for i in range(4) if i in keep})


def _this_ranks_stage():
    """(the whole model, seed 0; this rank's stage of it: layers 0-1 on rank 0, 2-3 on rank 1)."""
    torch.manual_seed(0)
    full = _Stages(range(4))
    stage = _Stages([0, 1] if torch.distributed.get_rank() == 0 else [2, 3])
    stage.load_state_dict({k: v for k, v in full.state_dict().items() if k.split(".")[1] in stage.layers})
    return full, stage


def _save_stages_then_load(group, path):
    rank = torch.distributed.get_rank()
    full, stage = _this_ranks_stage()
    tplayers.save_checkpoint(stage, path)
    other = _Stages([0] if rank == 0 else [1, 2, 3])  # another pipeline layout, loaded from the same checkpoint
    tplayers.load_checkpoint(other, path)
    return all(torch.equal(v, full.state_dict()[k]) for k, v in other.state_dict().items())


def test_pipeline_stages_save_into_one_checkpoint_and_load_at_another_layout(tmp_path):
    """Issue 57. Before: each rank passing its own stage, the index held stage 0's tensors only: the error came at
    load ('missing from the checkpoint')."""
    assert get_world(2).run(_save_stages_then_load, str(tmp_path / "ck")) == [True, True]


def _stage_step(stage, lr=0.1):
    """One AdamW step of a stage on a loss separable by layer (so any layout's moments equal the whole model's)."""
    opt = torch.optim.AdamW(stage.parameters(), lr=lr)
    x = torch.randn(3, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    sum(layer(x).square().mean() for layer in stage.layers.values()).backward()
    opt.step()
    return opt


def _moments(stage, opt):
    by_id = {id(p): n for n, p in stage.named_parameters()}
    return {f"{by_id[id(p)]}.{k}": v.clone() for p, s in opt.state.items() for k, v in s.items()}


def _stages_with_optimizers(group, path):
    rank = torch.distributed.get_rank()
    full, stage = _this_ranks_stage()
    tplayers.save_checkpoint(stage, path, optimizer=_stage_step(stage))
    reference = _moments(full, _stage_step(full))  # the whole model, one optimizer, the same step
    results = []
    for keep in ([0] if rank == 0 else [1, 2, 3], range(4)):  # another pipeline layout; the whole model on each
        other = _Stages(keep)
        opt = torch.optim.AdamW(other.parameters(), lr=0.5)
        tplayers.load_checkpoint(other, path, optimizer=opt)
        got = _moments(other, opt)
        results.append(bool(got) and all(torch.equal(v, reference[k]) for k, v in got.items())
                       and opt.param_groups[0]["lr"] == 0.1)
    fewer = _Stages([0, 1] if rank == 0 else [2, 3])  # layer 1 in the model, in no rank's optimizer
    params = [p for n, p in fewer.named_parameters() if not n.startswith("layers.1.")]
    try:
        tplayers.load_checkpoint(fewer, path, optimizer=torch.optim.AdamW(params))
        results.append("loaded")
    except tplayers.io.CheckpointError as e:
        results.append(str(e))
    return results


def test_pipeline_stages_save_their_optimizers_into_one_checkpoint(tmp_path):
    """Issue 57. Before: save_checkpoint(stage, path, optimizer=...) with each rank its stage's optimizer was
    refused ("save each stage ... into a path of its own"). Now the ranks' optimizer states are one checkpoint's,
    resumed at another pipeline layout and whole, moments and hyperparameters; a saved parameter no rank's optimizer
    holds is named."""
    for other_layout, whole, fewer in get_world(2).run(_stages_with_optimizers, str(tmp_path / "ck")):
        assert other_layout is True and whole is True
        assert "no rank's optimizer holds them" in fewer and "layers.1.weight" in fewer, fewer
