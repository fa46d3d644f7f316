"""Drop-in TP for existing models: swap named modules for TP layers, in place, in four steps.

    tplayers.parallelize(model, "llama", group=tp_group)   # a Hugging Face Llama-family model
    tplayers.parallelize(model, {"*.fc1": "column", "*.fc2": "row"}, group=tp_group)

match (each module -> the first plan pattern naming it) -> check (every style builds its result,
head-count attributes, tied parameters, row layers something feeds: nothing in the model changes
yet, so an error leaves it untouched) -> swap (replacements put in place, attributes changed, ties
restored) -> hooks (each ``Built.finish``, then the audit's first-forward hooks: see
:mod:`tplayers.convert.audit`). Errors name the module.

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

import copy
import fnmatch
import types
import warnings
from typing import Any, Dict, List, Mapping, Sequence, Tuple, Union

import torch
import torch.nn as nn

from ..core.collectives import bit_hash, ranks_that_differ, wait_for_ranks
from ..core.fingerprint import name_modules
from ..core.groups import GroupLike, TPGroup, resolve_group
from ..core.partial_grads import PartialGradSum
from ..core.placement import require_divisible
from ..layers.base import TensorParallelModule, carry_hooks, placements_of
from ..layers.experts import ParallelExperts
from ..layers.fused import FusedColumnParallelLinear
from ..layers.outside_reads import refuse_outside_reads
from ..layers.shared_state import carry_shared_state
from ..layers.same_inputs import (SequenceShardInputs, check_same_inputs, check_same_output_grads, check_same_rng_once,
                                  has_dropout)
from .audit import AUDIT_ATTR, Auditor, find_regions
from .auto import auto_plan, sequence_parallel_auto
from .loss_parallel import apply_loss_parallel
from .outputs import label_split_outputs
from .coverage import REPORT_ATTR, build_report
from .plan import Plan, resolve_style
from .plans import get_plan
from .sequence import ReplicateReduceGrad, check_sequence_region, refuse_double_gather, takes_sequence_shards
from .styles import (BuildContext, Built, Column, FusedQKV, KVColumn, Row, SequenceSwitch, Style, VocabEmbedding, VocabHead,
                     getattr_path)

__all__ = ["parallelize"]

_Change = Tuple[nn.Module, str, object]


_ROUTER_LOGITS = ("the load-balancing loss of transformers' MoE models (output_router_logits=True) averages the router "
                  "over every token of the batch; under sequence parallelism each rank routes its own chunk, so the "
                  "loss would be each chunk's, not the batch's")


def _refuse_router_logits_in_config(model: nn.Module, experts: List[str]) -> None:
    """MoE experts on sequence chunks (``experts``): refuse a model whose config adds the router's
    load-balancing loss to its loss (it would be each rank's chunk's)."""
    config = getattr(model, "config", None)
    get_text = getattr(config, "get_text_config", None)
    configs = [config, get_text() if callable(get_text) else None, getattr(config, "text_config", None)]
    if any(getattr(c, "output_router_logits", False) for c in configs if c is not None):
        raise ValueError(f"parallelize(..., sequence_parallel=True): MoE experts {experts[:2]}: {_ROUTER_LOGITS}; set "
                         "config.output_router_logits=False or use sequence_parallel=False")


def _refuse_router_logits_argument(model: nn.Module, experts: List[str]) -> None:
    """The same at every call: a forward given ``output_router_logits=True`` raises."""
    def pre_hook(module: nn.Module, args: Any, kwargs: Dict[str, Any]) -> None:
        if kwargs.get("output_router_logits"):
            raise ValueError(f"{type(module).__name__}(output_router_logits=True) with MoE experts {experts[:2]} on "
                             f"sequence chunks (parallelize(..., sequence_parallel=True)): {_ROUTER_LOGITS}; call it "
                             "without output_router_logits, or parallelize with sequence_parallel=False")
    model.register_forward_pre_hook(pre_hook, with_kwargs=True)


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
           tp: TPGroup) -> Dict[str, Built]:
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
                           partial_grads=partial_grads, replica_sums=replica_sums)
        try:
            built[name] = styles[pat].build(module, ctx)
        except (ValueError, TypeError, AttributeError) as e:
            msg = str(e)
            raise type(e)(msg if msg.startswith("parallelize:") else f"parallelize: module '{name}' ({pat!r}): {msg}") from None
        if built[name].module is not module:
            replaced.append(name)
    return built


def _attr_targets(modules: Dict[str, nn.Module], pattern: str) -> List[str]:
    """The modules an attribute entry's ``pattern`` names: those it matches that no ancestor of theirs matches
    too. (``*`` also matches dots, so ``"blocks.*"`` matches ``blocks.0`` and every module inside it; the
    attributes are those of the blocks.)"""
    named: List[str] = []
    for name in modules:
        if fnmatch.fnmatchcase(name, pattern) and not any(name.startswith(n + ".") for n in named if n):
            named.append(name)
    return named


def _attr_changes(modules: Dict[str, nn.Module], plan: Plan, tp: TPGroup) -> List[_Change]:
    """Check the plan's head-count attributes and return the changes to make (none made here)."""
    changes: List[_Change] = []
    for pat, paths in plan.require_divisible.items():
        for name in _attr_targets(modules, pat):
            for path in paths:
                try:
                    value = getattr_path(modules[name], path)
                except AttributeError as e:
                    raise AttributeError(f"parallelize: module '{name}' ({pat!r}): {e}") from None
                require_divisible(value, tp.size, f"parallelize: module '{name}'", path)
    for pat, fn in plan.set_attrs.items():
        for name in _attr_targets(modules, pat):
            changes.extend((modules[name], attr, value) for attr, value in fn(modules[name], tp.size).items())
    for pat, attrs in plan.divide_attrs.items():
        for name in _attr_targets(modules, pat):
            changes.extend(_divided(modules[name], name, attrs, plan.name, tp))
    return changes


