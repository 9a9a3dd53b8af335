"""`python -m mha stats FILE --model FOLDER`: per-row statistics of every head along one long
text (the sink mass, the entropy, ...), from ``model.head_statistics`` (no attention map is
kept), written to NetCDF with dims (layer, head, position), and optionally drawn with
:func:`mha.viz.long_context_figure`.

The file is read as one text and tokenized whole (the model's special tokens once, at its
start and end). A text that fits in the model's positions (or ``--window``) runs as one
forward. A longer one is cut into consecutive windows of that many tokens, each its own
forward and its own context: in window w the first key is the window's first token (the
"first" key set, the sink), and distances count within the window.
"""
from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import numpy as np

try:
    import xarray as xr
except ImportError:
    raise ImportError("xarray is not installed (the command writes NetCDF with it): pip install "
                      "\".[corpus]\" in mha's source folder") from None

from ._command import CommandError, run_command

__all__ = ["main", "statistics_dataset", "STATS", "KEY_SETS"]

#: the statistics of ``model.head_statistics``, all computed by default
STATS = ("entropy", "max", "argmax", "self", "prev", "next", "distance")
#: the built-in key sets; each gives the statistic "mass:<name>"
KEY_SETS = ("first", "special", "punctuation")

# the variables' long_name in the NetCDF file: what each is, with its formula (P = the row's
# weights, i the query's position, j a key's)
_DEFINITIONS = {
    "entropy": "entropy of the row, -sum_j P_ij log P_ij (nats)",
    "max": "largest weight of the row, max_j P_ij",
    "argmax": "position in the file of the key with the largest weight (the first on a tie)",
    "self": "weight on the query itself, P_ii",
    "prev": "weight on the previous token, P_i(i-1)",
    "next": "weight on the next token, P_i(i+1)",
    "distance": "mean attention distance, sum_j P_ij |i - j| (tokens)",
    "mass:first": "sink mass: weight on the first token of the window, P_i0",
    "mass:special": "weight on the special tokens ([CLS], [SEP], <s>, ...)",
    "mass:punctuation": "weight on the punctuation tokens",
}


