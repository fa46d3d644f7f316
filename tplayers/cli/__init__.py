"""The ``tplayers`` command: ``tplayers verify`` and ``tplayers bench``.

Both run the same per-rank code either on ranks they spawn themselves (no arguments needed:
2 CPU ranks on gloo) or, when torchrun's environment is present (RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT), on the ranks torchrun started, single- or multi-node.

This module holds the argument parser and the dispatch; the commands' bodies are
:func:`tplayers.cli.verify.verify_command` and :func:`tplayers.cli.bench_cmd.bench_command`.
"""
from __future__ import annotations

import argparse
import signal
import sys
from typing import Any, List, Optional, Sequence

from ..bench.predict import GPUS
from ..core.dtypes import DTYPES
from .._version import __version__
from ._launch import finish_torchrun
from .output import flush_stdout

__all__ = ["main", "build_parser"]


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


def _common(p: argparse.ArgumentParser, dtype: str,
            progress_help: str = "show a progress bar on stderr (default: when stderr is a terminal)") -> None:
    """The options both commands take (where and how the ranks run)."""
    p.add_argument("--dtype", choices=list(DTYPES), default=dtype, help=f"parameter/activation dtype (default {dtype})")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="cuda uses NCCL (default cpu/gloo)")
    p.add_argument("--backend", choices=["gloo", "nccl"], default=None,
                   help="override the process-group backend (e.g. gloo for several ranks on one GPU)")
    p.add_argument("--threads", type=_positive, default=1, help="torch threads per rank (default 1)")
    p.add_argument("--timeout", type=_positive_seconds, default=600.0,
                   help="seconds before a hung run is abandoned (default 600)")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and inputs, the same on every rank (default 0)")
    prog = p.add_mutually_exclusive_group()
    prog.add_argument("--progress", dest="progress", action="store_true", default=None, help=progress_help)
    prog.add_argument("--no-progress", dest="progress", action="store_false", help="print nothing on stderr while running")


def _add_verify(sub: Any) -> None:
    v = sub.add_parser("verify", help="check every TP module against its dense reference",
                       description="Check every TP module against its dense reference (outputs, input and "
                                   "weight gradients). Exit status 1 if any check fails.")
    v.add_argument("--tp", type=_tp_list, default=None,
                   help="TP size(s), e.g. 2 or 1,2,4 (default 2; under torchrun: the world size, or groups of each size given)")
    _common(v, "float64")
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