def _divided(module: nn.Module, name: str, attrs: Tuple[str, ...], plan_name: str, tp: TPGroup) -> List[_Change]:
    """The changes dividing ``attrs`` of ``module`` by the TP degree. A dotted path (``config.n_head``) divides
    the attribute of a copy of each object on the way (a config object the layers share gets one copy per
    module, so the others, and the dense twin, keep the dense count). ``"cache_k:2"``: a tensor (a KV cache shaped
    by the heads) cut along dim 2 into this rank's part, a copy (the dense twin keeps the whole one)."""
    changes: List[_Change] = []
    copies: Dict[str, Any] = {}  # dotted prefix -> this module's copy of the object there
    tp_size = tp.size
    for attr in attrs:
        optional, attr = attr.endswith("?"), attr.rstrip("?")
        attr, _, cut = attr.partition(":")
        try:
            value = getattr_path(module, attr)
        except AttributeError:
            if optional:
                continue
            raise AttributeError(f"parallelize: module '{name}' ({type(module).__name__}) has no attribute "
                                 f"'{attr}' that plan '{plan_name}' divides by the TP degree") from None
        if cut:
            changes.append((module, attr, _cut_tensor(value, cut, f"parallelize: module '{name}'", attr, tp)))
            continue
        divided = _divided_value(value, f"parallelize: module '{name}'", attr, tp_size)
        *path, last = attr.split(".")
        if not path:
            changes.append((module, attr, divided))
            continue
        owner: Any = module
        for i, part in enumerate(path):
            prefix = ".".join(path[:i + 1])
            if prefix not in copies:
                copies[prefix] = copy.copy(getattr(owner, part))
                if i == 0:
                    changes.append((module, part, copies[prefix]))
                else:
                    setattr(owner, part, copies[prefix])  # (owner is this module's own copy)
            owner = copies[prefix]
        setattr(owner, last, divided)
    return changes


def _divided_value(value: Any, where: str, attr: str, tp_size: int) -> Any:
    """An int divided by the TP degree, or a tuple / list of ints (OLMo's ``fused_dims``: the widths a fused
    projection's output is split by) divided element by element."""
    if isinstance(value, (tuple, list)) and value and all(isinstance(v, int) for v in value):
        return type(value)(require_divisible(v, tp_size, where, f"{attr}[{i}]") for i, v in enumerate(value))
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{where}: divide_attrs divides an int or a tuple of ints; '{attr}' is a "
                         f"{type(value).__name__} ({value!r}): set it with set_attrs, or cut a tensor with "
                         f"'{attr}:<dim>'")
    return require_divisible(value, tp_size, where, attr)


