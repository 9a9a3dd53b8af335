"""`python -m mha tour`: `run` draws every figure of the table into a folder and writes
index.html; `main` is the command line around it."""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from pathlib import Path

from ...checks import positive_int
from .._command import run_command
from .figures import FIGURES, FILES, Tour, TourError
from .page import write_index
from .schedule import draw_all

__all__ = ["main", "run"]


class Progress:
    """One line on stderr per finished step, in the order they finish (figures drawn at once
    finish in any order): ``[ 4/20] 03_coreference.png: Coreference: ... 0.7 s``."""

    def __init__(self, total, enabled=True, stream=None):
        self.total, self.enabled = total, enabled
        self.stream = stream or sys.stderr
        self.count = 0
        self.start = time.perf_counter()

    def report(self, what, seconds):
        self.count += 1
        if self.enabled:
            print(f"[{self.count:2d}/{self.total}] {what} ... {seconds:.1f} s", file=self.stream,
                  flush=True)

    @contextlib.contextmanager
    def step(self, what):
        start = time.perf_counter()
        yield
        self.report(what, time.perf_counter() - start)

    @property
    def elapsed(self):
        return time.perf_counter() - self.start


def _check_writable(out):
    """Create `out` if needed and prove that a file can be written there (TourError if not)."""
    out = Path(out)
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".mha-tour-write-test"
        probe.write_bytes(b"ok")
        probe.unlink()
    except OSError as e:
        reason = e.strerror or str(e)
        raise TourError(f"cannot write to the folder {str(out)!r}: {reason}") from None
    return out


def run(out="mha-tour", model="minilm", *, quick=False, threads=None, progress=True, jobs=1):
    """Compute every figure of `FIGURES` into the folder `out`, then index.html.

    Parameters
    ----------
    out : str or pathlib.Path
        The folder; created if missing (and removed again if the model cannot be loaded).
    model : str
        'minilm' (the embedded all-MiniLM-L6-v2) or a local Hugging Face folder.
    quick : bool
        30 training epochs instead of 100 and fewer timing rounds; every file is still
        written.
    threads : int, optional
        Threads for the C kernels (default: unchanged; the tiny training models run on one).
    progress : bool
        Step lines on stderr (and the training's bars when `jobs` is 1).
    jobs : int
        Processes that draw figures at once: 1 draws them all in this process; more start
        ``jobs - 1`` worker processes beside it (the ``spawn`` way, so a script that calls this
        needs ``if __name__ == "__main__":``). The same files either way.

    Returns
    -------
    list of (str, str, str)
        (file, title, sentence) of every figure, in the order of index.html.

    Raises
    ------
    TourError
        An unwritable folder or a model that cannot be loaded.
    """
    import mha

    created = not Path(out).exists()
    out = _check_writable(out)
    if threads is not None:
        mha.set_num_threads(threads)
    tour = Tour(out, model, quick=quick, threads=threads, progress=progress and jobs == 1)
    steps = Progress(len(FIGURES) + 2, progress)
    try:
        with steps.step(f"loading the model {model!r}"):
            tour.net
    except TourError:
        if created and not any(out.iterdir()):
            out.rmdir()                     # leave no empty folder behind
        raise
    titles = {figure.name: figure.title.format(t=tour) for figure in FIGURES}

    def finished(results):
        for name, sentence, seconds in results:
            sentences[name] = sentence
            steps.report(f"{name}: {titles[name]}", seconds)

    sentences = {}
    draw_all(tour, FIGURES, jobs, finished)
    entries = [(figure.name, titles[figure.name], sentences[figure.name]) for figure in FIGURES]
    with steps.step("index.html"):
        write_index(out, entries, tour.label, quick, steps.elapsed)
    return entries


def _default_jobs():
    """Processes of ``python -m mha tour``: 2 where this process may run on two cores or more
    (a worker trains while this process draws), else 1."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return 2 if (cores or 1) >= 2 else 1


def _parser():
    parser = argparse.ArgumentParser(
        prog="python -m mha tour",
        description="Compute the key figure of each experiment on mha's C kernels and write "
                    "them, with an index.html that shows each with a sentence, to one folder.",
        epilog="Files: " + ", ".join(FILES) + ". Progress is printed to stderr.",
    )
    parser.add_argument("--out", metavar="DIR", default="mha-tour",
                        help="folder to write into; created if missing, files in it are "
                             "overwritten (default: ./mha-tour)")
    parser.add_argument("--model", metavar="NAME_OR_PATH", default="minilm",
                        help="'minilm' (the embedded all-MiniLM-L6-v2, the default), a local "
                             "Hugging Face folder (config.json + model.safetensors + "
                             "tokenizer.json) or a model in the local Hugging Face cache such "
                             "as 'gpt2'; nothing is downloaded")
    parser.add_argument("--quick", action="store_true",
                        help="train for 30 epochs instead of 100 and time fewer repeats: "
                             "every file is still written, in about half the time")
    parser.add_argument("--threads", metavar="N", type=_positive_int, default=None,
                        help="threads for the C kernels (default: mha's default, all cores "
                             "or OMP_NUM_THREADS, except the tiny training models, which "
                             "run faster on one)")
    parser.add_argument("--jobs", metavar="N", type=_positive_int, default=None,
                        help="processes that draw figures at once (default: 2 on a machine "
                             "with two cores or more, else 1: every figure in this process); "
                             "the speed figure is timed with no other figure running")
    parser.add_argument("--quiet", action="store_true",
                        help="no progress on stderr (the list of files is still printed)")
    return parser


def _positive_int(text):
    """argparse's type for --threads and --jobs: checks.positive_int of the option's text."""
    try:
        return positive_int("N", int(text))
    except (TypeError, ValueError):
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None


def main(argv=None):
    """Entry point of `python -m mha tour`; returns the exit status (0 ok, 2 error)."""
    start = time.perf_counter()

    def command(args):
        entries = run(args.out, args.model, quick=args.quick, threads=args.threads,
                      progress=not args.quiet, jobs=args.jobs or _default_jobs())
        return Path(args.out), entries

    def report(result):
        out, entries = result
        print(f"wrote {len(entries) + 1} files to {out} in {time.perf_counter() - start:.0f} s:")
        for name, _, _ in entries:
            print(f"  {out / name}")
        print(f"  {out / 'index.html'}  <- open this one")

    return run_command(_parser(), argv, command, report, errors=(TourError,))
