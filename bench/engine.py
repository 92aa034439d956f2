"""Engine benchmark: `python bench/engine.py [--quick] [--plot FILE.png]`, the same as `kvseal bench engine …`.

The benchmark lives in kvseal.bench.engine so the installed `kvseal` command can run it; see its docstring.
"""

from __future__ import annotations

import argparse
import sys

from kvseal.bench.engine import main

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="small sizes, for a smoke run (< 30 s)")
    parser.add_argument("--plot", default=None, metavar="FILE.png", help="draw the copy figures (needs matplotlib)")
    args = parser.parse_args()
    sys.exit(main(quick=args.quick, plot=args.plot))
