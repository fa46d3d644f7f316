"""`check_same_inputs`: the TP ranks of one replica must be fed the same batch (opt-in, per forward);
`check_same_output_grads`: and compute the same loss on a gathered output (labels given outside the
forward); `check_same_rng_once`: and draw the same dropout masks (at the first training forward).

Every rank of a TP group computes on the same activations; a data loader that gives each rank a
different batch (Lightning's or DDP's distributed sampler over the TP ranks) trains a model that is
no rank's and no dense model's, silently. `check_same_inputs` makes that loud: a forward pre-hook
that hashes every tensor argument and compares the hashes across the TP group.
"""
from __future__ import annotations

import sys
from typing import Any, Callable, List, Mapping, Optional, Tuple

import torch
import torch.nn as nn
from torch.utils.hooks import RemovableHandle

from ..core.blocking import all_gather_text, bit_hash, bytes_hash, ranks_that_differ
from ..core.carried import Shared, carry, kind_of
from ..core.fingerprint import CollectivesOutOfStep, checks_enabled
from ..core.digest import digests, generator_states
from ..core.groups import GroupLike, refuse_replicating_wrapper, resolve_group
from .base import ShardIndex

__all__ = ["named_arguments", "in_pipeline_shape_inference", "check_same_inputs", "SequenceShardInputs",
           "check_same_output_grads", "check_same_rng_once", "has_dropout"]


def _tensors(value: Any, path: str, out: List[Tuple[str, torch.Tensor]]) -> None:
    """Every tensor in ``value`` with its path (``argument 0['input_ids']``), through dicts, lists and tuples."""
    if isinstance(value, torch.Tensor):
        out.append((path, value))
    elif isinstance(value, Mapping):
        for k in sorted(value, key=str):
            _tensors(value[k], f"{path}[{k!r}]", out)
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _tensors(v, f"{path}[{i}]", out)


def named_arguments(args: Tuple[Any, ...], kwargs: Mapping[str, Any]) -> List[Tuple[str, torch.Tensor]]:
    """Every tensor of a call's arguments with its path: ``argument 0['input_ids']``, ``argument 'labels'``."""
    named: List[Tuple[str, torch.Tensor]] = []
    for i, a in enumerate(args):
        _tensors(a, f"argument {i}", named)
    for k, v in sorted(kwargs.items()):
        _tensors(v, f"argument '{k}'", named)
    return named


_PIPELINE_INFERENCE = ("_forward_metadata_inference", "_backward_metadata_inference", "_shape_inference")


