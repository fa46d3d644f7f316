"""Drop-in TP for existing models: swap named modules for TP layers, in place, in four steps.

    tplayers.parallelize(model, "llama", group=tp_group)   # a Hugging Face Llama-family model
    tplayers.parallelize(model, {"*.fc1": "column", "*.fc2": "row"}, group=tp_group)

match (each module -> the first plan pattern naming it) -> check (every style builds its result,
head-count attributes, tied parameters, row layers something feeds: nothing in the model changes
yet, so an error leaves it untouched) -> swap (replacements put in place, attributes changed, ties
restored) -> hooks (each ``Built.finish``, then the audit's first-forward hooks: see
:mod:`tplayers.convert.audit`). Errors name the module. What is refused: :mod:`tplayers.convert.refusals`;
the attribute changes: :mod:`tplayers.convert.attrs`; the report: :mod:`tplayers.convert.coverage`.

Style names (``STYLE_NAMES`` in :mod:`tplayers.convert.plan`):

    "column"           ColumnParallelLinear, output stays sharded (feeds a "row" or heads)
    "column_gather"    ColumnParallelLinear(gather_output=True): full output (e.g. an LM head)
    "fused_qkv"        column split per component of an equal-thirds fused [q; k; v] projection
    FusedQKV(heads=..) a fused [q; k; v] split by whole heads (counts or attribute paths; KV replicas)
    Column(parts=..)   column split per component of any fused projection (gate/up, GQA qkv)
    "kv_column"        K/V projection of GQA: split by KV heads, or replicated KV heads when there
                       are fewer than ranks (KVColumn(kv_heads=...): the count, or the attention's
                       attribute holding it; default the attention's KV heads, as many as its
                       heads when it keeps no KV count)
    "row"              RowParallelLinear, input sharded on the last dim, full output
    "vocab_embedding"  VocabParallelEmbedding (rows of the table split across ranks)
    "vocab_head"       ParallelLMHead(gather_output=True): an LM head (and its bias) split like the embedding
    "replicate"        left as it is (documents intent; matching it stops later patterns)
    "scatter_sequence" enter sequence parallelism: the module's input is cut along the sequence
    "gather_sequence"  the module's input is gathered along the sequence (a module that needs it whole)
    "sequence_parallel_norm"  a norm on this rank's sequence chunk (parameter grads all-reduced);
                       SequenceParallelNorm(gather_output=True) also gathers its output

``parallelize(model, "llama", group=g, sequence_parallel=True)`` uses the shipped plan's sequence-
parallel variant. GPT-2's ``Conv1D`` is accepted wherever ``nn.Linear`` is. Modules whose forward
reads the local head count get those attributes divided via the plan's ``divide_attrs``.
"""
from __future__ import annotations

import fnmatch
import types
from typing import Any, Dict, List, Mapping, Sequence, Tuple, Union

import torch.nn as nn

from ..core.collectives import wait_for_ranks
from ..core.sites import name_modules
from ..core.groups import GroupLike, TPGroup, resolve_group
from ..regions.partial_grads import PartialGradSum
from ..core.siblings import ColumnInputs
from ..layers.base import TensorParallelModule, carry_attributes, carry_hooks
from ..layers.experts import ParallelExperts
from ..layers.fused import FusedColumnParallelLinear
from ..layers.conv1d import is_conv1d
from ..layers.from_dense import casts_weight_to_input, stand_in
from ..layers.weight_cast import keep_input_dtype
from ..layers.outside_reads import refuse_outside_reads
from ..layers.shared_state import carry_shared_state
from ..layers.siblings import COLUMN_KINDS, declare_siblings
from ..layers.linear import RowParallelLinear
from ..layers.same_inputs import (SequenceShardInputs, check_same_inputs, check_same_output_grads, check_same_rng_once,
                                  has_dropout, watch_last_row_output)
from .attrs import Change, attr_changes
from .audit import AUDIT_ATTR, Auditor, find_regions
from .auto import auto_plan
from .auto_sequence import sequence_parallel_auto
from .invariant import apply_tp_invariant
from .loss_parallel import apply_loss_parallel
from .outputs import label_split_outputs, save_pretrained_whole
from .coverage import REPORT_ATTR, report_coverage
from .plan import Plan, resolve_style
from .plans import get_plan
from .refusals import (check_same_dense_model, refuse_lonely_columns, refuse_lonely_rows, refuse_no_match,
                       refuse_router_logits_argument, refuse_router_logits_in_config, refuse_unfitting_plan)