def _cut_tensor(value: Any, cut: str, where: str, attr: str, tp: TPGroup) -> torch.Tensor:
    """This rank's part of tensor ``value`` along dim ``cut`` (``divide_attrs`` ``"name:dim"``)."""
    if not isinstance(value, torch.Tensor) or isinstance(value, nn.Parameter) or not cut.lstrip("-").isdigit():
        raise ValueError(f"{where}: divide_attrs '{attr}:{cut}' cuts a tensor (not a parameter: the plan's layers "
                         f"own those) along an integer dim; '{attr}' is a {type(value).__name__}")
    dim = int(cut)
    if not -value.dim() <= dim < value.dim():
        raise ValueError(f"{where}: divide_attrs '{attr}:{cut}': {attr} has {value.dim()} dims")
    require_divisible(value.shape[dim], tp.size, where, f"{attr}.shape[{dim}]")
    return value.chunk(tp.size, dim)[tp.rank].clone()


def _ties(model: nn.Module, modules: Dict[str, nn.Module],
          built: Dict[str, Built]) -> List[Tuple[nn.Module, str, nn.Module, str]]:
    """Tied parameters (one tensor, several names): both sides replaced with the same placement and
    shape (re-tied after the swap), or an error."""
    by_id: Dict[int, List[str]] = {}
    for pname, param in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(param), []).append(pname)
    new = {n: b.module for n, b in built.items() if b.module is not modules[n]}  # the replaced modules
    retie = []
    for names in (ns for ns in by_id.values() if len(ns) > 1):
        owners = [(n.rpartition(".")[0], n.rpartition(".")[2]) for n in names]
        swapped = [o for o in owners if o[0] in new]
        if not swapped:
            continue
        if len(swapped) != len(owners):
            raise ValueError(f"parallelize: parameters {names} are tied (one tensor) but the plan swaps only "
                             f"{[m + '.' + a for m, a in swapped]}: swap all of them or none")
        (m0, a0), rest = owners[0], owners[1:]
        p0 = placements_of(new[m0]).get(a0)
        for m, a in rest:
            pm = placements_of(new[m]).get(a)
            if pm != p0 or getattr(new[m], a).shape != getattr(new[m0], a0).shape:
                raise ValueError(f"parallelize: tied parameters '{m0}.{a0}' and '{m}.{a}' get different TP placements "
                                 f"({p0} vs {pm}); they cannot stay tied")
            retie.append((new[m], a, new[m0], a0))
    return retie


def _refuse_unfitting_plan(model: nn.Module, plan_name: str, styles: Dict[str, Style], used: set) -> None:
    """A shipped plan most of whose patterns match nothing was written for another family's module names (the
    "llama" plan on Phi or OPT: q/k/v split, no row layer after them, a shape error inside the model)."""
    missing = [pat for pat in styles if pat not in used]
    if len(missing) * 2 > len(styles):
        raise ValueError(f"parallelize: plan '{plan_name}' does not fit {type(model).__name__}: {len(missing)} of its "
                         f"{len(styles)} patterns match no module ({missing[:4]}; only {sorted(used)[:4]} match): it "
                         "was written for the module names "
                         f"of the '{plan_name}' family. Use 'auto' (the model's own tp_plan, for Hugging Face models) "
                         "or a plan of your own (docs/models.md)")


def _refuse_no_match(model: nn.Module, modules: Dict[str, nn.Module], built: Dict[str, Built],
                     styles: Dict[str, Style], plan: Plan) -> None:
    if not any(b.module is not modules[n] or b.finish is not None for n, b in built.items()):
        raise ValueError(f"parallelize: plan '{plan.name}' matched no module of {type(model).__name__} "
                         f"(patterns {list(styles)}); module names look like {list(modules)[1:6]}")


def _describe(built: Dict[str, Built], modules: Dict[str, nn.Module], styles: Dict[str, Style],
              matched: List[Tuple[str, str]]) -> Dict[str, str]:
    """module -> what it became, for the coverage report."""
    style_of = dict(matched)
    out = {}
    for name, b in built.items():
        if b.module is not modules[name]:
            note = getattr(b.module, "_coverage_note", None)  # (e.g. a kernel it cannot take at its shard's shape)
            out[name] = type(b.module).__name__ + (f" ({note})" if note else "")
        elif b.label is not None:
            out[name] = b.label
        elif b.finish is not None:
            out[name] = f"{type(b.module).__name__} with {type(styles[style_of[name]]).__name__} hooks"
    return out


