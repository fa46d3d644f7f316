"""The Megatron-layout communication budget of a decoder-only LM, and a measurement held against it.

`megatron_budget(...)` counts what Megatron-LM's tensor-parallel layout (Shoeybi et al., 2019;
sequence parallelism: Korthikanti et al., 2022) must communicate for one forward + backward of a
decoder-only LM over ``p`` ranks: per phase and collective, how many and how many bytes each. ``b``,
``s``, ``h``, ``V``: batch, sequence, hidden size, vocabulary (padded to a multiple of ``p``, as the
vocabulary-parallel layers pad it); ``L`` decoder layers; one ``(b, s, h)`` activation = ``b*s*h``
elements of the model's dtype.

Without sequence parallelism:

- forward: per layer 2 all-reduces of ``(b, s, h)`` (after attention's output projection, after the
  MLP's down projection); the vocabulary-parallel embedding 1 (each rank holds the rows of its part
  of the vocabulary);
- backward: per layer 2 all-reduces of ``(b, s, h)`` (attention's input gradient summed over q, k, v
  on each rank and all-reduced once; the MLP's gate/up likewise); the LM head's input gradient 1; the
  embedding none.

With sequence parallelism every all-reduce of ``(b, s, h)`` becomes a reduce-scatter + an all-gather
of ``(b, s, h)``:

- forward: per layer 2 all-gathers (the sequence, before attention's q/k/v and before the MLP's
  up projections) and 2 reduce-scatters (after o_proj, after down_proj); the embedding 1
  reduce-scatter; the LM head 1 all-gather of its input;
- backward: per layer 2 all-gathers (the row layers' output gradients), 2 all-gathers of the column
  layers' inputs again for their weight gradients (Megatron-LM keeps only this rank's ``s/p`` tokens
  of them and gathers them again in backward: counted as it does), 2 reduce-scatters (the column
  layers' input gradients); the embedding 1 all-gather (its output gradient); the LM head 1 all-gather
  (its input again) + 1 reduce-scatter (its input gradient); and 1 all-reduce of every norm
  parameter's gradient (norms see ``s/p`` tokens: partial sums; Megatron-LM coalesces them into one).

KV heads replicated (grouped-query attention with fewer KV heads than ranks, ``kv_replicas=(r, n)``:
each KV head held by ``r`` ranks; Megatron-LM refuses this layout, tplayers' minimum is counted): per layer
1 all-reduce over the ``r`` ranks sharing a head, of the ``n`` elements of the k and v weights (and biases)
each rank holds, k and v together: their weight gradients are whole on each rank but must agree.

The logits and the loss:

- ``loss_parallel=False``: the logits gathered, 1 all-gather of ``(b, s, V)`` forward, nothing backward
  (each rank keeps its vocabulary slice of the gradient);
- ``loss_parallel=True`` (vocabulary-parallel cross-entropy): 2 all-reduces of ``b*s`` row statistics
  forward (the row maxima; then each row's target logit and sum of exponentials together, ``2*b*s``),
  in float32 or the logits' dtype if wider; nothing backward. Megatron-LM issues the second as two
  all-reduces of ``b*s`` (3 in all, the same bytes).

Bytes are the full buffer of each collective, as `CommRecord.nbytes` counts them (all-reduce buffer,
all-gather output, reduce-scatter input); "on the wire" is what each rank sends in a ring: an
all-reduce ``2(p-1)/p`` of its buffer, an all-gather or reduce-scatter ``(p-1)/p``, a broadcast or a
point-to-point send all of it. Not counted: data-parallel gradient reduction, pipeline sends, MoE
routing, and what tplayers does once per model (the audit at the first forward).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Optional, Tuple, Union

import torch


__all__ = ["BudgetItem", "CommBudget", "BudgetComparison", "ComparisonRow", "megatron_budget", "wire_bytes"]

OPS = ("all_reduce", "all_gather", "reduce_scatter")
PHASES = ("forward", "backward")


def wire_bytes(op: str, nbytes: float, group_size: int) -> float:
    """Bytes each rank sends for ``op`` on a full buffer of ``nbytes`` over ``group_size`` ranks (ring)."""
    p = group_size
    if p <= 1:
        return 0.0
    if op == "all_reduce":
        return 2 * (p - 1) / p * nbytes
    if op in ("all_gather", "reduce_scatter"):
        return (p - 1) / p * nbytes
    if op in ("broadcast", "send", "recv", "all_to_all"):  # (all_to_all: nbytes is what leaves this rank)
        return float(nbytes)
    raise ValueError(f"wire_bytes: no ring model for collective {op!r} (known: all_reduce, all_gather, "
                     "reduce_scatter, broadcast, send, recv, all_to_all)")


@dataclass(frozen=True)
class BudgetItem:
    """``count`` collectives ``op`` in ``phase``, each on a full buffer of ``nbytes``; ``what`` says where."""

    op: str
    phase: str
    count: int
    nbytes: int
    what: str
    group_size: Optional[int] = None  # ranks taking part; None: the whole TP group


@dataclass
class CommBudget:
    """What a layout must communicate for one forward + backward (see the module docstring)."""

    items: List[BudgetItem]
    tp_size: int
    description: str  # the model and the layout in words, for reports

    def counts(self) -> Dict[Tuple[str, str], int]:
        """{(op, phase): number of collectives}, as `CommAccounting.counts`."""
        out: Counter = Counter()
        for item in self.items:
            out[(item.op, item.phase)] += item.count
        return dict(out)

    def total_bytes(self, op: Optional[str] = None, phase: Optional[str] = None) -> int:
        """Full-buffer bytes, as `CommAccounting.total_bytes`."""
        return sum(i.count * i.nbytes for i in self._of(op, phase))

    def wire_bytes(self, op: Optional[str] = None, phase: Optional[str] = None) -> float:
        """Bytes each rank sends (ring model)."""
        return sum(i.count * wire_bytes(i.op, i.nbytes, i.group_size or self.tp_size) for i in self._of(op, phase))

    def group_sizes(self) -> List[int]:
        """The sizes of the groups the budget's collectives run on."""
        return sorted({i.group_size or self.tp_size for i in self.items})

    def _of(self, op: Optional[str], phase: Optional[str]) -> List[BudgetItem]:
        return [i for i in self.items if (op is None or i.op == op) and (phase is None or i.phase == phase)]

    def __str__(self) -> str:
        lines = [f"Megatron-layout budget: {self.description}"]
        for i in self.items:
            lines.append(f"  {i.phase:<8} {i.count:>3} x {i.op:<14} of {_size(i.nbytes):>9}  {i.what}")
        return "\n".join(lines)