from .ties import keep_parameter_objects, ties_kept
from .twin import within
from .gated_mlp import keep_gated_mlp_rank_major
from .sequence import ReplicateReduceGrad, check_sequence_region, refuse_double_gather, takes_sequence_shards
from .styles import BuildContext, Built, Column, FusedQKV, KVColumn, Row, SequenceSwitch, Style
from .styles_embedding import KVEmbedding
from .styles_vocab import VocabEmbedding, VocabHead

__all__ = ["parallelize"]


def _match(modules: Dict[str, nn.Module], styles: Dict[str, Style]) -> Tuple[List[Tuple[str, str]], set]:
    """``[(module name, pattern)]`` for every module a pattern takes (not inside a module replaced by
    an earlier match: decided later, in :func:`_build`), and the set of patterns that matched."""
    matched, used = [], set()
    for name in modules:
        pat = next((p for p in styles if fnmatch.fnmatchcase(name, p)), None)
        if pat is None:
            continue
        used.add(pat)
        if name == "":
            raise ValueError(f"parallelize: pattern '{pat}' matches the root module; name a submodule")
        matched.append((name, pat))
    return matched, used


def _build(modules: Dict[str, nn.Module], matched: List[Tuple[str, str]], styles: Dict[str, Style],
           tp: TPGroup, column_inputs: ColumnInputs, tp_invariant: bool) -> Dict[str, Built]:
    """Every style's result, in model order; modules inside a replaced one are skipped."""
    built: Dict[str, Built] = {}
    replaced: List[str] = []
    switch = SequenceSwitch()  # one per call: every sequence-parallel layer and hook of this model
    partial_grads = PartialGradSum(tp)  # one per call: the norms' gradients summed by one all-reduce
    replica_sums: Dict[Any, PartialGradSum] = {}  # one per call: each attention's replicated k and v, summed at once
    for name, pat in matched:
        if any(name.startswith(r + ".") for r in replaced):
            continue
        module = modules[name]
        if isinstance(module, TensorParallelModule):
            raise ValueError(f"parallelize: module '{name}' is already tensor-parallel "
                             f"({type(module).__name__}); parallelize each model once")
        ctx = BuildContext(name=name, group=tp, parent=modules[name.rpartition(".")[0]], switch=switch,
                           partial_grads=partial_grads, replica_sums=replica_sums, column_inputs=column_inputs,
                           tp_invariant=tp_invariant)
        style = styles[pat]
        casts = False  # nanochat's Linear: its weight cast to the input's dtype in forward (layers/weight_cast.py)
        if isinstance(style, (Column, Row, KVColumn, FusedQKV, VocabHead, VocabEmbedding, KVEmbedding)) \
                and not is_conv1d(module):
            embedding = isinstance(style, (VocabEmbedding, KVEmbedding))
            casts = not embedding and casts_weight_to_input(module)
            module = stand_in(module, embedding) or module  # a Linear (an Embedding) in all but name
        try:
            built[name] = style.build(module, ctx)
            if casts and isinstance(built[name].module, TensorParallelModule):
                keep_input_dtype(built[name].module)
        except (ValueError, TypeError, AttributeError) as e:
            msg = str(e)
            raise type(e)(msg if msg.startswith("parallelize:") else f"parallelize: module '{name}' ({pat!r}): {msg}") from None
        if built[name].module is not modules[name]:
            replaced.append(name)
    return built


def _io(style: Style, module: nn.Module) -> Union[None, Tuple[bool, bool]]:
    """(input split, output split) of a converted module, or None for a module the style keeps as it is."""
    if isinstance(style, (Column, KVColumn, FusedQKV)):
        return False, not getattr(style, "gather_output", False)
    if isinstance(style, Row):
        return style.input_is_parallel, False
    if isinstance(style, VocabHead):
        return False, not style.gather_output
    if isinstance(style, VocabEmbedding):
        return False, False
    if isinstance(style, KVEmbedding):  # its KV heads' columns: the attention reading them is its partner
        return False, True
    if isinstance(module, TensorParallelModule):  # a style of the user's own that builds a TP layer
        split_out = isinstance(module, FusedColumnParallelLinear) or getattr(module, "gather_output", True) is False
        return bool(getattr(module, "input_is_parallel", False)), split_out
    return None


