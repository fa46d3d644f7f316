"""The ``tplayers`` command: ``tplayers verify`` and ``tplayers bench``.

Both run the same per-rank code either on ranks they spawn themselves (no arguments needed:
2 CPU ranks on gloo) or, when torchrun's environment is present (RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT), on the ranks torchrun started, single- or multi-node.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from typing import List, Optional, Sequence

from ..core.dtypes import DTYPES
from ._launch import finish_torchrun, run_on_ranks, under_torchrun

__all__ = ["main", "build_parser"]


def _stdout_gone() -> None:
    """The reader of stdout went away (``tplayers verify --json | head -1``): as CLIs do, say nothing
    more there. Later writes, and the interpreter's final flush, go to /dev/null instead of raising."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


def _flush_stdout() -> None:
    try:
        sys.stdout.flush()
    except BrokenPipeError:
        _stdout_gone()


def _print(text: str) -> None:
    """``print`` for the command's output: a closed stdout is not an error (the run's exit status stands)."""
    try:
        print(text, flush=True)
    except BrokenPipeError:
        _stdout_gone()


def _tp_list(text: str) -> List[int]:
    try:
        sizes = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--tp takes sizes like 2 or 1,2,4, got {text!r}") from None
    if not sizes or any(s < 1 for s in sizes):
        raise argparse.ArgumentTypeError(f"--tp sizes must be >= 1, got {text!r}")
    return sizes


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"takes seconds, got {text!r}") from None
    if not value > 0 or value != value or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tplayers", description="Tensor-parallel layers: verify and benchmark.")
    sub = parser.add_subparsers(dest="command", metavar="{verify,bench}")
    sub.required = True

    def common(p: argparse.ArgumentParser, dtype: str) -> None:
        p.add_argument("--dtype", choices=list(DTYPES), default=dtype, help=f"parameter/activation dtype (default {dtype})")
        p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="cuda uses NCCL (default cpu/gloo)")
        p.add_argument("--backend", choices=["gloo", "nccl"], default=None,
                       help="override the process-group backend (e.g. gloo for several ranks on one GPU)")
        p.add_argument("--threads", type=_positive, default=1, help="torch threads per rank (default 1)")
        p.add_argument("--timeout", type=_positive_seconds, default=600.0,
                       help="seconds before a hung run is abandoned (default 600)")
        p.add_argument("--seed", type=int, default=0, help="seed of the weights and inputs, the same on every rank (default 0)")
        prog = p.add_mutually_exclusive_group()
        prog.add_argument("--progress", dest="progress", action="store_true", default=None,
                          help="show a progress bar on stderr (default: when stderr is a terminal)")
        prog.add_argument("--no-progress", dest="progress", action="store_false", help="never show a progress bar")

    v = sub.add_parser("verify", help="check every TP module against its dense reference",
                       description="Check every TP module against its dense reference (outputs, input and "
                                   "weight gradients). Exit status 1 if any check fails.")
    v.add_argument("--tp", type=_tp_list, default=None,
                   help="TP size(s), e.g. 2 or 1,2,4 (default 2; under torchrun: the world size)")
    common(v, "float64")
    v.add_argument("-k", "--only", action="append", metavar="PATTERN",
                   help="run only checks whose name contains PATTERN (or matches a glob); repeatable")
    v.add_argument("--list", action="store_true", help="list the checks and exit")
    v.add_argument("--rtol", type=float, default=None, help="override the dtype's default rtol")
    v.add_argument("--atol", type=float, default=None, help="override the dtype's default atol")
    v.add_argument("--json", action="store_true", help="print the results as JSON instead of a table")
    v.add_argument("--model", metavar="PKG.MODULE:BUILD", default=None,
                   help="check your own model instead: BUILD() returns (a tiny dense model, example inputs); it is "
                        "parallelized with --plan and audited region by region against its dense twin")
    v.add_argument("--plan", metavar="PKG.MODULE:PLAN", default=None,
                   help="the plan for --model (a dict, a Plan or a shipped plan's name; default 'auto')")

    from ..bench.overlap import LAYER_SHAPES, MODES, SHAPES

    b = sub.add_parser("bench", help="comm-overlap microbenchmark",
                       description="Time forward+backward of a TP module with the overlapped backward and with "
                                   "blocking collectives, the collectives alone, the matmuls alone, dense torch.nn "
                                   "and naive model parallelism; report the share of communication hidden.")
    b.add_argument("--module", choices=["mlp", "column", "block"], default=None,
                   help="mlp: Column -> GELU -> Row (default); column: one ColumnParallelLinear; "
                        "block: one ParallelTransformerBlock (attention + MLP)")
    b.add_argument("--shape", choices=sorted(SHAPES) + sorted(LAYER_SHAPES), default="comm-heavy",
                   help="named shape: " + "; ".join(f"{k}: {v}" for k, v in SHAPES.items()) + " (default comm-heavy); "
                        "or one real layer (a block): " + ", ".join(LAYER_SHAPES))
    for dim in ("batch", "seq", "hidden", "ffn"):
        b.add_argument(f"--{dim}", type=_positive, default=None, help=f"override the shape's {dim}")
    b.add_argument("--heads", type=_positive, default=4, help="attention heads of --module block (default 4)")
    b.add_argument("--tp", type=_positive, default=None, help="TP size (default 2; under torchrun: the world size)")
    b.add_argument("--sequence-parallel", action="store_true", help="shard activations along the sequence")
    b.add_argument("--iters", type=_positive, default=50, help="timed iterations per mode (default 50)")
    b.add_argument("--warmup", type=int, default=5, help="untimed iterations per mode first (default 5)")
    b.add_argument("--modes", default=",".join(MODES), help=f"comma-separated subset of {','.join(MODES)}")
    b.add_argument("--chunks", type=_positive, default=2,
                   help="batch chunks of mode tp_chunked (forward overlap, Domino-style; default 2)")
    common(b, "float32")
    b.add_argument("--link", metavar="SPEC", default=None,
                   help="emulate an interconnect: h100-nvlink | pcie5 | ib-ndr | GBPS[/LATENCY_US] | match:PRESET "
                        "(collectives still move the real data; each completes no earlier than its alpha-beta time)")
    b.add_argument("--simulate", action="store_true",
                   help="one rank of TP --tp (default 8) in this process: real compute, collectives timed by "
                        "--link (default match:h100-nvlink; with --device cuda: h100-nvlink); any TP size on one machine")
    b.add_argument("--json", action="store_true", help="print the report as JSON on stdout")
    b.add_argument("--save", metavar="PATH", help="also write the JSON report to PATH")
    b.add_argument("--plot", metavar="PNG", help="bar chart of the timings (needs matplotlib: tplayers[plot])")
    b.add_argument("--trace", metavar="DIR", help="write a torch.profiler trace per rank showing the overlap")
    return parser


