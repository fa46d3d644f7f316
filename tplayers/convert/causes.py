"""The likely causes of an audit mismatch, read off a region's structure (most specific first).

The audit (:mod:`tplayers.convert.audit`) knows that a region differs from its dense twin; these rules
say why it probably does, in the plan's terms: a fused projection split as one block, a head count the
forward reads but the plan does not divide (or that cannot be divided), a replicated parameter whose
gradient is a partial sum (proven by the audit, with the plan line that fixes it), per-head modules,
``(heads, d)`` weights, a width read from the input.
"""
from __future__ import annotations

import re
from typing import Any, Dict, List

import torch
import torch.nn as nn

from ..core.placement import Sharded
from ..layers.base import TensorParallelModule, model_placements
from ..layers.fused import FusedColumnParallelLinear
from ..layers.linear import ColumnParallelLinear, RowParallelLinear
from ..layers.lora import LoRAPiece, is_peft_lora
from .sequence import OTHER_SHARDS
from .styles import SPLIT_BY_KV_HEADS
from .twin import within

__all__ = ["likely_causes"]

# attribute names a forward may read as a head count or a width
_HEAD_ATTR = re.compile(r"(^|_)(n_?heads?|num_(attention_|key_value_|kv_)?heads|n_kv_heads?|n_local_heads|"
                        r"num_heads_per_partition|heads)$")
_WIDTH_ATTR = re.compile(r"^(n_embd|embed_dim|hidden_size|d_model|dim|n_state|all_head_size|inner_dim)$")
_MLP_NAMES = re.compile(r"(fc|mlp|ffn|up|gate|w1|w3|dense_h_to_4h|intermediate)", re.I)
_FUSED_NAMES = re.compile(r"(qkv|c_attn|query_key_value|wqkv|in_proj|gate_up|w13|w1_w3|fc_in_gate)", re.I)


def _join(name: str, rel: str) -> str:
    """A module's path in the model from its region's name and its path in the region ("" is the root)."""
    return f"{name}.{rel}" if name and rel else name or rel


def name_pattern(name: str) -> str:
    return re.sub(r"\.\d+(?=\.|$)", ".*", name)


def _partial_hints(name: str, p: int, partial: List[str], plan_name: str) -> List[str]:
    """One fix per module owning parameters whose gradients were proven partial sums."""
    owners: Dict[str, List[str]] = {}
    for n in partial:
        owners.setdefault(n.rpartition(".")[0], []).append(n)
    how = ("plan = tplayers.auto_plan(model).plan; plan.layers[...] = ...; tplayers.parallelize(model, plan, ...)"
           if plan_name == "auto" else "add it to your plan")
    causes = []
    for owner, names in owners.items():
        qual = name_pattern(f"{name}.{owner}" if owner else name)
        causes.append(f"{', '.join(repr(n) for n in names)} {'is' if len(names) == 1 else 'are'} whole on every rank but "
                      f"{'acts' if len(names) == 1 else 'act'} on split activations: each rank's gradient is a partial "
                      f"sum, and its sum over the {p} ranks equals the dense gradient (checked). Fix: the plan line "
                      f"\"{qual}\": \"replicate_reduce_grad\" ({how})")
    return causes


def _adapters_added_after(name: str, module: nn.Module) -> List[str]:
    """PEFT adapters put on TP layers after ``parallelize`` (``load_adapter``, ``add_adapter``): their ``lora_A`` /
    ``lora_B`` are the dense adapter's, applied to a shard."""
    causes = []
    for rel, m in module.named_modules():
        if not (is_peft_lora(m) and isinstance(getattr(m, "base_layer", None), TensorParallelModule)):
            continue
        late = sorted(a for a, piece in list(m.lora_A.items()) + list(m.lora_B.items())
                      if not isinstance(piece, LoRAPiece))
        if late:
            causes.append(f"PEFT adapter(s) {sorted(set(late))} on '{name_pattern(f'{name}.{rel}' if rel else name)}' were "
                          "added after parallelize (load_adapter / add_adapter): their lora_A / lora_B are the dense "
                          "adapter's, applied to this rank's shard. Add (or load) adapters before parallelize")
    return causes