def _check_same_dense_model(model: nn.Module, tp: TPGroup) -> None:
    """Every rank must hold the same dense weights: each shards its own copy, so copies that differ
    would be stitched into a model no rank ever had. One all-gather of two hashes per tensor."""
    tp_owned = {f"{m}." for m, mod in model.named_modules() if isinstance(mod, TensorParallelModule) and m}
    tensors = [(n, t) for n, t in list(model.named_parameters()) + list(model.named_buffers())
               if t.device.type != "meta"  # a meta model gets its weights later (load_dense)
               and not any(n.startswith(prefix) for prefix in tp_owned)]  # already sharded: differ by design
    if tp.size == 1 or not tensors:
        return
    differ = ranks_that_differ(torch.stack([bit_hash(t) for _, t in tensors]), group=tp)  # (p, n)
    if differ.any():
        ranks, index = differ.nonzero()[0].tolist()
        raise ValueError(f"parallelize: '{tensors[index][0]}' differs between rank 0 and rank {ranks} of the TP group: "
                         "every rank must start from the same dense model (build it under the same seed, or load "
                         "the same checkpoint, on every rank); check_consistency=False skips this check")


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
    regions = find_regions(io, reduce_grad)
    _refuse_lonely_rows(model, io, regions, plan_name, named, tp)
    columns = {n for n in io if isinstance(styles[style_of[n]], (Column, KVColumn, FusedQKV))}
    _refuse_lonely_columns(model, [n for n in regions if n in columns and io[n] == (False, True)], built, plan_name, tp)
    marks = {n: b.region for n, b in built.items() if b.region is not None}  # where sequence parallelism starts, ends
    return Auditor(model, regions, tp, plan_name, io, marks)


def _refuse_lonely_rows(model: nn.Module, io: Dict[str, Tuple[bool, bool]], regions: List[str], plan_name: str,
                        named: bool, tp: TPGroup) -> None:
    """A row layer no column layer feeds takes its whole input as if it were this rank's shard: the
    forward crashes inside the model, or worse. A shipped or "auto" plan that leaves one is applied to a
    model it does not fit (the "llama" plan on fused ``qkv_proj`` / ``gate_up_proj``): refused. In a plan
    of your own it may be meant (you split the input yourself): a warning at TP > 1."""
    lonely = [n for n in regions if io.get(n, (False, False))[0]]
    if not lonely:
        return
    msg = (f"parallelize: plan '{plan_name}': row-parallel {lonely[:3]} {'have' if len(lonely) > 1 else 'has'} no "
           "column-parallel layer feeding it in any enclosing module, so it would take its whole input as this rank's "
           "shard")
    if named:
        raise ValueError(f"{msg}: the plan does not fit {type(model).__name__} (are its q/k/v or gate/up projections "
                         "fused, or named differently?); give a plan of your own")
    if tp.size > 1:  # (a world of one splits nothing)
        warnings.warn(f"{msg}; make sure its input arrives split on the last dim", stacklevel=4)


def _refuse_lonely_columns(model: nn.Module, lonely: List[str], built: Dict[str, Built], plan_name: str,
                           tp: TPGroup) -> None:
    """A column layer whose split output no row layer takes (none in any enclosing module), beside a linear
    layer the plan left whole, hands that layer this rank's shard of its features as if it were the whole: a
    crash inside the model, or worse (nanochat's MLP with ``c_proj`` left out of the plan). Refused at TP > 1.
    A lone column with no such neighbour is a model's split output (its caller takes the shard: logits for a
    vocabulary-parallel loss), as before."""
    if tp.size == 1:
        return
    modules = dict(model.named_modules())
    for name in lonely:
        parent = name.rpartition(".")[0]
        whole = [f"{parent}.{c}" if parent else c for c, m in modules[parent].named_children()
                 if isinstance(m, nn.Linear) and (f"{parent}.{c}" if parent else c) not in built]
        if whole:
            raise ValueError(
                f"parallelize: plan '{plan_name}': column-parallel '{name}' has no row-parallel layer after it in any "
                f"enclosing module, and its neighbour {whole[:3]} (an nn.Linear the plan leaves whole) would take "
                "this rank's shard of its output features as the whole. Add the layer that consumes it to the plan as "
                "'row' (an MLP's down projection, an attention's output projection), or gather its output "
                "(Column(gather_output=True))")