# ---------------------------------------------------------------------------- verify


def _verify(args: argparse.Namespace) -> int:
    from . import verify as V

    if args.plan and not args.model:
        print("tplayers verify: --plan goes with --model", file=sys.stderr)
        return 2
    checks = V.select_checks(args.only) if not args.model else [V.Check("model", args.model, V.user_model_check)]
    if args.list:
        _print("\n".join(c.name for c in V.CHECKS))
        return 0
    if not checks:
        print(f"tplayers verify: no check matches {args.only}; see tplayers verify --list", file=sys.stderr)
        return 2
    progress = args.progress if args.progress is not None else (sys.stderr.isatty() and not args.json)
    cfg = V.VerifyConfig(dtype=args.dtype, device=args.device, seed=args.seed, rtol=args.rtol, atol=args.atol,
                         progress=progress, model=args.model, plan=args.plan)
    names = [c.name for c in checks]
    sizes = args.tp or [None]
    if under_torchrun() and len(sizes) > 1:
        print("tplayers verify: under torchrun pass a single --tp (the ranks are fixed)", file=sys.stderr)
        return 2
    results: List[V.CheckResult] = []
    reporter = True
    for size in sizes:
        per_rank, reporter = run_on_ranks(V.run_checks, names, cfg, tp=size, device=args.device,
                                          backend=args.backend, threads=args.threads, timeout_s=args.timeout)
        results += V.merge_rank_results(per_rank)
    if under_torchrun():
        results = _merge_over_world(results, args.device)
    if reporter:
        if args.json:
            _print(json.dumps(V.report_json(results, args.dtype, args.device), indent=2, allow_nan=False))
        else:
            low_precision = DTYPES[args.dtype] in V.LOW_PRECISION  # per-check tolerances: a column
            tol = ("--rtol/--atol" if args.rtol is not None or args.atol is not None else
                   "the audit's, relative to scale" if args.model else
                   "default_tolerance(dtype)" + (" x per-check scale" if low_precision else ""))
            count = f"{len(names)} checks" + (f" x {len(sizes)} TP sizes = {len(names) * len(sizes)}"
                                               if len(sizes) > 1 else "")
            _print(f"tplayers verify: {count}, dtype={args.dtype}, device={args.device}, "
                   f"tolerance {tol}; reference: dense torch.nn, same weights")
            _print(V.format_table(results, tolerances=low_precision))
            if args.model:  # the audit's whole message: the region, the worst tensor, the likely cause
                _print("\n".join(f"\nTP {r.tp}: {r.message}" for r in results if not r.passed and r.message))
    return V.exit_code(results)


def _merge_over_world(results: list, device: str) -> list:
    """Under torchrun with several TP groups: the worst result of every group, on every rank."""
    import torch
    import torch.distributed as dist

    from ..core.groups import resolve_group
    from .verify import _agree

    if not dist.is_initialized() or dist.get_world_size() == 1 or not results:
        return results
    dev = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")
    local = [v for r in results for v in (r.forward_error, r.grad_error, 0.0 if r.passed else 1.0)]
    worst = _agree(resolve_group(dist.group.WORLD), local, dev)  # NaN-aware max over every rank
    for i, r in enumerate(results):
        fwd, grad, failed = worst[3 * i: 3 * i + 3]
        r.forward_error, r.grad_error = fwd, grad
        if failed and r.passed:
            r.passed, r.message = False, "failed in another TP group"
    return results


