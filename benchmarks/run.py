"""The benchmark table: `python benchmarks/run.py [--cases abcd] [--json FILE]`.

Same as `python -m mha bench`; see mha/bench.py for the cases and the peers.
"""
import sys

from mha.bench import main

if __name__ == "__main__":
    sys.exit(main())
