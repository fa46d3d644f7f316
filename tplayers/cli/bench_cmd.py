"""``tplayers bench``: the comm-overlap microbenchmark as a command (table, JSON, plot)."""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from typing import Optional

from ..bench.hf_budget import HF_FAMILIES, HFBudgetConfig, format_hf_budget, run_hf_budget
from ..bench.link import DEFAULT_CPU_LINK
from ..bench.config import LAYER_SHAPES, SHAPES, BenchConfig
from ..bench.overlap import run_overlap_bench
from ..testing import FORKSERVER_PRELOAD
from ._launch import run_on_ranks, under_torchrun
from .bench_table import format_prediction, format_report, plot_report
from .output import print_out

__all__ = ["bench_command", "bench_config", "hf_budget_config", "output_problem"]


# ---------------------------------------------------------------------------- the command


def output_problem(args: argparse.Namespace) -> Optional[str]:
    """What makes bench's output options (--save, --plot, --trace) unusable, found before the run
    (a run must never be lost to a path that could have been checked first), or None."""
    for flag, target in (("--save", args.save), ("--plot", args.plot)):
        if target:
            folder = os.path.dirname(os.path.abspath(target))
            if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
                return f"{flag} {target}: the directory {folder} does not exist or is not writable"
            if os.path.isdir(target):
                return f"{flag} {target}: is a directory (give a file name)"
            if os.path.exists(target) and not os.access(target, os.W_OK):
                return f"{flag} {target}: the file exists and is not writable"
    trace = args.trace
    if trace and os.path.exists(trace) and not (os.path.isdir(trace) and os.access(trace, os.W_OK)):
        return f"--trace {trace}: not a writable directory"
    if trace and not os.path.exists(trace) and not os.access(os.path.dirname(os.path.abspath(trace)) or ".", os.W_OK):
        return f"--trace {trace}: cannot create it (its parent is missing or not writable)"
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        return "--plot needs matplotlib: pip install 'tplayers[plot]'"
    return None


def bench_config(args: argparse.Namespace, tp: int) -> BenchConfig:
    """The BenchConfig the arguments describe (ValueError: unusable, with the message to print)."""
    shape = dict(SHAPES.get(args.shape) or LAYER_SHAPES[args.shape])
    module = args.module or ("block" if args.shape in LAYER_SHAPES else "mlp")
    if args.shape in LAYER_SHAPES and module != "block":
        raise ValueError(f"bench: --shape {args.shape} is a transformer layer: use --module block (or leave it out)")
    for dim in ("batch", "seq", "hidden", "ffn"):
        if getattr(args, dim) is not None:
            shape[dim] = getattr(args, dim)
    if args.ffn is None and args.hidden is not None:
        shape["ffn"] = 4 * args.hidden
    # progress on stderr unless --no-progress: a bar on a terminal, whole lines into a pipe or a log
    progress = args.progress if args.progress is not None else True
    modes = tuple(m.strip() for m in args.modes.split(",") if m.strip())
    shape.setdefault("heads", args.heads)
    iters = args.iters if args.iters is not None else (QUICK_ITERS if args.quick else 50)
    warmup = args.warmup if args.warmup is not None else (QUICK_WARMUP if args.quick else 5)
    link, default_link = _link(args, tp)
    cfg = BenchConfig(module=module, dtype=args.dtype, device=args.device,
                      sequence_parallel=args.sequence_parallel, iters=iters, warmup=warmup,
                      modes=modes, seed=args.seed, progress=progress, trace_dir=args.trace, link=link,
                      default_link=default_link, chunks=args.chunks, **shape)
    cfg.check_tp(tp)
    if args.simulate and under_torchrun():
        raise ValueError("bench --simulate runs in one process: start it without torchrun")
    return cfg


QUICK_ITERS, QUICK_WARMUP = 10, 1  # --quick (an explicit --iters / --warmup wins)


def _link(args: argparse.Namespace, tp: int) -> "tuple[Optional[str], bool]":
    """The emulated link's spec (None: the real backend), and whether it is the CPU default.

    On CPU the real gloo collectives are CPU work competing with the matmuls for the same cores, so
    real overlap cannot show there: unless told otherwise (``--link SPEC`` / ``--link none``) the
    bench runs over `DEFAULT_CPU_LINK`, whose numbers are fixed (an H100 node's NVLink for a stated
    reference CPU rank), not measured on a possibly loaded box. ``--simulate`` has no real
    collectives: its default is the same link on CPU, NVLink as is on a GPU (its compute is real)."""
    spec = args.link.strip() if args.link else None
    if spec == "none":
        if args.simulate:
            raise ValueError("bench --simulate needs a link (its collectives move nothing): drop --link none")
        return None, False
    if spec:
        return spec, False
    if args.simulate:
        return ("h100-nvlink" if args.device == "cuda" else DEFAULT_CPU_LINK), args.device != "cuda"
    if args.device == "cpu" and tp > 1:
        return DEFAULT_CPU_LINK, True
    return None, False


