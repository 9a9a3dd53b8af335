"""`python -m mha corpus FILE`: head statistics over a text file (one text per line) with
:func:`mha.corpus.head_statistics`, on this machine or a Dask cluster, written to NetCDF with a
PNG of layer x head heatmaps beside it."""
from __future__ import annotations

import argparse
import os
from pathlib import Path

from ..corpus import CorpusError, head_statistics, statistics_figure
from ._command import CommandError, run_command

__all__ = ["main"]


def _parser():
    parser = argparse.ArgumentParser(
        prog="python -m mha corpus",
        description="Per-head attention statistics (Clark et al. 2019; value-norm shares, "
                    "Kobayashi et al. 2020) over a corpus, on this machine or a Dask cluster. "
                    "Writes a NetCDF dataset and a PNG of layer x head heatmaps beside it.",
        epilog="Progress goes to stderr. Read the result with xarray.open_dataset(OUT).")
    parser.add_argument("file", metavar="FILE", help="UTF-8 text file, one text per line")
    parser.add_argument("--model", metavar="NAME_OR_FOLDER", default="minilm",
                        help="'minilm' (the embedded all-MiniLM-L6-v2, the default) or a local "
                             "Hugging Face folder; on a cluster every worker loads it itself")
    parser.add_argument("--scheduler", metavar="ADDRESS", default=None,
                        help="a dask.distributed scheduler, e.g. tcp://10.0.0.5:8786 (default: "
                             "Dask's threads on this machine)")
    parser.add_argument("--out", metavar="FILE.nc", default="stats.nc",
                        help="the NetCDF file to write (default: stats.nc); the figure is "
                             "written beside it with the suffix .png")
    parser.add_argument("--batch-size", metavar="N", type=int, default=16,
                        help="most texts per forward pass, after sorting by length (default: 16)")
    parser.add_argument("--batch-tokens", metavar="N", type=int, default=512,
                        help="most padded positions (texts x the longest) per forward pass "
                             "(default: 512)")
    parser.add_argument("--truncation", action="store_true",
                        help="cut texts longer than the model's positions (and count them) "
                             "instead of stopping")
    parser.add_argument("--skip-empty", action="store_true",
                        help="skip empty lines (and count them) instead of stopping")
    parser.add_argument("--no-norms", action="store_true",
                        help="leave out the value-norm shares norm_cls and norm_sep (a few %% faster)")
    parser.add_argument("--convention", choices=("mha", "clark"), default="mha",
                        help="mha: token-weighted means (default); clark: Clark et al.'s "
                             "formulas, each text's mean then the mean over texts")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    return parser


def _connect(address):
    try:
        from distributed import Client
    except ImportError:
        raise CommandError('--scheduler needs dask.distributed: pip install ".[corpus]" in '
                            "mha's source folder") from None
    try:
        return Client(address, timeout="10s")
    except (OSError, TimeoutError, ValueError) as e:
        raise CommandError(f"cannot reach the Dask scheduler {address!r}: "
                            f"{' '.join(str(e).split())}") from None


def _command(args):
    source = Path(args.file)
    if not source.is_file():
        raise CommandError(f"{args.file}: no such file")
    for option, value in (("--batch-size", args.batch_size), ("--batch-tokens", args.batch_tokens)):
        if value < 1:
            raise CommandError(f"{option} must be at least 1, got {value}")
    out = Path(args.out)
    if out.suffix != ".nc":
        raise CommandError(f"--out {args.out}: expected a file name ending in .nc")
    if not out.parent.is_dir() or not os.access(out.parent, os.W_OK):
        raise CommandError(f"--out {args.out}: cannot write to the folder {str(out.parent)!r}")
    from ..models import load

    try:
        model = load(args.model)
    except (FileNotFoundError, ModuleNotFoundError, NotImplementedError, KeyError, ValueError,
            TypeError) as e:
        raise CommandError(f"cannot load the model {args.model!r}: "
                            f"{' '.join(str(e).split())}") from None
    client = _connect(args.scheduler) if args.scheduler else None
    try:
        dataset = head_statistics(model, source, batch_size=args.batch_size,
                                  batch_tokens=args.batch_tokens, client=client,
                                  progress=not args.quiet, truncation=args.truncation,
                                  skip_empty=args.skip_empty, norms=not args.no_norms,
                                  convention=args.convention)
    except (CorpusError, TypeError, UnicodeDecodeError) as e:
        raise CommandError(str(e)) from None
    except ValueError as e:
        raise CommandError(str(e)) from None
    finally:
        if client is not None:
            client.close()
    try:
        dataset.to_netcdf(out)
    except (ValueError, ImportError) as e:               # no NetCDF engine installed
        raise CommandError(f"cannot write {out}: {' '.join(str(e).split())} (pip install "
                            "netCDF4)") from None
    figure = out.with_suffix(".png")
    statistics_figure(dataset).savefig(figure, dpi=100, facecolor="white")
    return dataset, out, figure


def main(argv=None):
    """Run the command ``python -m mha corpus``.

    Parameters
    ----------
    argv : list of str, optional
        The command's arguments (default: ``sys.argv[1:]``).

    Returns
    -------
    int
        The exit status: 0 on success (or --help), 2 on a usage or input error, 130 when
        interrupted.
    """
    return run_command(_parser(), argv, _command, _report)


def _report(result):
    """Print what the command did: its counts, speed and the files written."""
    dataset, out, figure = result
    a = dataset.attrs
    print(f"{a['texts']:,} texts, {a['tokens']:,} tokens in {a['seconds']:.1f} s "
          f"({a['tokens'] / max(a['seconds'], 1e-9):,.0f} tokens/s; {a['scheduler']})")
    print(f"wrote {out}\nwrote {figure}")