def _names(value: str, allowed: tuple[str, ...], option: str) -> list[str]:
    names = [v.strip() for v in value.split(",") if v.strip()]
    unknown = [v for v in names if v not in allowed]
    if unknown or not names:
        raise CommandError(f"{option}: unknown {', '.join(map(repr, unknown)) or 'empty list'}; "
                            f"choose from {','.join(allowed)}")
    return list(dict.fromkeys(names))


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m mha stats",
        description="Per-row attention statistics of every head along one long text (sink "
                    "mass, entropy, largest weight, weight on itself / the previous / the next "
                    "token, mean distance), computed in the attention kernel without the "
                    "attention maps. Writes a NetCDF dataset (layer, head, position).",
        epilog="Read the result with xarray.open_dataset(OUT). A text longer than the model's "
               "positions runs as consecutive windows, each its own context.")
    parser.add_argument("file", metavar="FILE", help="a UTF-8 text file, read as one text")
    parser.add_argument("--model", metavar="FOLDER", required=True,
                        help="a Hugging Face model folder (config.json, model.safetensors, "
                             "tokenizer.json), or 'minilm'")
    parser.add_argument("--stats", metavar="NAMES", default=",".join(STATS),
                        help=f"comma-separated, from {','.join(STATS)} (default: all)")
    parser.add_argument("--key-sets", metavar="NAMES", default="first",
                        help=f"comma-separated, from {','.join(KEY_SETS)}: the weight on each set "
                             "of keys, 'mass:NAME' (default: first, the sink mass)")
    parser.add_argument("--max-tokens", metavar="N", type=int, default=None,
                        help="read at most the first N tokens (default: the whole file)")
    parser.add_argument("--window", metavar="N", type=int, default=None,
                        help="tokens per forward (default and most: the model's positions)")
    parser.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    parser.add_argument("--out", metavar="OUT.nc", default=None,
                        help="the NetCDF file to write (default: FILE's name with .nc, here)")
    parser.add_argument("--figure", metavar="OUT.png", default=None,
                        help="also draw the sink mass and the entropy of every head, one row per "
                             "layer (mha.viz.long_context_figure)")
    parser.add_argument("--smooth", metavar="N", type=int, default=None,
                        help="the figure's moving mean, in positions (default: tokens / 256, "
                             "at least 1)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    return parser


def _writable(path: Path, option: str, suffixes: tuple[str, ...]) -> Path:
    if path.suffix not in suffixes:
        raise CommandError(f"{option} {path}: expected a file name ending in "
                            + " or ".join(suffixes))
    folder = path.parent
    if not folder.is_dir() or not os.access(folder, os.W_OK):
        raise CommandError(f"{option} {path}: cannot write to the folder {str(folder)!r}")
    return path


def _tokenize(model, text: str, max_tokens: int | None) -> tuple[np.ndarray, list[str]]:
    """The whole text's ids and tokens (the model's special tokens once), cut at max_tokens."""
    from ..models import Tokenizer

    if model.tokenizer is None or model.folder is None:
        raise CommandError(f"the model {model.name!r} has no tokenizer")
    tokenized = Tokenizer.from_folder(model.folder)(text)        # no length limit: windows
    ids, tokens = tokenized.ids, tokenized.tokens
    if max_tokens is not None:
        ids, tokens = ids[:max_tokens], tokens[:max_tokens]
    return np.asarray(ids, dtype=np.int64), list(tokens)


def statistics_dataset(model, ids, *, stats=STATS, key_sets=("first",), window=None,
                       tokens=None, progress=False):
    """Run ``model.head_statistics`` along ``ids`` window by window -> an xarray Dataset.

    Parameters
    ----------
    model : mha.models.TransformerModel
        The model.
    ids : array_like of int, shape (n,)
        The text's token ids.
    stats : sequence of str
        The statistics asked of ``head_statistics``.
    key_sets : sequence of str
        Built-in key sets ("first", "special", "punctuation"); each gives "mass:<name>".
    window : int, optional
        Tokens per forward (default and most: ``model.config.max_positions``).
    tokens : sequence of str, optional
        The tokens of ``ids``, kept as the coordinate ``token``.
    progress : bool
        A progress bar (tqdm, in tokens) when there are several windows.

    Returns
    -------
    xarray.Dataset
        One variable per statistic, dims (layer, head, position): float in the model's dtype,
        "argmax" int64 as a position in ``ids``. Coordinates layer, head, position, window
        (which forward each position was in) and token. Attributes: tokens, windows,
        window_tokens, seconds (the forwards' wall time).
    """
    from tqdm.auto import tqdm

    ids = np.asarray(ids, dtype=np.int64)
    n = len(ids)
    size = model.config.max_positions if window is None else min(window, model.config.max_positions)
    starts = list(range(0, n, size))
    columns: dict[str, np.ndarray] = {}
    seconds = 0.0
    with tqdm(total=n, unit="token", disable=not progress or len(starts) < 2,
              leave=False) as bar:
        for start in starts:
            stop = min(start + size, n)
            begin = time.perf_counter()
            result = model.head_statistics(ids[start:stop], stats=list(stats),
                                           key_sets=list(key_sets))
            seconds += time.perf_counter() - begin
            for name, values in result.items():
                if name not in columns:
                    columns[name] = np.empty(values.shape[:-1] + (n,), dtype=values.dtype)
                if name == "argmax":                     # a key of the window -> of the text
                    values = np.where(values >= 0, values + start, values)
                columns[name][..., start:stop] = values
            bar.update(stop - start)
    dims = ("layer", "head", "position")
    data = {name: xr.Variable(dims, v, attrs={"long_name": _DEFINITIONS.get(name, name)})
            for name, v in columns.items()}
    coords = {"layer": np.arange(model.n_layers), "head": np.arange(model.n_heads),
              "position": np.arange(n), "window": ("position", np.arange(n) // size)}
    if tokens is not None:
        coords["token"] = ("position", np.asarray(list(tokens), dtype=str))
    return xr.Dataset(data, coords=coords,
                      attrs={"tokens": n, "windows": len(starts), "window_tokens": size,
                             "seconds": seconds})


def _command(args):
    source = Path(args.file)
    if not source.is_file():
        raise CommandError(f"{args.file}: no such file")
    stats = _names(args.stats, STATS, "--stats")
    key_sets = _names(args.key_sets, KEY_SETS, "--key-sets")
    for option, value in (("--max-tokens", args.max_tokens), ("--window", args.window),
                          ("--smooth", args.smooth)):
        if value is not None and value < 1:
            raise CommandError(f"{option} must be at least 1, got {value}")
    out = _writable(Path(args.out or source.with_suffix(".nc").name), "--out", (".nc",))
    figure = None if args.figure is None else _writable(Path(args.figure), "--figure",
                                                        (".png", ".svg", ".pdf"))
    try:
        text = source.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise CommandError(f"{args.file} is not UTF-8 text: {e}") from None
    from ..models import load

    try:
        model = load(args.model, dtype=args.dtype)
    except (FileNotFoundError, ModuleNotFoundError, NotImplementedError, KeyError, ValueError,
            TypeError) as e:
        raise CommandError(f"cannot load the model {args.model!r}: "
                            f"{' '.join(str(e).split())}") from None
    ids, tokens = _tokenize(model, text, args.max_tokens)
    if len(ids) == 0:
        raise CommandError(f"{args.file} has no tokens")
    try:
        dataset = statistics_dataset(model, ids, stats=stats, key_sets=key_sets,
                                     window=args.window, tokens=tokens, progress=not args.quiet)
    except (TypeError, ValueError) as e:
        raise CommandError(str(e)) from None
    dataset.attrs.update(model=str(args.model), text_file=str(source), stats=",".join(stats),
                         key_sets=",".join(key_sets), dtype=args.dtype)
    try:
        dataset.to_netcdf(out)
    except (ValueError, ImportError) as e:               # no NetCDF engine installed
        raise CommandError(f"cannot write {out}: {' '.join(str(e).split())} (pip install "
                            "netCDF4)") from None
    if figure is not None:
        _draw(dataset, figure, args.smooth)
    return dataset, out, figure


def _draw(dataset, path: Path, smooth: int | None) -> None:
    from ..viz import long_context_figure

    quantities = [q for q in ("mass:first", "entropy") if q in dataset.data_vars]
    if not quantities:
        raise CommandError("--figure draws the sink mass and the entropy: keep 'entropy' in "
                            "--stats or 'first' in --key-sets")
    smooth = max(1, dataset.attrs["tokens"] // 256) if smooth is None else smooth
    name = Path(str(dataset.attrs["model"])).name
    fig = long_context_figure(dataset, quantities, smooth=smooth,
                              title=f"{name} on {Path(dataset.attrs['text_file']).name}: "
                                    f"{dataset.attrs['tokens']:,} tokens, "
                                    f"{dataset.attrs['windows']} window(s)"
                                    + (f", mean over {smooth} positions" if smooth > 1 else ""))
    fig.savefig(path, dpi=100, facecolor="white")


def main(argv=None):
    """Run the command ``python -m mha stats``.

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
    print(f"{a['tokens']:,} tokens in {a['windows']} window(s) of at most {a['window_tokens']:,} "
          f"in {a['seconds']:.1f} s ({a['tokens'] / max(a['seconds'], 1e-9):,.0f} tokens/s)")
    print(f"wrote {out}" + ("" if figure is None else f"\nwrote {figure}"))