def _add_bench(sub: Any) -> None:
    from ..bench.hf_budget import HF_FAMILIES
    from ..bench.config import LAYER_SHAPES, MODES, SHAPES

    b = sub.add_parser("bench", help="comm-overlap microbenchmark",
                       description="Time forward+backward of a TP module with the overlapped backward and with "
                                   "blocking collectives, the collectives alone, the matmuls alone, dense torch.nn "
                                   "and naive model parallelism; report the share of communication hidden.")
    b.add_argument("--module", choices=["mlp", "column", "block"] + [f"hf:{f}" for f in HF_FAMILIES], default=None,
                   help="mlp: Column -> GELU -> Row (default); column: one ColumnParallelLinear; "
                        "block: one ParallelTransformerBlock (attention + MLP); hf:FAMILY: a tiny Hugging Face "
                        "causal LM of that family, one step's collectives counted against the Megatron-layout budget "
                        "(not timed; --batch 2 --seq 64 --hidden 64 --ffn 128 --heads 4 --layers 2 --vocab 256 "
                        "unless given)")
    b.add_argument("--shape", choices=sorted(SHAPES) + sorted(LAYER_SHAPES), default="comm-heavy",
                   help="named shape: " + "; ".join(f"{k}: {v}" for k, v in SHAPES.items()) + " (default comm-heavy); "
                        "or one real layer (a block): " + ", ".join(LAYER_SHAPES))
    for dim in ("batch", "seq", "hidden", "ffn"):
        b.add_argument(f"--{dim}", type=_positive, default=None, help=f"override the shape's {dim}")
    b.add_argument("--heads", type=_positive, default=4, help="attention heads of --module block or hf: (default 4)")
    b.add_argument("--layers", type=_positive, default=None, help="decoder layers of --module hf: (default 2)")
    b.add_argument("--vocab", type=_positive, default=None, help="vocabulary of --module hf: (default 256)")
    b.add_argument("--loss-parallel", action="store_true",
                   help="--module hf: the loss on vocabulary-split logits (parallelize(loss_parallel=True))")
    b.add_argument("--autocast", choices=["bfloat16", "float16"], default=None,
                   help="--module hf: run the step under torch.autocast of this dtype (the budget counts the TP "
                        "regions in it, the residual stream in --dtype)")
    b.add_argument("--tp", type=_positive, default=None, help="TP size (default 2; under torchrun: the world size)")
    b.add_argument("--sequence-parallel", action="store_true", help="shard activations along the sequence")
    b.add_argument("--iters", type=_positive, default=None, help="timed iterations per mode (default 50; --quick: 10)")
    b.add_argument("--warmup", type=int, default=None, help="untimed iterations per mode first (default 5; --quick: 1)")
    b.add_argument("--quick", action="store_true",
                   help="a short run: 10 iterations after 1 warm-up (an explicit --iters / --warmup wins)")
    b.add_argument("--modes", default=",".join(MODES), help=f"comma-separated subset of {','.join(MODES)}")
    b.add_argument("--chunks", type=_positive, default=2,
                   help="batch chunks of mode tp_chunked (forward overlap, Domino-style; default 2)")
    _common(b, "float32", "the time the run will take (from its first round) and progress on stderr: a bar on a "
                          "terminal, whole lines otherwise (default)")
    b.add_argument("--link", metavar="SPEC", default=None,
                   help="emulate an interconnect: h100-nvlink | pcie5 | ib-ndr | GBPS[/LATENCY_US] | match:PRESET "
                        "| match:PRESET@TFLOPS (collectives still move the real data; each completes no earlier than "
                        "its alpha-beta time); none: the real backend. Default on CPU at TP > 1: match:h100-nvlink@0.1 "
                        "(real gloo on shared CPU cores cannot show overlap)")
    b.add_argument("--simulate", action="store_true",
                   help="one rank of TP --tp (default 8) in this process: real compute, collectives timed by "
                        "--link (default match:h100-nvlink; with --device cuda: h100-nvlink); any TP size on one machine")
    b.add_argument("--predict", metavar="GPU", choices=sorted(GPUS),
                   help="with --simulate: PREDICT each mode's step on this GPU (h100, h200) from one step recorded "
                        "on the meta device (shapes only, any size in seconds) and --link's model; nothing is timed")
    b.add_argument("--json", action="store_true", help="print the report as JSON on stdout")
    b.add_argument("--save", metavar="PATH", help="also write the JSON report to PATH")
    b.add_argument("--plot", metavar="PNG", help="bar chart of the timings (needs matplotlib: tplayers[plot])")
    b.add_argument("--trace", metavar="DIR", help="write a torch.profiler trace per rank showing the overlap")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tplayers", description="Tensor-parallel layers: verify and benchmark.")
    parser.add_argument("--version", action="version", version=f"tplayers {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="{verify,bench}")
    sub.required = True
    _add_verify(sub)
    _add_bench(sub)
    return parser


def _usage_error(args: argparse.Namespace) -> Optional[str]:
    """What makes these arguments unusable, found before anything runs (a run must never be lost
    to an argument that could have been checked first), or None."""
    import torch

    backend = args.backend or ("nccl" if args.device == "cuda" else "gloo")
    if backend == "nccl" and args.device != "cuda":
        return "--backend nccl needs --device cuda (NCCL moves CUDA tensors only)"
    if args.device == "cuda" and not torch.cuda.is_available():
        return f"--device cuda{' (NCCL)' if backend == 'nccl' else ''}, but torch.cuda.is_available() is False here"
    if args.command == "bench":
        from .bench_cmd import output_problem

        return output_problem(args)
    return None


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of the ``tplayers`` console script; returns the exit status."""
    from ..testing import WorldError

    try:
        args = build_parser().parse_args(argv)
    except SystemExit:  # --help, or a usage error: argparse printed it
        flush_stdout()
        raise
    problem = _usage_error(args)
    if problem:
        print(f"tplayers {args.command}: {problem}", file=sys.stderr)
        return 2
    previous = _sigterm_as_interrupt()
    try:
        if args.command == "verify":
            from .verify import verify_command as command
        else:
            from .bench_cmd import bench_command as command
        rc = command(args)
    except WorldError as e:
        print(f"tplayers {args.command}: the ranks failed: {e}", file=sys.stderr)
        rc = 1
    except KeyboardInterrupt:
        print(f"tplayers {args.command}: interrupted", file=sys.stderr)
        rc = 130
    finally:
        finish_torchrun()
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    return rc


def _sigterm_as_interrupt() -> Any:
    """SIGTERM (timeout(1), a CI cancel, a job scheduler) ends the command as Ctrl-C does: the
    ranks and their forkserver are shut down on the way out. Returns the handler it replaced (None
    off the main thread, where Python allows no handler)."""
    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    try:
        return signal.signal(signal.SIGTERM, interrupt)
    except ValueError:  # not the main thread
        return None