def _auditor(model: nn.Module, built: Dict[str, Built], styles: Dict[str, Style], matched: List[Tuple[str, str]],
             tp: TPGroup, plan_name: str, named: bool) -> Auditor:
    """The regions the audit checks (:mod:`tplayers.convert.audit`), found before the swap."""
    style_of = dict(matched)
    io: Dict[str, Tuple[bool, bool]] = {}
    reduce_grad: List[str] = []
    for name, b in built.items():
        style = styles[style_of[name]]
        if isinstance(style, ReplicateReduceGrad):
            reduce_grad.append(name)
        elif (kind := _io(style, b.module)) is not None:
            io[name] = kind
    heads = [n for n in io if isinstance(styles[style_of[n]], VocabHead) and io[n][1]]  # (logits shards: a loss's)
    regions = find_regions(io, reduce_grad, alone=heads)
    refuse_lonely_rows(model, io, regions, plan_name, named, tp)
    columns = {n for n in io if isinstance(styles[style_of[n]], (Column, KVColumn, FusedQKV))}
    refuse_lonely_columns(model, [n for n in regions if n in columns and io[n] == (False, True)], built, plan_name, tp)
    marks = {n: b.region for n, b in built.items() if b.region is not None}  # where sequence parallelism starts, ends
    return Auditor(model, regions, tp, plan_name, io, marks)


def _resolve_plan(model: nn.Module, plan: Union[str, Plan, Mapping[str, Union[str, Style]]],
                  sequence_parallel: bool, experts: str) -> Tuple[Plan, List[str], Dict[str, str]]:
    """(the Plan, Hugging Face plan keys that matched nothing, styles skipped): "auto" translates the
    model's own tp_plan; anything else is a shipped plan's name, a Plan or a dict."""
    if isinstance(plan, str) and plan == "auto":
        translated = auto_plan(model, experts=experts)
        if sequence_parallel and translated.plan.name != "auto":  # a shipped plan stands in for the family
            return get_plan(translated.plan.name, sequence_parallel=True), translated.unmatched, translated.skipped
        if sequence_parallel:  # the norms the plain layout left out are in the variant's region now
            sp = sequence_parallel_auto(model, translated.plan)
            return sp, translated.unmatched, {n: why for n, why in translated.skipped.items() if n not in sp.layers}
        return translated.plan, translated.unmatched, translated.skipped
    if experts != "ffn":
        raise ValueError(f"parallelize(..., experts={experts!r}) applies to the 'auto' plan; in a plan of your own "
                         "give the experts module Experts(splits=((name, 0, 1), ...)) for whole experts per rank "
                         "(dispatch='all_to_all' to send the tokens to them)")
    return get_plan(plan, sequence_parallel=sequence_parallel), [], {}


def _watch_ranks_in_step(model: nn.Module, tp: TPGroup, check_inputs: int, check_consistency: bool,
                         shard_reads: Sequence[str]) -> None:
    """The checks a converted model carries at run time: the same inputs on every TP rank (first
    forward, then every ``check_inputs``-th) and the same gradient of a gathered output (the same
    loss), the same dropout generators (first training forward); and at every forward, the digests of
    its inputs, generators and replicated parameters carried by its collectives (drift from step 2 on)."""
    if tp.size == 1:
        return
    name_modules(model)  # errors name modules by their paths in the model
    entries = [m for m in model.modules() if takes_sequence_shards(m)]
    shards = SequenceShardInputs(model, entries) if entries and check_inputs else None
    if check_inputs:
        check_same_inputs(model, group=tp, every=check_inputs, sequence_shards=shards)
        for module in model.modules():  # an output every rank holds whole: its gradient comes from the loss
            if isinstance(module, TensorParallelModule) and getattr(module, "gather_output", False):
                check_same_output_grads(module, group=tp, every=check_inputs, counting=model)
        rows = [m for m in model.modules() if isinstance(m, RowParallelLinear) and not m.sequence_parallel]
        if rows:  # (a stage ending in a row layer, the loss in the schedule: no gathered head to watch)
            watch_last_row_output(model, rows, group=tp, every=check_inputs)
    if check_consistency and has_dropout(model):
        check_same_rng_once(model, group=tp)  # before the audit's hooks: the audit forks the RNG anyway
    if check_consistency:
        refuse_outside_reads(model, shard_reads)  # a shard read by the model's own code as if whole (a tied head)
    if check_inputs or check_consistency:  # after the first-forward checks, whose messages are the more precise
        carry_shared_state(model, group=tp, inputs=bool(check_inputs), generators=check_consistency,
                           replicas=check_consistency, sequence_shards=shards)


