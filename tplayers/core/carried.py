"""What the ranks must share, carried by their collectives: each checked collective's fingerprint slot
(:mod:`.fingerprint`) ends with ``CARRIED`` = 4 bytes, the digest of every piece of state :func:`carry`
registered on its group (a TP model's inputs, random generators and replicated parameters while its
forward runs; a vocabulary-parallel loss's targets), computed on the device: no synchronization, no extra
collective. Ranks whose bytes differ ran the same collective on different data: the collective raises
``RanksDiverged`` on every rank, naming what differs (one more exchange of every rank's entries, on the
error path only).
"""
from __future__ import annotations

import weakref
from contextlib import contextmanager
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

__all__ = ["CARRIED", "Shared", "carry", "carrying", "carried", "entries_text", "diverged_message", "forget",
           "kind_of"]

CARRIED = 4  # bytes per rank, one per element (values 0..255: exact in every stamped dtype)


class Shared:
    """One piece of state every rank of a group must share: ``digests`` (``(k,)`` int64, one per name in
    ``names``, on any device; :mod:`.digest`), a ``label`` and ``advice`` for the error, and ``detail``
    (optional, called on the error path only: finer ``(name, digest)`` pairs, e.g. one per parameter where
    ``digests`` holds one for them all), ``kinds`` (optional, the error path only: each name's dtype and shape,
    said beside a difference the values alone would not explain)."""

    __slots__ = ("label", "names", "digests", "advice", "detail", "kinds")

    def __init__(self, label: str, names: Sequence[str], digests: torch.Tensor, advice: str = "",
                 detail: Optional[Callable[[], List[Tuple[str, int]]]] = None,
                 kinds: Optional[Callable[[], List[str]]] = None) -> None:
        self.label, self.names, self.digests, self.advice, self.detail = label, list(names), digests, advice, detail
        self.kinds = kinds

    def entries(self) -> List[Tuple[str, int]]:
        return self.detail() if self.detail is not None else list(zip(self.names, self.digests.tolist()))

    def described(self) -> List[Tuple[str, int, str]]:
        """:meth:`entries` with each one's kind ("" where none is known)."""
        entries = self.entries()
        kinds = self.kinds() if self.kinds is not None and self.detail is None else []
        return [(name, value, kinds[i] if i < len(kinds) else "") for i, (name, value) in enumerate(entries)]


def kind_of(t: torch.Tensor) -> str:
    """A tensor's dtype and shape as a :class:`Shared` entry's kind says them: ``int64 (2, 16)``."""
    return f"{str(t.dtype).replace('torch.', '')} {tuple(t.shape)}"


class _State:
    """A group's carried pieces, and their combined bytes per buffer dtype (computed once per change)."""

    def __init__(self) -> None:
        self.shared: Dict[Any, Shared] = {}
        self.combined: Optional[torch.Tensor] = None  # (CARRIED,) int64
        self.bytes: Dict[Tuple[torch.dtype, torch.device], torch.Tensor] = {}


_STATES: "weakref.WeakKeyDictionary[Any, _State]" = weakref.WeakKeyDictionary()
_SHIFTS: Dict[torch.device, torch.Tensor] = {}
_MASK = (1 << 64) - 1


def _state(pg: Any) -> _State:
    state = _STATES.get(pg)
    if state is None:
        state = _STATES[pg] = _State()
    return state


def carry(pg: Any, key: Any, shared: Optional[Shared]) -> None:
    """From now on every checked collective on ``pg`` carries ``shared``'s digests (under ``key``,
    replacing what was carried under it; None: stop carrying it). A rank whose digests differ makes the
    collective raise ``RanksDiverged`` on every rank, naming ``shared``'s entries that differ."""
    state = _state(pg)
    if shared is None:
        if state.shared.pop(key, None) is None:
            return
    else:
        state.shared[key] = shared
    state.combined, state.bytes = None, {}


def forget(pg: Any) -> None:
    """Stop carrying everything on ``pg``: after ``RanksDiverged`` the step is abandoned, and a piece carried until
    the end of a backward that raised (which never ends) must not ride in the collectives of what runs next."""
    _STATES.pop(pg, None)


@contextmanager
def carrying(pg: Any, key: Any, shared: Shared) -> Iterator[None]:
    """:func:`carry` ``shared`` for the block's collectives, then what was carried under ``key`` before."""
    before = _state(pg).shared.get(key)
    carry(pg, key, shared)
    try:
        yield
    finally:
        carry(pg, key, before)