def _keep_parameter_objects(model: nn.Module, modules: Dict[str, nn.Module], built: Dict[str, Built]) -> None:
    """Each swapped module's direct parameters move into the dense Parameter objects of the same name
    they were built from (``param.data`` = this rank's shard), so whatever already holds the dense
    model's parameters (an optimizer built before ``parallelize``, a hook, a parameter list) holds the
    TP ones: an optimizer built first steps the TP model instead of orphaned dense tensors. Tied
    parameters stay tied (every reference to a replaced parameter is replaced)."""
    kept: Dict[int, nn.Parameter] = {}  # id(the TP layer's new parameter) -> the dense Parameter now holding it
    claimed: set = set()
    for name, b in built.items():
        old, new = modules[name], b.module
        if new is old:
            continue
        for pname, p_new in new.named_parameters(recurse=False):
            p_old = old._parameters.get(pname)
            if (p_old is None or id(p_new) in kept or id(p_old) in claimed or type(p_old) is not nn.Parameter
                    or p_old.requires_grad != p_new.requires_grad or p_old.device != p_new.device):
                continue
            p_old.data = p_new.data
            kept[id(p_new)] = p_old
            claimed.add(id(p_old))
    for module in model.modules():
        for pname, param in list(module._parameters.items()):
            if param is not None and id(param) in kept:
                module._parameters[pname] = kept[id(param)]


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


def _watch_ranks_in_step(model: nn.Module, tp: TPGroup, check_inputs: int, check_consistency: bool) -> None:
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
    if check_consistency and has_dropout(model):
        check_same_rng_once(model, group=tp)  # before the audit's hooks: the audit forks the RNG anyway
    if check_consistency:
        refuse_outside_reads(model)  # a shard read by the model's own code as if whole (a head tied by reading)
    if check_inputs or check_consistency:  # after the first-forward checks, whose messages are the more precise
        carry_shared_state(model, group=tp, inputs=bool(check_inputs), generators=check_consistency,
                           replicas=check_consistency, sequence_shards=shards)