def parallelize(model: nn.Module, plan: Union[str, Plan, Mapping[str, Union[str, Style]]], *,
                group: GroupLike, sequence_parallel: bool = False, check_consistency: bool = True,
                audit: bool = True, audit_skip: Sequence[str] = (), check_inputs: int = 1000, timeout: float = 300.0,
                loss_parallel: bool = False, experts: str = "ffn", tp_invariant: bool = False,
                shard_reads: Sequence[str] = ()) -> nn.Module:
    """Swap, in place, the modules ``plan`` names for TP layers holding this rank's shard.

    Every rank of ``group`` calls it on an identical dense model (same weights). Returns
    ``model``. All checks (module types, divisibility, head counts, tied weights) run before any
    module is swapped; errors name the module. Tied parameters (GPT-2's ``lm_head.weight`` and
    ``wte.weight``) stay tied when both modules are swapped with the same placement.
    ``sequence_parallel=True`` (shipped plans): activations between the TP layers are split along
    the sequence (its length must divide by the TP degree). ``check_consistency`` (default on):
    first verify that every rank holds the same dense model (one all-gather of two int64 hashes per
    tensor, and a pass over the weights to hash them, once), refusing a model that differs; and, on a
    model with dropout, that the ranks' random generators agree at its first training forward (one
    all-gather of two int64, once: per-rank seeds would give replicated activations different masks).
    ``check_inputs`` (default 1000): the TP ranks' inputs (every tensor of the arguments, nested and
    keyword ones such as ``labels`` included) must agree at the first forward and every
    ``check_inputs``-th after (:func:`~tplayers.layers.same_inputs.check_same_inputs`: a hash per tensor
    and two small all-gathers per checked forward), and on the same schedule the gradient of every
    gathered output (the logits of an LM head: a loss on labels that differ across TP ranks, given
    outside the forward, is refused in that backward; :func:`~tplayers.layers.same_inputs.check_same_output_grads`);
    0 turns both off. Between those checks every forward carries the digests of its inputs and, unless
    ``check_consistency=False``, of its random generators (a model that draws random numbers) and its
    replicated parameters in the fingerprint slot of its collectives (no extra collective;
    :func:`~tplayers.layers.shared_state.carry_shared_state`): a rank that drifts later raises
    :class:`~tplayers.RanksDiverged` at that step. ``timeout``: a rank that does not
    call ``parallelize`` within that many seconds is named in an error on the others (gloo groups).
    ``audit`` (default on): the first forward checks one instance of each distinct converted region
    (an attention, an MLP, the embedding, the head) against its dense twin, output and every
    gradient, and raises :class:`~tplayers.convert.audit.AuditError` on every rank on a mismatch
    (see :mod:`tplayers.convert.audit`; its result is in ``tplayers.coverage(model).audit``).
    ``audit_skip``: region-name patterns (``"model.layers.*.self_attn"``) the audit leaves out, each with
    every region like it, reported as skipped by your choice: the way to train a region whose dense twin
    cannot run (the audit refuses it, naming this) without turning the whole audit off; a pattern that
    matches no region is refused.
    ``experts`` ("auto" plans of MoE models): ``"ffn"`` (default) splits every expert's ffn across the
    ranks; ``"whole"`` gives each rank whole experts (``num_experts / p`` of them: expert parallelism over
    the TP group, GEMMs kept whole, compute per rank as the router balances it); both sum the partial
    outputs with one all-reduce each way (:class:`~tplayers.layers.experts.ParallelExperts`);
    ``"all_to_all"``: whole experts per rank, each rank sending its share of the routed tokens to the
    experts' ranks and back (two all-to-alls each way; :mod:`tplayers.layers.token_dispatch`); the one
    layout MoE models take with ``sequence_parallel=True`` (each rank then sends its own chunk's tokens;
    ``output_router_logits=True`` refused: the load-balancing loss would be each chunk's).
    ``loss_parallel`` (Hugging Face causal LMs): called with ``labels``, the LM head keeps its
    vocabulary shard and the model's loss runs on it (`vocab_parallel_cross_entropy`: no all-gather of
    the logits, each rank holds 1/p of them); ``outputs.logits`` is then this rank's shard labelled as one, a
    DTensor of shape ``(b, s, V)``, ``Shard(-1)`` over the TP group; without labels the logits are gathered
    whole (:mod:`tplayers.convert.loss_parallel`).
    ``tp_invariant``: every sum TP splits (the row layers' contraction, the column layers' input gradient) is one
    fixed tree over ``tplayers.core.invariant.LEAVES`` leaves, so logits, loss, gradients and the parameters after
    optimizer steps are the same bits at TP 1 (``group=None``), 2, 4 and 8 (:mod:`tplayers.core.invariant`);
    with ``sequence_parallel`` and per-head norms, the replicated modules with partial gradients run leaf by leaf
    (:func:`~tplayers.convert.invariant.run_in_leaves`), with ``loss_parallel`` the softmax's sums are the tree too;
    it takes column / row layers, fused projections, the vocabulary-parallel embedding and head, and refuses the
    rest, named (and a training forward that draws dropout masks).
    ``shard_reads``: parameter-name patterns (``"*.attn.wkv_b.weight"``) that the model's own code reads outside
    their layer by design, knowing each rank holds its shard (DeepSeek-V3's absorbed attention reads its own heads
    of ``wkv_b.weight``, as its own tensor parallelism does): not refused at the first forward. For inference; in
    training such a read bypasses the layer's collectives, which the audit finds (the input gradient differs).
    """
    tp = resolve_group(group)
    shard_reads = (shard_reads,) if isinstance(shard_reads, str) else tuple(shard_reads)
    if isinstance(check_inputs, bool) or not isinstance(check_inputs, int) or check_inputs < 0:
        raise ValueError(f"parallelize: check_inputs={check_inputs!r} must be an integer >= 0 (0: off)")
    wait_for_ranks(tp, timeout, "parallelize")  # a rank that never calls it is named, not waited for
    if check_consistency:  # first: a rank whose model differs may fail differently in the checks below
        check_same_dense_model(model, tp)
    p, unmatched_keys, skipped = _resolve_plan(model, plan, sequence_parallel, experts)
    styles = {pat: resolve_style(v, pat) for pat, v in p.layers.items()}
    modules = dict(model.named_modules())
    # match -> check: nothing in the model changes until every check passed
    matched, used = _match(modules, styles)
    if isinstance(plan, str):
        refuse_unfitting_plan(model, p.name, styles, used)
    refuse_double_gather(p.name, {name: styles[pat] for name, pat in matched})
    column_inputs = ColumnInputs()  # one per call: what the model's forward has in flight for its column layers
    built = _build(modules, matched, styles, tp, column_inputs, tp_invariant)
    check_sequence_region(p.name, {n: b.region for n, b in built.items()})
    chunked_experts = [n for n, b in built.items() if isinstance(b.module, ParallelExperts) and b.module.sequence_parallel]
    if chunked_experts:
        refuse_router_logits_in_config(model, chunked_experts)
    refuse_no_match(model, modules, built, styles, p)
    changes = attr_changes(modules, p, tp)
    retie = ties_kept(model, modules, built)  # tied inside: re-tied; held outside: refused
    auditor = _auditor(model, built, styles, matched, tp, p.name, isinstance(plan, str))  # reads the dense modules' attributes
    if tp_invariant:  # (on the built layers: refused before the model changes)
        apply_tp_invariant(model, {n: b.module for n, b in built.items()}, tp)
    _swap(model, modules, built, changes, retie, auditor, column_inputs)  # swap -> siblings -> hooks
    auditor.skip(audit_skip)
    object.__setattr__(model, AUDIT_ATTR, auditor)  # a plain attribute: not a submodule, not in the state dict
    _at_the_boundary(model, tp, built, loss_parallel, tp_invariant)
    _watch_ranks_in_step(model, tp, check_inputs, check_consistency, shard_reads)
    if chunked_experts:
        refuse_router_logits_argument(model, chunked_experts)
    if audit:
        auditor.arm()
    report_coverage(model, p, plan, built, modules, styles, matched, used, unmatched_keys, skipped)
    getattr(model, REPORT_ATTR).audit = auditor.report
    return model