def carried(pg: Any, dtype: torch.dtype, device: torch.device) -> Tuple[Tuple[Shared, ...], Optional[torch.Tensor]]:
    """What a collective on ``pg`` carries now: the pieces, and their ``CARRIED`` bytes combined (a
    wrapping sum of the digests, folded to 32 bits) as ``dtype`` on ``device`` (None: nothing carried)."""
    state = _STATES.get(pg)
    if state is None or not state.shared:
        return (), None
    out = state.bytes.get((dtype, device))
    if out is None:
        if state.combined is None:
            parts = [part.digests for part in state.shared.values()]
            if all(d.device.type == "cpu" for d in parts):  # read on the host: no device to wait for
                total = sum(sum(d.tolist()) for d in parts) & _MASK
                folded = total ^ (total >> 32)
                state.combined = torch.tensor([(folded >> s) & 255 for s in (0, 8, 16, 24)], dtype=torch.int64)
            else:  # on the device: no synchronization
                total = torch.stack([d.to(device).sum() for d in parts]).sum()
                shifts = _SHIFTS.get(device)
                if shifts is None:
                    shifts = _SHIFTS[device] = torch.tensor([0, 8, 16, 24], dtype=torch.int64, device=device)
                state.combined = ((total ^ (total >> 32)) >> shifts) & 255
        out = state.bytes[(dtype, device)] = state.combined.to(device=device, dtype=dtype)
    return tuple(state.shared.values()), out


def entries_text(shared: Tuple[Shared, ...], where: str = "") -> str:
    """This rank's entries (``piece index, name, digest, kind`` per line), after ``where`` it runs (its global rank and
    host, an ``@`` line): what ranks exchange on the error path."""
    return "\n".join([f"@\t{where}"] * bool(where) + [f"{i}\t{name}\t{value}\t{kind}" for i, part in enumerate(shared)
                                                     for name, value, kind in part.described()])


def _where(texts: Sequence[str], ranks: Sequence[int]) -> str:
    """Where the group's ``ranks`` run, from their ``@`` lines: ``rank 1 = global rank 3 on node-b``."""
    at = {r: line[2:] for r, text in enumerate(texts) for line in text.splitlines() if line.startswith("@\t")}
    said = [f"rank {r} = {at[r]}" for r in ranks if r in at]
    return f" (group {'; '.join(said)})" if said else ""


def diverged_message(shared: Tuple[Shared, ...], texts: Sequence[str], collective: str, late: bool) -> str:
    """The error for a collective whose ranks carried different state, from every rank's
    :func:`entries_text` (``texts``, in rank order): which state, which entries (an argument, a generator,
    a parameter), which ranks."""
    size = len(texts)
    every = [dict(((int(i), name), (value, kind)) for i, name, value, kind in
                  (line.split("\t") for line in text.splitlines() if line and not line.startswith("@\t")))
             for text in texts]
    named: List[int] = []  # the ranks the message names
    lines, advice = [], []
    for i, part in enumerate(shared):
        found = []
        names = list(dict.fromkeys(name for entries in every for (j, name) in entries if j == i))  # every rank's
        for name in names:
            present = [r for r in range(size) if (i, name) in every[r]]
            if len(present) < size:  # (an argument passed on some ranks only: labels=, a mask)
                found.append(f"{name} is given on rank(s) {present} only")
                named.extend(r for r in range(size) if r not in present)
                continue
            ranks = [r for r in range(1, size) if every[r].get((i, name)) != every[0].get((i, name))]
            if ranks:
                kinds = {r: every[r].get((i, name), ("", ""))[1] for r in [0] + ranks}
                said = (" (" + "; ".join(f"rank {r}: {k}" for r, k in kinds.items()) + ")"
                        if len(set(kinds.values())) > 1 else "")  # (a dtype or a shape of its own on some rank)
                found.append(f"{name} differs between rank 0 and rank(s) {ranks}{said}")
                named.extend(ranks)
        if found:
            lines.append(f"{part.label}: " + "; ".join(found))
            if part.advice and part.advice not in advice:
                advice.append(part.advice)
    if not lines:  # the ranks carry different sets of state (a model built differently on one rank)
        lines = ["the ranks carry different pieces of state: " +
                 " | ".join(f"rank {r}: {len(e)} entries" for r, e in enumerate(every))]
    fate = (" It was checked when the group's next collective launched (a GPU's fingerprints reach the host "
            "without a synchronization): its result may have been used." if late else
            " The collective's result was discarded.")
    return ("tplayers: the ranks of a TP group ran the same collective on state every rank must share, and it "
            "differs (they compute on different data: the model would train wrong with no other error):\n  "
            + "\n  ".join(lines) + _where(texts, sorted({0, *named})) + "\n" + " ".join(advice) + fate
            + f" (the collective: {collective})")