def in_pipeline_shape_inference() -> bool:
    """Whether this forward (or backward) is ``torch.distributed.pipelining.PipelineStage``'s shape inference:
    it runs a stage once on uninitialized activations (``torch.empty``, different on every rank) to learn the
    shapes it sends, and throws the results away. The first-forward checks (same inputs, same output
    gradients, the audit) wait for the next call instead of judging garbage. Read off the call stack (a few
    dozen frames, only on calls a check would otherwise judge)."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name in _PIPELINE_INFERENCE and \
                str(frame.f_globals.get("__name__", "")).startswith("torch.distributed.pipelining"):
            return True
        frame = frame.f_back
    return False


class SequenceShardInputs:
    """The arguments of a model that are sequence shards by design: each rank feeds its own chunk of the
    sequence straight to a layer that takes this rank's chunk (``entries``: a sequence-parallel column layer or
    norm; PyTorch's own TP example does, ``input_layouts=Shard(1)``). They differ across the TP ranks, so
    :func:`check_same_inputs` cannot ask them to be equal. An argument that differs at a checked forward is
    held back (``pending``) until the forward ends: if that very tensor entered one of ``entries`` it is a shard
    by design (``exempt`` from then on: left out of the inputs check and of the carried inputs digest, whose
    layers' own collectives check its shape); else the inputs check's error is raised then, on every rank (each
    rank's verdict is structural: the same on all)."""

    def __init__(self, model: nn.Module, entries: List[nn.Module]) -> None:
        self._model = id(model)  # (not the model: a deepcopy of an entry layer's hooks must not copy the model)
        self.exempt: set = set()  # argument paths (``argument 0``)
        self.pending: dict = {}  # path -> the tensor, while a forward that found it differing runs
        self._error = ""
        self._consumed: set = set()  # ids of the tensors that entered an entry layer in that forward
        for m in entries:
            m.register_forward_pre_hook(self._entered, with_kwargs=True)
        model.register_forward_pre_hook(self._begin)  # (before the inputs check's: registered first)
        model.register_forward_hook(self._settle)

    def _begin(self, module: nn.Module, *_: Any) -> None:
        if id(module) == self._model:  # (a forward that raised left its pending arguments unsettled: dropped)
            self.pending, self._consumed = {}, set()

    def skipped(self) -> set:
        return self.exempt | set(self.pending)

    def defer(self, named: List[Tuple[str, torch.Tensor]], differing: List[int], error: str) -> None:
        self.pending = {named[i][0]: named[i][1] for i in differing}
        self._error, self._consumed = error, set()

    def _entered(self, _: nn.Module, args: Tuple[Any, ...], kwargs: dict) -> None:
        if self.pending:
            first = args[0] if args else kwargs.get("hidden_states", kwargs.get("input"))
            if isinstance(first, torch.Tensor):
                self._consumed.add(id(first))

    def _settle(self, module: nn.Module, *_: Any) -> None:
        if id(module) != self._model or not self.pending:
            return  # (a copy of the model made with its hooks, as the audit's float32 copy, settles nothing)
        pending, self.pending = self.pending, {}
        if not all(id(t) in self._consumed for t in pending.values()):
            raise ValueError(self._error)
        self.exempt.update(pending)


def check_same_inputs(module: nn.Module, *, group: GroupLike, every: int = 1,
                      sequence_shards: Optional[SequenceShardInputs] = None) -> RemovableHandle:
    """Check, before the first and then every ``every``-th forward of ``module``, that each tensor in
    its arguments (nested dicts, lists and tuples included; keyword arguments such as ``labels`` too)
    is bitwise equal on every rank of the TP group; raise ValueError on every rank otherwise, naming
    the argument and the ranks that differ. Returns the hook handle (``.remove()`` to stop).

    Cost per checked forward: each input hashed (read once; on CUDA the hash is copied to the host,
    one sync) and one all-gather of four int64 per tensor. ``parallelize`` registers it with
    ``every=1000`` (its ``check_inputs``); inside ``torch.compile`` it does not run. ``sequence_shards``: the
    arguments fed as sequence shards by design are found and left out (:class:`SequenceShardInputs`).
    """
    tp = resolve_group(group)
    if every < 1:
        raise ValueError(f"check_same_inputs: every={every} must be >= 1")
    calls = [0]

    def hook(_: nn.Module, args: Tuple[Any, ...], kwargs: dict) -> None:
        if torch.compiler.is_compiling() or (tp.size > 1 and (calls[0] % every) == 0 and in_pipeline_shape_inference()):
            return
        calls[0] += 1
        if tp.size == 1 or (calls[0] - 1) % every:
            return
        refuse_replicating_wrapper(f"{type(module).__name__} forward", tp)  # a DDP over TP peers: the cause, named
        named = named_arguments(args, kwargs)
        # first the structure (how many tensors, their paths: a fixed-size exchange), then one hash row each
        mode = f"{'training' if module.training else 'eval'} mode, autograd {'on' if torch.is_grad_enabled() else 'off'}"
        layout = torch.cat([torch.tensor([len(named)]), bytes_hash(("|".join(n for n, _ in named) + mode).encode())])[None]
        if ranks_that_differ(layout, group=tp).any():
            modes = all_gather_text(mode, group=tp)  # (the error path: every rank is here)
            if len(set(modes)) > 1:  # not two batches: two different forwards (an evaluation on some ranks only)
                raise CollectivesOutOfStep(
                    f"tplayers: the TP ranks run different forwards of {type(module).__name__} (its forward #{calls[0]} "
                    "on each): " + "; ".join(f"rank {r}: {m}" for r, m in enumerate(modes)) + ". Every rank must run "
                    "the same forward and backward calls on the model (evaluation on every rank, not on rank 0 only)")
            raise ValueError(f"check_same_inputs: {type(module).__name__} forward #{calls[0]}: the TP ranks' arguments "
                             "differ in structure (number or names of tensors): every TP rank must see the same batch")
        if sequence_shards is not None:  # (sequence shards by design: their layers' collectives check their shapes)
            named = [(n, t) for n, t in named if n not in sequence_shards.exempt]
        if not named:
            return
        # the shape goes into the hash too: two ranks with different batch sizes must not collide
        hashes = torch.stack([torch.cat([bit_hash(t), bytes_hash(str(tuple(t.shape)).encode())]) for _, t in named])
        differ = ranks_that_differ(hashes, group=tp)  # (p, n)
        if differ.any():
            ranks, index = differ.nonzero()[0].tolist()
            shard = ShardIndex(module).find(named[index][1])  # (the error path: every rank is here)
            error = (f"check_same_inputs: {type(module).__name__} forward #{calls[0]}: {named[index][0]} "
                     f"differs between rank 0 and rank {ranks} of the TP group: " + (
                         f"it is {shard[0]}, a tensor-parallel layer's parameter that holds this rank's shard: code "
                         "that reads it as if it were whole computes on this rank's rows only (a head tied by reading "
                         "the embedding's table gives logits vocab / p wide); read it through its module (a head as "
                         "an nn.Linear sharing the weight, 'vocab_head' in the plan) or leave that layer whole"
                         if shard is not None else
                         "every TP rank must see the same batch (a distributed sampler over the TP ranks splits it; "
                         "in Lightning pass use_distributed_sampler=False when data_parallel_size=1)"))
            if sequence_shards is None:
                raise ValueError(error)
            error += (". (A chunk of the sequence fed to each rank by design is accepted when the model hands that "
                      "very tensor straight to the sequence-parallel layer; else parallelize(..., check_inputs=0).)")
            sequence_shards.defer(named, sorted(set(differ.nonzero()[:, 1].tolist())), error)

    return module.register_forward_pre_hook(hook, with_kwargs=True)


_RANDOM_CONFIG = ("dropout", "pdrop", "jitter", "noise")  # config names of values that make a forward draw random numbers


def has_dropout(model: nn.Module) -> bool:
    """Whether ``model`` may draw random numbers in training: a dropout module with p > 0, or a config value
    whose name says dropout or noise (Hugging Face's ``attention_dropout``, ``hidden_dropout``, GPT-2's
    ``attn_pdrop``, Mixtral's ``router_jitter_noise``)."""
    for m in model.modules():
        if isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0:
            return True
        config = getattr(m, "config", None)
        for k, v in (vars(config).items() if hasattr(config, "__dict__") else ()):
            if any(word in k for word in _RANDOM_CONFIG) and type(v) in (int, float) and v > 0:
                return True
    return False


def check_same_rng_once(module: nn.Module, *, group: GroupLike) -> RemovableHandle:
    """At ``module``'s first forward in training mode with autograd on, check that the TP ranks'
    default generators (CPU, and the current CUDA device's when CUDA is initialized) are in the same
    state; raise RuntimeError on every rank otherwise. A TP model draws its dropout masks from them:
    a replicated activation must get the same mask on every rank. Cost: one all-gather of two int64
    per generator, once; the hook removes itself after."""
    tp = resolve_group(group)
    handle: list = []

    def hook(_: nn.Module, args: Tuple[Any, ...]) -> None:
        if not module.training or not torch.is_grad_enabled():
            return  # evaluation draws no dropout: wait for the first training forward
        handle[0].remove()
        differ = ranks_that_differ(torch.stack([bit_hash(s) for s in generator_states()]), group=tp)
        if differ.any():
            ranks = differ.any(1).nonzero().flatten().tolist()
            raise RuntimeError(
                f"tplayers: the TP ranks' random generators differ at the first training step of a model that draws "
                f"random numbers (dropout, router noise) (rank(s) {ranks} vs rank 0): a replicated activation would get "
                "a different dropout mask, or a token a different route, on each rank, and the model would train wrong "
                "with no error. Seed every rank of a TP group alike "
                "(torch.manual_seed(seed), not seed + rank; with data parallelism, seed + dp_rank), and draw the "
                "same random numbers on each; or parallelize(..., check_consistency=False) to skip this check")

    handle.append(module.register_forward_pre_hook(hook))
    return handle[0]


OUTPUT_GRAD_ADVICE = ("Every TP rank must compute the loss on the same labels / targets (labels given to a loss outside "
                      "the model's forward, such as a pipeline schedule's loss_fn, are not checked with the inputs; a "
                      "distributed sampler over the TP ranks splits them)")


def check_same_output_grads(module: nn.Module, *, group: GroupLike, every: int = 1,
                            counting: Optional[nn.Module] = None,
                            watched: Optional[Callable[[], Optional[Tuple[nn.Module, Any]]]] = None
                            ) -> List[RemovableHandle]:
    """Check, in the backward of the first and then every ``every``-th forward of ``module`` (of
    ``counting``, an enclosing model, when given: every call of ``module`` inside it), that the
    gradient arriving at each of its output tensors is bitwise equal on every rank of the TP group;
    raise ValueError on every rank otherwise, naming the module. For a module whose output every rank
    holds whole (an LM head that gathers the logits): its gradient comes from the loss, so ranks whose
    losses differ (labels or targets that differ across TP ranks, passed to a loss outside the
    model's forward) would train each shard on another rank's loss, silently.

    Cost per checked backward: the gradient hashed (read once; on CUDA one sync) and one all-gather of
    four int64 per output tensor. Between the checks (collective checks on), every backward carries the gradient's
    digest (read once on its device, no sync, no collective) in the collectives that follow it
    (:func:`~tplayers.core.carried.carry`): ranks whose losses begin to differ are stopped at that step with
    :class:`~tplayers.RanksDiverged`. ``parallelize`` registers it on every layer that gathers its output,
    counting the model's forwards with its ``check_inputs`` schedule (the audit's extra call of a
    layer at the first step is then checked too); inside ``torch.compile`` it does not run. ``watched``: at each
    forward of ``module``, what to watch instead of its output: ``(the layer that made it, its output)``, or None
    (:func:`watch_last_row_output`). Returns the hook handles.
    """
    tp = resolve_group(group)
    if every < 1:
        raise ValueError(f"check_same_output_grads: every={every} must be >= 1")
    calls = [0]
    source = [module]  # the layer whose output is watched (this forward's)

    def check(grad: torch.Tensor) -> None:
        name = source[0].__dict__.get("_tplayers_path") or type(source[0]).__name__  # its path, once a collective ran
        hashes = torch.cat([bit_hash(grad), bytes_hash(str(tuple(grad.shape)).encode())])[None]
        differ = ranks_that_differ(hashes, group=tp)  # (p, 1)
        if differ.any():
            ranks = differ[:, 0].nonzero()[:, 0].tolist()
            raise ValueError(f"check_same_output_grads: the gradient of {name}'s output (every TP rank holds it whole) "
                             f"differs between rank 0 and rank(s) {ranks} of the TP group, in the backward of forward "
                             f"#{calls[0]}: the ranks' losses differ. {OUTPUT_GRAD_ADVICE}")

    def count(*_: Any) -> None:
        if tp.size > 1 and calls[0] % every == 0 and not torch.compiler.is_compiling() and \
                in_pipeline_shape_inference():
            return  # the next forward is the one checked
        calls[0] += 1

    def carry_digest(grad: torch.Tensor) -> None:
        """Between the checks: the gradient's digest rides in this backward's collectives (the head's own input-gradient
        collective comes next), cleared when the backward ends."""
        name = source[0].__dict__.get("_tplayers_path") or type(source[0]).__name__
        key = (id(module), "output gradient")
        carry(tp.process_group, key, Shared(f"the gradient of {name}'s output (every TP rank holds it whole: it comes "
                                            "from the loss)", ["output gradient"], digests([grad]), OUTPUT_GRAD_ADVICE,
                                            kinds=lambda: [kind_of(grad)]))
        torch.autograd.Variable._execution_engine.queue_callback(lambda: carry(tp.process_group, key, None))

    def hook(_: nn.Module, args: Tuple[Any, ...], out: Any) -> None:
        if counting is None:
            count()
        if torch.compiler.is_compiling() or tp.size == 1 or in_pipeline_shape_inference():
            return
        carry(tp.process_group, (id(module), "output gradient"), None)  # (a backward that raised left it)
        picked = (module, out) if watched is None else watched()
        if picked is None:
            return
        source[0], out = picked
        if getattr(source[0], "gather_output", True) is False:  # this call keeps its output split (loss_parallel)
            return
        scheduled = not (calls[0] - 1) % every
        if not scheduled and not checks_enabled():
            return
        named: List[Tuple[str, torch.Tensor]] = []
        _tensors(out, "output", named)
        for _, t in named:
            if t.requires_grad:
                t.register_hook(check if scheduled else carry_digest)

    handles = [module.register_forward_hook(hook)]
    if counting is not None:
        handles.append(counting.register_forward_pre_hook(count))
    return handles


def watch_last_row_output(model: nn.Module, rows: List[nn.Module], *, group: GroupLike, every: int = 1
                          ) -> List[RemovableHandle]:
    """:func:`check_same_output_grads` on the output of the last of ``rows`` (row layers without sequence
    parallelism: outputs every rank holds whole) to run in each forward of ``model``. What follows it is replicated
    or sums over the group, so its gradient is the same bits on every rank unless the ranks' losses differ: a
    pipeline stage ending in a row layer with the loss in the schedule's ``loss_fn`` (no gathered head to watch)
    whose targets differ across TP ranks is stopped at that step. One digest per forward (the last row's), not
    one per row layer."""
    last: List[Optional[Tuple[nn.Module, Any]]] = [None]

    def note(module: nn.Module, args: Tuple[Any, ...], out: Any) -> None:
        last[0] = (module, out)

    def take() -> Optional[Tuple[nn.Module, Any]]:
        picked, last[0] = last[0], None
        return picked

    def forget(*_: Any) -> None:  # (a forward the check skipped, PipelineStage's shape inference, left its row)
        last[0] = None

    handles = [row.register_forward_hook(note) for row in rows] + [model.register_forward_pre_hook(forget)]
    return handles + check_same_output_grads(model, group=group, every=every, watched=take)