def _config_head_counts(module: nn.Module) -> set:
    """Head counts a Hugging Face module reads from its ``config`` (not divided by ``parallelize``)."""
    out = set()
    for m in module.modules():
        config = vars(m).get("config")
        for attr in ("num_attention_heads", "num_key_value_heads", "n_head", "num_heads"):
            value = getattr(config, attr, None) if config is not None else None
            if isinstance(value, int) and not isinstance(value, bool):
                out.add(value)
    return out


def _likely(causes: List[str]) -> str:
    seen = list(dict.fromkeys(causes))  # each once, in order
    return "likely cause" + ("s" if len(seen) > 1 else "") + ":\n  - " + "\n  - ".join(seen)


_MATMUL_SHAPES = re.compile(r"mat1 and mat2 shapes cannot be multiplied \((\d+)x(\d+) and (\d+)x(\d+)\)")


def _whole_linear_fed_a_shard(name: str, module: nn.Module, p: int, raised: str) -> List[str]:
    """A whole ``nn.Linear`` of the region that got ``in_features / p`` features (the matmul error says so): a
    column layer's split output reaches it, where a row layer belongs."""
    shapes = _MATMUL_SHAPES.search(raised)
    if shapes is None:
        return []
    got, want = int(shapes.group(2)), int(shapes.group(3))
    return [f"'{rel}' (a whole nn.Linear reading {want} features) got {got} = {want} / {p}: a column layer's split "
            f"output reaches it; it is the row layer after that column layer: the plan line "
            f"\"{name_pattern(f'{name}.{rel}')}\": \"row\" (or gather the column's output: 'column_gather')"
            for rel, m in module.named_modules()
            if type(m) is nn.Linear and m.in_features == want and got * p == want]


_NORM_SHAPES = re.compile(r"normalized_shape=\[(\d+)\], expected input with shape \[\*,? ?\d+\], but got input of "
                          r"size\s?\[[\d, ]*?(\d+)\]")


def _whole_norm_fed_a_shard(name: str, module: nn.Module, p: int, raised: str) -> List[str]:
    """A norm over a projection's whole width (OLMo's q/k LayerNorm) that got the width / p of a split one."""
    shapes = _NORM_SHAPES.search(raised)
    if shapes is None:
        return []
    want, got = int(shapes.group(1)), int(shapes.group(2))
    return [f"'{rel}' ({type(m).__name__} over {want} features) got {got} = {want} / {p}: it normalizes a projection "
            "whose output is split, across heads other ranks hold (its statistics need every rank's part); a plan "
            f"cannot split it: leave this region whole (\"{name_pattern(name)}\" out of the plan or 'replicate')"
            for rel, m in module.named_modules()
            if tuple(getattr(m, "normalized_shape", ()) or ())[-1:] == (want,) and got * p == want]


_SIZES = re.compile(r"size of tensor a \((\d+)\) must match the size of tensor b \((\d+)\)")


