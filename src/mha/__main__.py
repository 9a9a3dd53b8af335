"""`python -m mha COMMAND`: bench (the benchmark table), tour (every experiment's figures),
corpus (head statistics over a corpus), stats (per-row head statistics along one long text).
The commands live in mha.apps."""
import sys
from typing import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    commands = {
        "bench": "speed and memory against torch and NumPy, measured in one run",
        "tour": "every experiment's figures on the C kernels, as PNGs and an index.html",
        "corpus": "head statistics over a text file, on this machine or a Dask cluster",
        "stats": "sink mass, entropy, ... of every head along one long text, to NetCDF",
    }
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in commands:
        print("usage: python -m mha {bench,tour,corpus,stats} [options]\n")
        for name, what in commands.items():
            print(f"  {name:6s} {what}")
        print("\n`python -m mha COMMAND --help` explains each command's options.")
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    if argv[0] == "bench":
        from .apps.bench import main as command
    elif argv[0] in ("corpus", "stats"):
        try:
            if argv[0] == "corpus":
                from .apps.corpus import main as command
            else:
                from .apps.stats import main as command
        except ImportError as e:                 # dask or xarray missing: say what to install
            print(f"python -m mha {argv[0]}: error: {e}", file=sys.stderr)
            return 2
    else:
        from .apps.tour import main as command
    return command(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