# ---------------------------------------------------------------------------- bench


def _bench(args: argparse.Namespace) -> int:
    from ..bench.overlap import LAYER_SHAPES, SHAPES, BenchConfig, run_overlap_bench
    from .bench_cmd import format_report, plot_report

    shape = dict(SHAPES.get(args.shape) or LAYER_SHAPES[args.shape])
    module = args.module or ("block" if args.shape in LAYER_SHAPES else "mlp")
    if args.shape in LAYER_SHAPES and module != "block":
        print(f"tplayers bench: --shape {args.shape} is a transformer layer: use --module block (or leave it out)",
              file=sys.stderr)
        return 2
    for dim in ("batch", "seq", "hidden", "ffn"):
        if getattr(args, dim) is not None:
            shape[dim] = getattr(args, dim)
    if args.ffn is None and args.hidden is not None:
        shape["ffn"] = 4 * args.hidden
    progress = args.progress if args.progress is not None else sys.stderr.isatty()
    modes = tuple(m.strip() for m in args.modes.split(",") if m.strip())
    shape.setdefault("heads", args.heads)
    tp = args.tp or (int(os.environ["WORLD_SIZE"]) if under_torchrun() else (8 if args.simulate else 2))
    # the default simulated wire: an H100 node's, scaled to this CPU's matmul speed (match:) or, on a
    # GPU, as is (its compute is real)
    link = args.link or (("h100-nvlink" if args.device == "cuda" else "match:h100-nvlink") if args.simulate else None)
    try:
        cfg = BenchConfig(module=module, dtype=args.dtype, device=args.device,
                          sequence_parallel=args.sequence_parallel, iters=args.iters, warmup=args.warmup,
                          modes=modes, seed=args.seed, progress=progress, trace_dir=args.trace, link=link,
                          chunks=args.chunks, **shape)
        cfg.check_tp(tp)
        if args.simulate and under_torchrun():
            raise ValueError("bench --simulate runs in one process: start it without torchrun")
    except ValueError as e:
        print(f"tplayers {e}", file=sys.stderr)
        return 2
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
    _print(json.dumps(report, indent=2) if args.json else format_report(report))
    try:
        if args.save:
            with open(args.save, "w") as f:
                json.dump(report, f, indent=2)
        if args.plot:
            plot_report(report, args.plot)
            if not args.json:
                _print(f"plot: {args.plot}")
    except OSError as e:  # checked before the run, but the place can go away or fill up meanwhile
        print(f"tplayers bench: could not write the result (printed above): {e}", file=sys.stderr)
        return 1
    return 0


def _usage_error(args: argparse.Namespace) -> Optional[str]:
    """What makes these arguments unusable, found before anything runs (a run must never be lost
    to an argument that could have been checked first), or None."""
    import torch

    backend = args.backend or ("nccl" if args.device == "cuda" else "gloo")
    if backend == "nccl" and args.device != "cuda":
        return "--backend nccl needs --device cuda (NCCL moves CUDA tensors only)"
    if args.device == "cuda" and not torch.cuda.is_available():
        return f"--device cuda{' (NCCL)' if backend == 'nccl' else ''}, but torch.cuda.is_available() is False here"
    for flag, target in (("--save", getattr(args, "save", None)), ("--plot", getattr(args, "plot", None))):
        if target:
            folder = os.path.dirname(os.path.abspath(target))
            if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
                return f"{flag} {target}: the directory {folder} does not exist or is not writable"
            if os.path.isdir(target):
                return f"{flag} {target}: is a directory (give a file name)"
            if os.path.exists(target) and not os.access(target, os.W_OK):
                return f"{flag} {target}: the file exists and is not writable"
    trace = getattr(args, "trace", None)
    if trace and os.path.exists(trace) and not (os.path.isdir(trace) and os.access(trace, os.W_OK)):
        return f"--trace {trace}: not a writable directory"
    if trace and not os.path.exists(trace) and not os.access(os.path.dirname(os.path.abspath(trace)) or ".", os.W_OK):
        return f"--trace {trace}: cannot create it (its parent is missing or not writable)"
    if getattr(args, "plot", None) and importlib.util.find_spec("matplotlib") is None:
        return "--plot needs matplotlib: pip install 'tplayers[plot]'"
    return None


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of the ``tplayers`` console script; returns the exit status."""
    from ..testing import WorldError

    try:
        args = build_parser().parse_args(argv)
    except SystemExit:  # --help, or a usage error: argparse printed it
        _flush_stdout()
        raise
    problem = _usage_error(args)
    if problem:
        print(f"tplayers {args.command}: {problem}", file=sys.stderr)
        return 2
    try:
        rc = _verify(args) if args.command == "verify" else _bench(args)
    except WorldError as e:
        print(f"tplayers {args.command}: the ranks failed: {e}", file=sys.stderr)
        rc = 1
    finally:
        finish_torchrun()
    return rc