def _whole_width_params(name: str, module: nn.Module, p: int, raised: str) -> List[str]:
    """A module outside the TP layers whose 1-D weight is a split column's whole output width (a q / k norm over all
    heads' features, OLMo-2's, written by hand) while the column hands it 1/p of them: the sharded run raised on
    exactly those two widths."""
    pair = _SIZES.search(raised)
    sizes = {int(pair.group(1)), int(pair.group(2))} if pair else set()
    widths = {m.out_features for m in module.modules()
              if type(m) is ColumnParallelLinear and not m.gather_output and m.out_features_per_rank < m.out_features
              and {m.out_features, m.out_features // p} == sizes}
    return [f"'{rel}' ({type(m).__name__}) holds a weight of the whole width {w.numel()} of a projection split "
            f"{p} ways: it acts on all heads' features together (a norm over the whole projection), while each rank "
            f"holds 1/{p} of them, so it cannot be replicated beside the split ('replicate_reduce_grad' is for per-head "
            f"modules): gather that projection's output first ('column_gather') or leave the region whole "
            f"(\"{name_pattern(name)}\" out of the plan)"
            for rel, m in module.named_modules()
            if rel and not isinstance(m, TensorParallelModule) and isinstance(w := m._parameters.get("weight"), torch.Tensor)
            and w.dim() == 1 and w.numel() in widths]


_SPLIT_SIZES = re.compile(r"split_sizes to sum exactly to (\d+) \(input tensor's size at dimension -?\d+\), but got "
                          r"split_sizes=\[([\d, ]+)\]")


def _split_by_whole_sizes(module: nn.Module, raised: str) -> List[str]:
    """A column layer whose whole output the forward splits by sizes (a latent down projection, MLA's ``wkv_a``:
    [latent; rotary key]): it got the 1/p of its output a column gives."""
    found = _SPLIT_SIZES.search(raised)
    if found is None:
        return []
    got, sizes = int(found.group(1)), [int(n) for n in found.group(2).split(",")]
    return [f"'{rel.rpartition('.')[2]}' is split as a column ({m.out_features_per_rank} of its {m.out_features} output "
            f"features per rank) but the forward splits its whole output by sizes {sizes}: its output is read whole "
            "(a down projection to a latent, MLA's wkv_a / kv_a_proj_with_mqa). Leave it whole ('replicate', or "
            "LatentKV() for multi-head latent attention's, whose shared rotary key's gradient it sums)"
            for rel, m in module.named_modules()
            if type(m) is ColumnParallelLinear and m.out_features == sum(sizes) and m.out_features_per_rank == got]


def _gathers_first_input_only(name: str, module: nn.Module) -> List[str]:
    """A ``'gather_sequence'`` module called with other inputs shaped like its first (``attn(h, h)``): only the first
    is gathered, the others stay this rank's chunk of the sequence."""
    return [f"'{_join(name, rel) or name}' has 'gather_sequence', which gathers its first input only; this call also "
            f"passed {', '.join(others)} of the same shape (this rank's chunk of the sequence, not gathered: a call "
            "such as attn(h, h) gives the keys and values of one chunk). Call it with one input, or gather the others "
            "in your code (tplayers.core.comm.gather_from_sequence), or keep the module out of the sequence-parallel region"
            for rel, m in module.named_modules() if (others := vars(m).get(OTHER_SHARDS))]


def likely_causes(name: str, module: nn.Module, originals: Dict[str, Dict[str, Any]], p: int, forward_wrong: bool,
                  partial: List[str], plan_name: str = "", raised: str = "") -> str:
    """The likely causes, read off the region's structure, most specific first. ``forward_wrong``: the
    output differs or the forward raised (a layout or a head count; ``raised``: the sharded run's error);
    else only gradients do (a replicated parameter's partial gradient)."""
    causes = (_partial_hints(name, p, partial, plan_name) + _whole_linear_fed_a_shard(name, module, p, raised)
              + _whole_norm_fed_a_shard(name, module, p, raised))
    causes += [] if causes else _whole_width_params(name, module, p, raised) + _split_by_whole_sizes(module, raised)
    causes += _gathers_first_input_only(name, module)
    if not forward_wrong:
        return _likely(causes or [
            "the forward matches but gradients do not, and no replicated parameter's gradient is a plain partial "
            "sum: a parameter or buffer the forward uses on this rank's shard only (check_replicas may tell)"])
    heads: Dict[str, int] = {}
    for rel, attrs in originals.items():
        for attr, value in attrs.items():
            if isinstance(value, int) and not isinstance(value, bool) and _HEAD_ATTR.search(attr):
                heads[f"{rel}.{attr}" if rel else attr] = value
    mods = dict(module.named_modules())
    causes += (_adapters_added_after(name, module) + _split_output_no_row_reads(name, mods)
               + _kv_split_as_columns(name, mods, p) + _equal_thirds_under_gqa(mods, originals)
               + _head_count_causes(name, heads, mods, p)
               + _tensors_keeping_heads(name, heads, mods) + _whole_params_by_head(module, heads)
               + _fused_split_as_one(mods) + _dense_widths(originals, mods, p))
    return _likely(causes or ["no structural cause recognised: compare the region's forward with the plan (which "
                              "tensors it reshapes with dense sizes, which parameters act on split activations)"])


def _split_output_no_row_reads(name: str, mods: Dict[str, nn.Module]) -> List[str]:
    """A column layer that keeps its output split (a plain ``'column'``) with no row layer beside it to read the
    split: its caller reads this rank's 1/p of the features as if whole (an LM head given ``'column'``)."""
    causes = []
    for rel, m in mods.items():
        if type(m) is not ColumnParallelLinear or getattr(m, "gather_output", True) or not rel:
            continue
        parent = rel.rpartition(".")[0]
        siblings = [c for r, c in mods.items() if r.rpartition(".")[0] == parent and r != rel]
        # (beside it: a sibling, or inside one, below the model's top level, where every block is a sibling)
        if not any(isinstance(d, RowParallelLinear) for c in siblings for d in (c.modules() if parent else (c,))):
            causes.append(f"'{rel}' is split as a plain column (it returns this rank's {m.out_features_per_rank} of "
                          f"{m.out_features} output features) and no row layer beside it reads that split: the code "
                          f"after it reads a shard as if it were whole. If it is the LM head: \"{name_pattern(_join(name, rel))}"
                          "\": \"vocab_head\" (logits gathered; gather_output=False with vocab_parallel_cross_entropy); "
                          "else 'column_gather', or a 'row' layer that takes its output")
    return causes


_HEADS_NAMES = ("n_head", "n_heads", "num_heads", "num_attention_heads", "n_local_heads")
_KV_HEADS_NAMES = ("n_kv_head", "n_kv_heads", "num_key_value_heads", "num_kv_heads", "n_query_groups",
                   "n_local_kv_heads")


def _equal_thirds_under_gqa(mods: Dict[str, nn.Module], originals: Dict[str, Dict[str, Any]]) -> List[str]:
    """A fused projection cut into equal parts (``'fused_qkv'``: thirds) in an attention with fewer KV heads than
    heads (its dense counts, by the usual attribute names): its [q; k; v] parts are not equally wide."""
    fused = [rel for rel, m in mods.items() if isinstance(m, FusedColumnParallelLinear) and len(m.parts) == 3
             and len(set(m.parts)) == 1 and _FUSED_NAMES.search(rel)]
    if not fused:
        return []
    for rel, m in mods.items():
        dense = {**vars(m), **originals.get(rel, {})}
        heads = next(((a, dense[a]) for a in _HEADS_NAMES if isinstance(dense.get(a), int)), None)
        kv = next(((a, dense[a]) for a in _KV_HEADS_NAMES if isinstance(dense.get(a), int)), None)
        if heads and kv and kv[1] < heads[1]:
            return [f"'{fused[0].rpartition('.')[2]}' is cut into equal thirds ('fused_qkv'), but its attention has "
                    f"fewer KV heads ({kv[0]} = {kv[1]}) than heads ({heads[0]} = {heads[1]}): its [q; k; v] parts are "
                    f"not equally wide. Split it by heads: FusedQKV(heads='{heads[0]}', kv_heads='{kv[0]}')"]
    return []


_Q_NAMES = re.compile(r"(^|\.)(q|wq|q_proj|query)$")
_KV_NAMES = re.compile(r"(^|\.)(k|v|wk|wv|k_proj|v_proj|key|value)$")


def _kv_split_as_columns(name: str, mods: Dict[str, nn.Module], p: int) -> List[str]:
    """K / V projections split as plain columns, narrower than the query's (grouped-query attention): a plain
    column cuts them into p pieces as it cuts q, whole heads or not, and never replicates a KV head."""
    columns = {rel: m for rel, m in mods.items() if type(m) is ColumnParallelLinear}
    q_width = max((m.out_features for rel, m in columns.items() if _Q_NAMES.search(rel)), default=0)
    narrow = sorted(rel for rel, m in columns.items() if _KV_NAMES.search(rel) and m.out_features < q_width
                    and not getattr(m, SPLIT_BY_KV_HEADS, False))
    if not narrow:
        return []
    leaves = list(dict.fromkeys(r.rpartition(".")[2] for r in narrow))
    where = name_pattern(_join(name, narrow[0]))
    return [f"{', '.join(repr(r) for r in leaves)} {'is' if len(leaves) == 1 else 'are'} split as "
            f"plain column{'s' * (len(leaves) > 1)} but narrower than the query projection (grouped-query attention: "
            f"fewer K/V heads than query heads): a plain column cuts them into {p} equal pieces whether or not those are "
            "whole heads, and cannot hold a KV head on several ranks. Split them by KV heads with "
            f"KVColumn(kv_heads=<the attention's KV-head count or the attribute holding it>) (\"{where}\"; with fewer "
            "KV heads than ranks each KV head is replicated on p / kv ranks, its gradient summed)"]


def _head_count_causes(name: str, heads: Dict[str, int], mods: Dict[str, nn.Module], p: int) -> List[str]:
    """Head counts left dense, not divisible, or per-head modules kept whole."""
    causes: List[str] = []
    # counts that cannot split first: they are the likelier cause when several head counts are undivided
    for path, dense_value in sorted(heads.items(), key=lambda kv: kv[1] % p == 0):
        rel, _, attr = path.rpartition(".")
        now = getattr(mods.get(rel), attr, None)
        where = name_pattern(_join(name, rel))
        if now == dense_value and dense_value % p:
            causes.append(f"head count '{path}' = {dense_value} does not divide by the TP degree {p}: if these are the "
                          f"K/V heads, split the K and V projections with KVColumn(kv_heads='{attr}') (each KV head "
                          f"held by whole ranks: {'p / kv_heads' if dense_value < p else 'kv_heads / p'} of them), or "
                          f"the fused projection with FusedQKV(heads=..., kv_heads='{attr}'); a plain 'column' cuts "
                          "through heads")
        elif now == dense_value:
            causes.append(f"head count '{path}' = {dense_value} is the dense count on every rank, but each rank holds "
                          f"1/{p} of the heads: divide it (Plan(divide_attrs={{'{where}': ('{attr}',)}}))")
        elif isinstance(now, int) and dense_value % p:
            causes.append(f"head count '{path}' was {dense_value} and is now {now} on this rank, but {dense_value} does "
                          f"not divide by the TP degree {p}: the heads cannot be split evenly")
        for child_rel, child in mods.items():
            if isinstance(child, nn.ModuleList) and len(child) == dense_value and dense_value > 1 and within(child_rel, rel):
                causes.append(f"'{child_rel}' holds {len(child)} modules, one per head ('{path}'), whole on every rank, "
                              f"while rank r computes heads r*{dense_value // p or 1}..: a forward indexing them from 0 "
                              "pairs them with the wrong heads; per-head modules cannot be split by a plan yet, "
                              "leave this attention out of the plan ('replicate')")
    return causes


def _tensors_keeping_heads(name: str, heads: Dict[str, int], mods: Dict[str, nn.Module]) -> List[str]:
    """A tensor shaped by the heads (a KV cache) whole while its head count was divided."""
    causes: List[str] = []
    divided = {v for path, v in heads.items()
               if getattr(mods.get(path.rpartition(".")[0]), path.rpartition(".")[2], v) not in (v, None)}
    for rel, m in mods.items():
        for attr, t in [*vars(m).items(), *m._buffers.items()]:
            if isinstance(t, torch.Tensor) and not isinstance(t, nn.Parameter) and t.dim() > 1:
                dims = [str(d) for d, n in enumerate(t.shape) if n in divided and n > 1]
                inner = [d for d in dims if d not in ("0", str(t.dim() - 1))]  # a cache's heads: neither its batch
                dims = inner or dims  # dim (first) nor its head_dim (last), when a size matches there by chance
                if dims:
                    where = _join(name, rel)
                    causes.append(f"tensor '{(rel + '.') if rel else ''}{attr}' {tuple(t.shape)} keeps the dense head "
                                  f"count in dim {' or '.join(dims)} while the heads were divided: if it holds per-head "
                                  f"state (a KV cache), cut it with them (Plan(divide_attrs={{'{name_pattern(where)}': "
                                  f"(..., '{attr}:{dims[0]}')}}))")
    return causes


def _whole_params_by_head(module: nn.Module, heads: Dict[str, int]) -> List[str]:
    """A whole parameter whose first dim is a head count (it acts on heads other ranks hold)."""
    placements = model_placements(module)
    counts = set(heads.values()) | _config_head_counts(module)
    return [f"parameter '{n}' {tuple(prm.shape)} is whole on every rank, and its first dim is a head count: it acts "
            "on heads this rank does not hold; it needs splitting by heads, which a plan cannot express yet: leave "
            "this attention out of the plan ('replicate')"
            for n, prm in module.named_parameters()
            if not isinstance(placements.get(n), Sharded) and prm.dim() > 0
            and any(prm.shape[0] == v and v > 1 for v in counts)]


def _fused_split_as_one(mods: Dict[str, nn.Module]) -> List[str]:
    """A fused projection (by its name, or wider than the row layers read) split as one block."""
    causes: List[str] = []
    rows = {rel: m.in_features for rel, m in mods.items() if isinstance(m, RowParallelLinear)}
    widest = max(rows, key=rows.get) if rows else ""
    for rel, m in mods.items():
        if isinstance(m, ColumnParallelLinear) and not m.gather_output:  # (a FusedColumnParallelLinear is not one)
            out_f, in_f = m.out_features, m.in_features
            leaf = rel.rpartition(".")[2]
            # wider than every row layer of the region reads: the forward splits its output into parts
            wider = f", wider than '{widest}' reads ({rows[widest]})" if rows and out_f > rows[widest] else ""
            if wider or _FUSED_NAMES.search(leaf) or (out_f == 3 * in_f and not _MLP_NAMES.search(leaf)):
                causes.append(f"'{rel}' ({in_f} -> {out_f}{wider}) looks fused ([q; k; v] or [gate; up]) but is split "
                              "as one block ('column'): rank 0 gets all of the first part and part of the next. Use "
                              "\"fused_qkv\", Column(parts=[...]) or tplayers.convert.FusedQKV(heads=..., kv_heads=...)")
    return causes


def _dense_widths(originals: Dict[str, Dict[str, Any]], mods: Dict[str, nn.Module], p: int) -> List[str]:
    """A width attribute still the dense width on every rank."""
    return [f"width '{(rel + '.') if rel else ''}{attr}' = {value} is the dense width on every rank; if the forward "
            "splits or reshapes the sharded projections with it (or with a width read from its input, B, T, C = "
            f"x.size()), each rank needs its local width {value // p if value % p == 0 else value / p}: divide it "
            "(divide_attrs) or compute it from the projection's output"
            for rel, attrs in originals.items() for attr, value in attrs.items()
            if isinstance(value, int) and _WIDTH_ATTR.match(attr) and getattr(mods.get(rel), attr, None) == value]