def parallelize(model: nn.Module, plan: Union[str, Plan, Mapping[str, Union[str, Style]]], *,
                group: GroupLike, sequence_parallel: bool = False, check_consistency: bool = True,
                audit: bool = True, audit_skip: Sequence[str] = (), check_inputs: int = 1000, timeout: float = 300.0,
                loss_parallel: bool = False, experts: str = "ffn") -> nn.Module:
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
    """
    tp = resolve_group(group)
    if isinstance(check_inputs, bool) or not isinstance(check_inputs, int) or check_inputs < 0:
        raise ValueError(f"parallelize: check_inputs={check_inputs!r} must be an integer >= 0 (0: off)")
    wait_for_ranks(tp, timeout, "parallelize")  # a rank that never calls it is named, not waited for
    if check_consistency:  # first: a rank whose model differs may fail differently in the checks below
        _check_same_dense_model(model, tp)
    p, unmatched_keys, skipped = _resolve_plan(model, plan, sequence_parallel, experts)
    styles = {pat: resolve_style(v, pat) for pat, v in p.layers.items()}
    modules = dict(model.named_modules())
    # match -> check: nothing in the model changes until every check passed
    matched, used = _match(modules, styles)
    if isinstance(plan, str):
        _refuse_unfitting_plan(model, p.name, styles, used)
    refuse_double_gather(p.name, {name: styles[pat] for name, pat in matched})
    built = _build(modules, matched, styles, tp)
    check_sequence_region(p.name, {n: b.region for n, b in built.items()})
    chunked_experts = [n for n, b in built.items() if isinstance(b.module, ParallelExperts) and b.module.sequence_parallel]
    if chunked_experts:
        _refuse_router_logits_in_config(model, chunked_experts)
    _refuse_no_match(model, modules, built, styles, p)
    changes = _attr_changes(modules, p, tp)
    retie = _ties(model, modules, built)
    auditor = _auditor(model, built, styles, matched, tp, p.name, isinstance(plan, str))  # reads the dense modules' attributes
    # swap -> hooks
    for name, b in built.items():
        if b.module is not modules[name]:
            parent_name, _, child = name.rpartition(".")
            setattr(modules[parent_name] if parent_name else model, child, b.module)
            carry_hooks(modules[name], b.module)  # hooks user code put on the dense module stay (the audit checks them)
    auditor.record_originals([(m, attr, vars(m)[attr]) for m, attr, _ in changes if attr in vars(m)])
    for module, attr, value in changes:
        setattr(module, attr, value)
    for dst, a, src, a0 in retie:
        setattr(dst, a, getattr(src, a0))
    _keep_parameter_objects(model, modules, built)
    auditor.before_hooks(model)
    for b in built.values():
        if b.finish is not None:
            b.finish()
    auditor.after_swap(model)
    auditor.skip(audit_skip)
    object.__setattr__(model, AUDIT_ATTR, auditor)  # a plain attribute: not a submodule, not in the state dict
    if loss_parallel and tp.size > 1:
        apply_loss_parallel(model, tp)
    if tp.size > 1 and hasattr(model, "config"):  # a Hugging Face model: split hidden states / attentions labelled
        label_split_outputs(model, tp, sequence_parallel=any(b.region for b in built.values()))
    if tp.size > 1 and callable(getattr(type(model), "save_pretrained", None)):
        object.__setattr__(model, "save_pretrained", types.MethodType(_save_pretrained_whole, model))
    _watch_ranks_in_step(model, tp, check_inputs, check_consistency)
    if chunked_experts:
        _refuse_router_logits_argument(model, chunked_experts)
    if audit:
        auditor.arm()
    _report(model, p, plan, built, modules, styles, matched, used, unmatched_keys, skipped)
    getattr(model, REPORT_ATTR).audit = auditor.report
    return model


def _save_pretrained_whole(model: nn.Module, save_directory: Any, *args: Any, **kwargs: Any) -> Any:
    """A Hugging Face / PEFT model's ``save_pretrained`` after ``parallelize``: given the dense ``state_dict`` it is
    the library's own; without it the library would read ``state_dict()``, whose TP shards are DTensors (no
    safetensors file holds one), and fail deep inside safetensors: refused here, naming the route."""
    if kwargs.get("state_dict") is None:
        raise RuntimeError(
            f"{type(model).__name__}.save_pretrained on a tensor-parallel model: its state_dict() holds TP shards (as "
            "DTensors), which a Hugging Face / PEFT save cannot write. On every rank of the TP group: "
            "model.save_pretrained(path, state_dict=tplayers.io.dense_state_dict(model), is_main_process=rank == 0) "
            "(dense_state_dict gathers the shards: collective), or tplayers.save_dense(model, path)")
    return type(model).save_pretrained(model, save_directory, *args, **kwargs)


def _report(model: nn.Module, p: Plan, plan: object, built: Dict[str, Built], modules: Dict[str, nn.Module],
            styles: Dict[str, Style], matched: List[Tuple[str, str]], used: set, unmatched_keys: List[str],
            skipped: Dict[str, str]) -> None:
    """Store the coverage report on the model; warn when a shipped or "auto" plan covers only part
    of it, or when patterns of the user's own plan matched nothing."""
    # Patterns of shipped plans list alternatives (with / without a head, a prefix): not reported.
    unmatched = unmatched_keys if p.name == "auto" else [] if isinstance(plan, str) else [
        pat for pat in styles if pat not in used]
    report = build_report(model, p.name, _describe(built, modules, styles, matched), (n for n, _ in matched),
                          unmatched, skipped)
    object.__setattr__(model, REPORT_ATTR, report)  # a plain attribute: not a submodule, not in the state dict
    if isinstance(plan, str) and not report.complete:
        warnings.warn(f"parallelize: plan '{p.name}' covers only part of {type(model).__name__}; what stays dense "
                      f"runs whole on every rank (correct, but no memory saved):\n{report}", stacklevel=3)
    elif unmatched and not isinstance(plan, str):
        warnings.warn(f"parallelize: plan pattern(s) {unmatched} matched no module of {type(model).__name__} "
                      "(or only modules an earlier pattern took); those modules stay as they are", stacklevel=3)