def _elements(dtype: Union[torch.dtype, int]) -> int:
    if isinstance(dtype, torch.dtype):
        return dtype.itemsize
    if isinstance(dtype, int) and not isinstance(dtype, bool) and dtype > 0:
        return dtype
    raise ValueError(f"megatron_budget: dtype must be a torch.dtype or an element size in bytes > 0, got {dtype!r}")


def _dtype_name(dtype: Union[torch.dtype, int]) -> str:
    return str(dtype).replace("torch.", "") if isinstance(dtype, torch.dtype) else f"{dtype}-byte elements"


def megatron_budget(*, layers: int, batch: int, seq: int, hidden: int, vocab: int, tp_size: int,
                    dtype: Union[torch.dtype, int] = torch.float32, sequence_parallel: bool = False,
                    loss_parallel: bool = False, norm_params: Optional[int] = None,
                    kv_replicas: Optional[Tuple[int, int]] = None,
                    residual_dtype: Union[None, torch.dtype, int] = None) -> CommBudget:
    """The Megatron-layout communication budget of one forward + backward of a decoder-only LM with
    ``layers`` decoder layers on input ``(batch, seq)`` over ``tp_size`` ranks (what is counted: the
    module docstring of `tplayers.bench.budget`).

    ``dtype``: of the activations (a torch.dtype or an element size in bytes). ``sequence_parallel``:
    activations between the TP regions split along the sequence. ``loss_parallel``: vocabulary-parallel
    cross-entropy on split logits (else the logits are gathered). ``norm_params``: under sequence
    parallelism, the elements of every norm's parameters (their gradients are summed over the ranks);
    default ``(2 * layers + 1) * hidden`` (two RMSNorms per layer and the final one, weights only).
    ``kv_replicas``: ``(ranks sharing a KV head, elements of the k and v parameters each rank holds per
    layer)`` when KV heads are replicated (fewer KV heads than ranks, dividing them); their gradients in the
    parameters' element size. ``residual_dtype``: of the residual stream and the parameters where it is not
    ``dtype`` (mixed precision, ``torch.autocast``: the TP regions compute in ``dtype``; the embedding's
    output and its gradient, the norms' and replicated KV heads' parameter gradients stay in
    ``residual_dtype``, as the dense model has them); default ``dtype``."""
    sizes = dict(layers=layers, batch=batch, seq=seq, hidden=hidden, vocab=vocab, tp_size=tp_size)
    for name, v in sizes.items():
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"megatron_budget: {name} must be an integer >= 1, got {v!r}")
    if norm_params is not None and (not isinstance(norm_params, int) or norm_params < 0):
        raise ValueError(f"megatron_budget: norm_params must be an integer >= 0, got {norm_params!r}")
    if kv_replicas is not None:
        ranks, elements = kv_replicas
        if not (isinstance(ranks, int) and isinstance(elements, int) and 1 < ranks <= tp_size
                and tp_size % ranks == 0 and elements > 0):
            raise ValueError(f"megatron_budget: kv_replicas must be (ranks sharing a KV head: > 1, dividing the TP "
                             f"degree {tp_size}; elements of k and v per rank: > 0), got {kv_replicas!r}")
    if sequence_parallel and seq % tp_size:
        raise ValueError(f"megatron_budget: seq={seq} is not divisible by the TP degree {tp_size} (sequence parallel)")
    e = _elements(dtype)
    r = e if residual_dtype is None else _elements(residual_dtype)
    p, L = tp_size, layers
    act = batch * seq * hidden * e
    residual = batch * seq * hidden * r  # the embedding's output: the residual stream's dtype
    vocab_padded = -(-vocab // p) * p  # the vocabulary-parallel layers pad V to a multiple of p
    loss_e = max(e, 4)  # the loss's row statistics: float32, or the logits' dtype if wider (float64)
    words = (f"{L} decoder layers, [b, s, h]=[{batch}, {seq}, {hidden}], vocab {vocab}"
             + (f" (padded to {vocab_padded})" if vocab_padded != vocab else "")
             + f", {_dtype_name(dtype)}"
             + ("" if r == e else f" (residual stream and parameters {_dtype_name(residual_dtype)})")
             + f", TP {p}, " + ("sequence-parallel" if sequence_parallel else "no sequence parallelism")
             + ", " + ("vocab-parallel loss" if loss_parallel else "logits gathered"))
    if p == 1:  # one rank: the layout communicates nothing
        return CommBudget([], p, words)
    if sequence_parallel:
        fwd, bwd = _sequence_parallel_items(L, act, residual, (2 * L + 1) * hidden if norm_params is None
                                            else norm_params, r)
    else:
        fwd, bwd = _plain_items(L, act, residual)
    if kv_replicas is not None:
        ranks, elements = kv_replicas
        bwd.append(BudgetItem("all_reduce", "backward", L, elements * r,
                              f"per layer 1: k and v weight gradients over the {ranks} ranks sharing a KV head",
                              group_size=ranks))
        words += f", each KV head on {ranks} ranks"
    if loss_parallel:
        fwd += [BudgetItem("all_reduce", "forward", 1, batch * seq * loss_e, "loss: each row's maximum logit"),
                BudgetItem("all_reduce", "forward", 1, 2 * batch * seq * loss_e,
                           "loss: each row's target logit and sum of exponentials")]
    else:
        fwd.append(BudgetItem("all_gather", "forward", 1, batch * seq * vocab_padded * e, "logits: (b, s, V) gathered"))
    return CommBudget(fwd + bwd, p, words)


_A = "(b, s, h) activation"


def _plain_items(L: int, act: int, residual: int) -> Tuple[List[BudgetItem], List[BudgetItem]]:
    """The decoder layers', the embedding's and the head's collectives without sequence parallelism."""
    return ([BudgetItem("all_reduce", "forward", 1, residual, f"embedding: the {_A}, partial over vocabulary shards"),
             BudgetItem("all_reduce", "forward", 2 * L, act, "per layer 2: after o_proj, after down_proj")],
            [BudgetItem("all_reduce", "backward", 2 * L, act,
                        "per layer 2: input gradient of q/k/v together, of gate/up together"),
             BudgetItem("all_reduce", "backward", 1, act, "LM head: its input gradient")])


def _sequence_parallel_items(L: int, act: int, residual: int, params: int, r: int
                             ) -> Tuple[List[BudgetItem], List[BudgetItem]]:
    """The same under sequence parallelism (``params``: norm parameters, their gradients ``r`` bytes each)."""
    fwd = [BudgetItem("reduce_scatter", "forward", 1, residual, f"embedding: the {_A}, into sequence shards"),
           BudgetItem("all_gather", "forward", 2 * L, act, "per layer 2: the sequence before q/k/v, before gate/up"),
           BudgetItem("reduce_scatter", "forward", 2 * L, act, "per layer 2: after o_proj, after down_proj"),
           BudgetItem("all_gather", "forward", 1, act, "LM head: its input, the whole sequence")]
    bwd = [BudgetItem("all_gather", "backward", 2 * L, act, "per layer 2: output gradients of o_proj, down_proj"),
           BudgetItem("all_gather", "backward", 2 * L, act,
                      "per layer 2: inputs of q/k/v and gate/up again, for their weight gradients"),
           BudgetItem("reduce_scatter", "backward", 2 * L, act,
                      "per layer 2: input gradient of q/k/v together, of gate/up together"),
           BudgetItem("all_gather", "backward", 1, act, "LM head: its input again, for its weight gradient"),
           BudgetItem("reduce_scatter", "backward", 1, act, "LM head: its input gradient"),
           BudgetItem("all_gather", "backward", 1, residual, "embedding: its output gradient")]
    if params:
        bwd.append(BudgetItem("all_reduce", "backward", 1, params * r,
                              f"norms: the gradients of their {params} parameters, one coalesced buffer"))
    return fwd, bwd


# ---------------------------------------------------------------------------- measured vs budget


@dataclass(frozen=True)
class ComparisonRow:
    """One (op, phase): measured against budgeted counts, buffer bytes and bytes on the wire."""

    op: str
    phase: str
    count: int
    budget_count: int
    nbytes: int
    budget_nbytes: int
    wire: float
    budget_wire: float

    @property
    def ratio(self) -> Optional[float]:
        """Measured / budgeted bytes on the wire; None where the budget has none of this collective."""
        return self.wire / self.budget_wire if self.budget_wire else None


@dataclass
class BudgetComparison:
    """A `CommAccounting`'s records against a `CommBudget`, per phase and collective."""

    budget: CommBudget
    rows: List[ComparisonRow] = field(default_factory=list)

    @classmethod
    def of(cls, records: Iterable[Any], budget: CommBudget) -> "BudgetComparison":
        records = list(records)
        sizes = sorted({r.group_size for r in records} - set(budget.group_sizes()))
        if sizes:
            raise ValueError(f"comm accounting vs budget: the budget is for groups of {budget.group_sizes()} ranks "
                             f"(TP {budget.tp_size}), but collectives ran on groups of {sizes} ranks (KV heads "
                             "replicated unevenly: the budget counts only an even replication)")
        keys = set(budget.counts()) | {(r.op, r.phase) for r in records}
        def order(key: Tuple[str, str]) -> Tuple[int, int, str]:  # forward first; the layout's ops, then others
            op, phase = key
            return (PHASES.index(phase) if phase in PHASES else len(PHASES), OPS.index(op) if op in OPS else len(OPS), op)

        rows = []
        for op, phase in sorted(keys, key=order):
            mine = [r for r in records if r.op == op and r.phase == phase]
            rows.append(ComparisonRow(op, phase, len(mine), budget.counts().get((op, phase), 0),
                                      sum(r.nbytes for r in mine), budget.total_bytes(op, phase),
                                      sum(wire_bytes(op, r.nbytes, r.group_size) for r in mine),
                                      budget.wire_bytes(op, phase)))
        return cls(budget, rows)

    def total(self, phase: Optional[str] = None) -> ComparisonRow:
        """The rows of ``phase`` (None: all) summed (``op`` = "all")."""
        rows = [r for r in self.rows if phase is None or r.phase == phase]
        return ComparisonRow("all", phase or "all", sum(r.count for r in rows), sum(r.budget_count for r in rows),
                             sum(r.nbytes for r in rows), sum(r.budget_nbytes for r in rows),
                             sum(r.wire for r in rows), sum(r.budget_wire for r in rows))

    @property
    def ratio(self) -> Optional[float]:
        """Measured / budgeted bytes on the wire over the whole step (1.0: the layout's minimum)."""
        return self.total().ratio

    def as_dict(self) -> Dict[str, Any]:
        """JSON-ready: the budget's description and items, and each row with its ratio."""
        def row(r: ComparisonRow) -> Dict[str, Any]:
            return {"op": r.op, "phase": r.phase, "count": r.count, "budget_count": r.budget_count,
                    "bytes": r.nbytes, "budget_bytes": r.budget_nbytes, "wire_bytes": r.wire,
                    "budget_wire_bytes": r.budget_wire, "ratio": r.ratio}
        return {"budget": {"description": self.budget.description, "tp_size": self.budget.tp_size,
                           "items": [vars(i).copy() for i in self.budget.items]},
                "rows": [row(r) for r in self.rows],
                "totals": {k: row(self.total(None if k == "all" else k)) for k in ("forward", "backward", "all")}}

    def __str__(self) -> str:
        head = (f"{'op':<15} {'phase':<9} {'count':>5} {'budget':>6} {'bytes':>10} {'budget':>10} "
                f"{'wire':>10} {'budget':>10} {'x budget':>8}")
        lines = [f"measured vs Megatron-layout budget: {self.budget.description}", head, "-" * len(head)]
        for r in self.rows + [self.total("forward"), self.total("backward"), self.total()]:
            if r.op == "all" and r.phase == "forward":
                lines.append("-" * len(head))
            label = "total" if r.op == "all" else r.op
            lines.append(f"{label:<15} {r.phase:<9} {r.count:>5} {r.budget_count:>6} {_size(r.nbytes):>10} "
                         f"{_size(r.budget_nbytes):>10} {_size(r.wire):>10} {_size(r.budget_wire):>10} "
                         f"{_times(r):>8}")
        lines.append("bytes: full buffers; wire: what each rank sends in a ring (all-reduce 2(p-1)/p of its buffer, "
                     "all-gather and reduce-scatter (p-1)/p); x budget: wire / budget wire")
        return "\n".join(lines)


def _times(r: ComparisonRow) -> str:
    if r.ratio is not None:
        return f"{r.ratio:.2f}"
    return "extra" if r.wire else "-"


def _size(n: float) -> str:
    """Bytes, in the unit that keeps 3-4 significant figures readable (B, kB, MB, GB: powers of 1000)."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}" if n / scale < 1000 else f"{n / scale:.0f} {unit}"
    return f"{n:.0f} B"
