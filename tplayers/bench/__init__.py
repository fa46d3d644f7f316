"""Floor 8, bench: timing over ranks (timing.py), the overlap microbenchmark (overlap.py: config, modes,
runner; modules.py: what it builds; schedule.py: the collectives alone; measure.py: accounting,
timeline, trace), its report (report.py), one simulated rank (simulate.py)."""
from .config import MODES, SHAPES, BenchConfig
from .overlap import MODE_LABELS, run_overlap_bench
from .report import SCHEMA, summarize
from .timing import Timing, barrier, fwd_bwd_step, time_steps

__all__ = ["BenchConfig", "MODES", "MODE_LABELS", "SHAPES", "SCHEMA", "Timing", "barrier", "time_steps",
           "fwd_bwd_step", "run_overlap_bench", "summarize"]