def _swap(model: nn.Module, modules: Dict[str, nn.Module], built: Dict[str, Built], changes: List[Change],
          retie: List[Tuple[nn.Module, str, nn.Module, str]], auditor: Auditor,
          column_inputs: ColumnInputs) -> None:
    """Put the built modules in place (the user's hooks carried over), make the attribute changes, re-tie
    tied parameters, declare each region's column layers siblings, then let each style finish (its hooks)
    with the auditor recording what was there."""
    for name, b in built.items():
        if b.module is not modules[name]:
            parent_name, _, child = name.rpartition(".")
            setattr(modules[parent_name] if parent_name else model, child, b.module)
            carry_hooks(modules[name], b.module)  # hooks user code put on the dense module stay (the audit checks them)
            carry_attributes(modules[name], b.module)  # and the plain attributes the model's code may read
    auditor.record_originals([(m, attr, m._buffers[attr] if attr in m._buffers else vars(m)[attr])  # (buffers too)
                              for m, attr, _ in changes if attr in vars(m) or attr in m._buffers])
    for module, attr, value in changes:
        setattr(module, attr, value)
    for dst, a, src, a0 in retie:
        setattr(dst, a, getattr(src, a0))
    keep_parameter_objects(model, modules, built)
    _declare_siblings(model, [r.name for r in auditor.regions], column_inputs)
    for region in auditor.regions:  # a stock gated MLP: its tokens rank-major between its GEMMs (SP)
        keep_gated_mlp_rank_major(model.get_submodule(region.name))
    auditor.before_hooks(model)
    for b in built.values():
        if b.finish is not None:
            b.finish()
    auditor.after_swap(model)


