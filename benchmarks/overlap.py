"""The first comm-overlap microbenchmark: Column -> GELU -> Row MLP forward+backward with the
overlapped backward and with blocking collectives, and the collectives alone.

A thin wrapper over ``tplayers bench`` (tplayers/bench/ holds the code); every option of
``tplayers bench`` works here, e.g.::

    python benchmarks/overlap.py --shape comm-heavy --iters 200 --json
    python benchmarks/overlap.py --shape comm-heavy --sequence-parallel --plot overlap.png
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from tplayers.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