def hf_budget_config(args: argparse.Namespace, tp: int) -> HFBudgetConfig:
    """The HFBudgetConfig of ``--module hf:FAMILY`` (ValueError: unusable, with the message to print)."""
    refused = [flag for flag, given in (("--simulate", args.simulate), ("--plot", args.plot), ("--trace", args.trace),
                                        ("--link", args.link)) if given]
    if refused:
        raise ValueError(f"bench --module {args.module} counts one step's collectives (nothing timed): "
                         f"{', '.join(refused)} do not apply")
    defaults = HFBudgetConfig(family="")
    sizes = {dim: getattr(args, dim) if getattr(args, dim) is not None else getattr(defaults, dim)
             for dim in ("batch", "seq", "hidden", "ffn", "layers", "vocab")}
    if args.ffn is None and args.hidden is not None:
        sizes["ffn"] = 2 * args.hidden
    cfg = HFBudgetConfig(family=args.module[len("hf:"):], heads=args.heads, dtype=args.dtype, device=args.device,
                         sequence_parallel=args.sequence_parallel, loss_parallel=args.loss_parallel, seed=args.seed,
                         autocast=args.autocast, **sizes)
    cfg.check(tp)
    return cfg


def _hf_budget_command(args: argparse.Namespace, tp: int) -> int:
    """``tplayers bench --module hf:FAMILY``: one counted step on every rank, measured vs budget."""
    try:
        cfg = hf_budget_config(args, tp)
    except ValueError as e:
        print(f"tplayers {e}", file=sys.stderr)
        return 2
    if importlib.util.find_spec("transformers") is None:
        print(f"tplayers bench: --module {args.module} needs transformers: pip install 'tplayers[hf]'", file=sys.stderr)
        return 2
    module = f"transformers.models.{HF_FAMILIES[cfg.family][0]}.modeling_{HF_FAMILIES[cfg.family][0]}"
    if module not in FORKSERVER_PRELOAD:  # spawned ranks fork from a server that imported it once, not each on its own
        FORKSERVER_PRELOAD.append(module)
    per_rank, reporter = run_on_ranks(run_hf_budget, cfg, tp=args.tp, device=args.device, backend=args.backend,
                                      threads=args.threads, timeout_s=args.timeout)
    if not reporter:
        return 0
    result = per_rank[0]
    print_out(json.dumps(result["report"], indent=2) if args.json else format_hf_budget(result))
    if args.save:
        try:
            with open(args.save, "w") as f:
                json.dump(result["report"], f, indent=2)
        except OSError as e:
            print(f"tplayers bench: could not write the result (printed above): {e}", file=sys.stderr)
            return 1
    return 0


def _predict_command(args: argparse.Namespace, cfg: BenchConfig, tp: int) -> int:
    """``tplayers bench --simulate --predict GPU``: each mode's step predicted (tplayers.bench.predict), printed."""
    refused = [flag for flag, given in (("--plot", args.plot), ("--trace", args.trace)) if given]
    if not args.simulate or refused:
        why = "goes with --simulate" if not args.simulate else f"times nothing: drop {', '.join(refused)}"
        print(f"tplayers bench: --predict {why} (one rank of --tp recorded on the meta device, predicted on the GPU "
              "named)", file=sys.stderr)
        return 2
    from ..bench.simulate import predict

    report = predict(cfg, tp, args.predict)
    print_out(json.dumps(report, indent=2) if args.json else format_prediction(report))
    if args.save:
        try:
            with open(args.save, "w") as f:
                json.dump(report, f, indent=2)
        except OSError as e:
            print(f"tplayers bench: could not write the result (printed above): {e}", file=sys.stderr)
            return 1
    return 0


def bench_command(args: argparse.Namespace) -> int:
    """``tplayers bench`` with parsed arguments: run, print (table or JSON), save, plot; the exit status."""
    tp = args.tp or (int(os.environ["WORLD_SIZE"]) if under_torchrun() else (8 if args.simulate else 2))
    if args.module and args.module.startswith("hf:"):
        return _hf_budget_command(args, tp)
    unused = [flag for flag, given in (("--loss-parallel", args.loss_parallel), ("--layers", args.layers is not None),
                                       ("--vocab", args.vocab is not None), ("--autocast", args.autocast)) if given]
    if unused:
        print(f"tplayers bench: {', '.join(unused)} appl{'y' if len(unused) > 1 else 'ies'} to --module hf:FAMILY only",
              file=sys.stderr)
        return 2
    try:
        cfg = bench_config(args, tp)
    except ValueError as e:
        print(f"tplayers {e}", file=sys.stderr)
        return 2
    if args.predict:
        return _predict_command(args, cfg, tp)
    if args.simulate:
        from ..bench.simulate import simulate

        import torch

        torch.set_num_threads(args.threads)
        per_rank, reporter = [simulate(cfg, tp)], True
    else:
        per_rank, reporter = run_on_ranks(run_overlap_bench, cfg, tp=args.tp, device=args.device,
                                          backend=args.backend, threads=args.threads, timeout_s=args.timeout)
    if not reporter:
        return 0
    report = per_rank[0]
    # the result first: a file that cannot be written afterwards must not lose the run
    print_out(json.dumps(report, indent=2) if args.json else format_report(report))
    try:
        if args.save:
            with open(args.save, "w") as f:
                json.dump(report, f, indent=2)
        if args.plot:
            plot_report(report, args.plot)
            if not args.json:
                print_out(f"plot: {args.plot}")
    except OSError as e:  # checked before the run, but the place can go away or fill up meanwhile
        print(f"tplayers bench: could not write the result (printed above): {e}", file=sys.stderr)
        return 1
    return 0