def _declare_siblings(model: nn.Module, regions: List[str], column_inputs: ColumnInputs) -> None:
    """The column layers of each region (q/k/v, gate/up, a LoRA's base layer among them) are declared one set:
    those a forward calls on one input share its input-gradient collective (`tplayers.core.siblings`). A
    column layer outside every region is a set alone (the LM head: it may take a gathered sequence's shard)."""
    sets: Dict[str, List[nn.Module]] = {}
    for name, module in model.named_modules():
        if isinstance(module, COLUMN_KINDS) and (module.group.size > 1 or module.tp_invariant):  # (its sum: TP 1's)
            inside = [r for r in regions if within(name, r)]
            sets.setdefault(max(inside, key=len) if inside else name, []).append(module)
    for members in sets.values():
        declare_siblings(*members, inputs=column_inputs)


def _at_the_boundary(model: nn.Module, tp: TPGroup, built: Dict[str, Built], loss_parallel: bool,
                     tp_invariant: bool) -> None:
    """What the model hands out: the loss on split logits (at TP 1 too with ``tp_invariant``: its sums are the fixed
    tree at every degree), split outputs labelled, ``save_pretrained`` whole."""
    if loss_parallel and (tp.size > 1 or tp_invariant):
        apply_loss_parallel(model, tp, tp_invariant)
    if tp.size == 1:
        return
    if hasattr(model, "config"):  # a Hugging Face model: split hidden states / attentions labelled
        label_split_outputs(model, tp, sequence_parallel=any(b.region for b in built.values()))
    if callable(getattr(type(model), "save_pretrained", None)):
        object.__setattr__(model, "save_pretrained", types.MethodType(save_pretrained_whole, model))
