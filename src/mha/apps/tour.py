"""`python -m mha tour`: the key figure of each experiment, computed on mha's C kernels, in one
folder (docs/experiments.md lists the experiments).

    python -m mha tour                      # ./mha-tour/index.html, the embedded MiniLM
    python -m mha tour --out figs --quick   # fewer training epochs: the same files, faster

What it writes (PNGs, one GIF, two HTML pages):

  01_sentence_heads.png     four heads of layer 0 of a real model on one sentence
  02_layer_grid.png         every head of a middle layer in a grid (3x4 for 12 heads)
  03_coreference.png        the coreference probe: she -> doctor in every layer and head
  04_ambiguity.png          "The man saw the astronomer with a telescope": which reading each
                            head supports (a prepositional-phrase attachment ambiguity)
  05_head_diversity.png     cosine similarity between the heads of each layer
  06_causal_mask.png        the causal mask and masked attention
  07_concat_projection.png  head outputs -> concatenation -> W_o, with a real layer's numbers
  08_training.png           1 vs 4 vs 8 heads on the period-3 task: loss and accuracy
  09_learned_patterns.png   what the 4 heads learned
  10_speed.png              1/4/8/16 heads, batch 16 x 128 tokens x 256, in turns
  11_pruning.png            the head-pruning procedure: the least important head out, one at a
                            time, until accuracy drops > 1 point
  12_beyond_attention.png   raw weights, rollout, attention flow and value norms side by side
  13_value_norms.png        weight against value norm on the special tokens (Kobayashi et al.)
  14_clark_metrics.png      where every head attends (Clark et al.'s statistics)
  15_head_map.png           the heads on a map of their Jensen-Shannon distances
  attention_layers.gif      one head across the layers, one frame per layer
  head_view.html            the interactive head view (BertViz-style), self-contained
  model_view.html           every layer and head at once
  index.html                all of the above, with a sentence each

Progress goes to stderr; the list of files to stdout. Exit status: 0 on success, 2 for a bad
option, an unwritable folder or a model that cannot be loaded (with a one-line message).

The tour is the table `FIGURES`: each entry names a file, its title in index.html and the
function that computes and draws it (from the results the figures share, `Tour`). A new figure
is a function and one entry.

Two processes draw at once (`--jobs`, default 2 on two cores or more): a worker process trains
the small models and draws the figures of the training (the entries of a `group`) while this
one draws the pretrained model's, and takes figures from the end of the table when it is done;
the speed figure (`alone`) is timed last, with no other figure running.
"""
from __future__ import annotations

import argparse
import collections
import concurrent.futures
import contextlib
import functools
import html
import multiprocessing
import os
import signal
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

__all__ = ["main", "run", "FIGURES", "FILES", "Figure", "Tour"]

PATTERN_TEXT = "The cat sat on the mat because it was tired"
GRID_TEXT = "The quick brown fox jumps over the lazy dog"
AMBIGUOUS = ("The man saw the astronomer with a telescope", "telescope", ("man", "astronomer"))


class TourError(Exception):
    """A problem the user can fix (bad folder, missing model): reported in one line."""


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


def _load_model(name):
    from .. import models
    try:
        return models.load(name)
    except (FileNotFoundError, ModuleNotFoundError, KeyError, ValueError, TypeError) as e:
        message = str(e).strip().splitlines()
        raise TourError(f"cannot load the model {name!r}: {' '.join(m.strip() for m in message)}") from None


def _display_name(model):
    name = str(model)
    if name.lower() in ("minilm", "all-minilm-l6-v2"):
        return "MiniLM"
    return Path(name).name or name


@contextlib.contextmanager
def _threads(n):
    """Run the block with the C kernels on n threads (None: unchanged)."""
    import mha

    if n is None:
        yield
        return
    old = mha.get_num_threads()
    mha.set_num_threads(n)
    try:
        yield
    finally:
        mha.set_num_threads(old)


def _save(fig, path):
    fig.savefig(path, dpi=100, facecolor="white")


def _layer_labels(n):
    return [f"Layer {l}" for l in range(n)]


def _head_labels(n):
    return [f"H{h}" for h in range(n)]


def _plural(n, word):
    return f"{n} {word}" + ("" if n == 1 else "s")


class Tour:
    """What the figures share: the settings of the run and the results that several figures
    draw on (the model, its probes, the trained models), each computed once, on first use.

    Parameters
    ----------
    out : pathlib.Path
        The folder the figures are written to.
    model : str
        The model's name or folder (`mha.models.load`).
    quick : bool
        30 training epochs instead of 100, and fewer timing rounds.
    threads : int, optional
        Threads for the C kernels; the tiny training models run on one unless given.
    progress : bool
        tqdm bars while training.
    """

    def __init__(self, out, model, *, quick=False, threads=None, progress=True):
        self.out, self.model_name = Path(out), model
        self.quick, self.threads, self.progress = quick, threads, progress
        self.epochs = 30 if quick else 100
        self.timing_rounds = 2 if quick else 3

    @functools.cached_property
    def net(self):
        return _load_model(self.model_name)

    @property
    def label(self):
        return _display_name(self.model_name)

    @property
    def n_layers(self):
        return self.net.n_layers

    @property
    def n_heads(self):
        return self.net.n_heads

    @property
    def grid_layer(self):
        return (self.n_layers - 1) // 2

    @functools.cached_property
    def patterns(self):
        from ..models import probes
        return probes.head_patterns(self.net, PATTERN_TEXT)

    @functools.cached_property
    def ambiguity(self):
        from ..models import probes
        sentence, word, candidates = AMBIGUOUS
        return probes.ambiguity_probe(self.net, sentence, word, candidates)

    @functools.cached_property
    def training(self):
        from . import training
        with _threads(self.threads or 1):            # tiny matrices: one thread is faster
            return training.compare_heads((1, 4, 8), epochs=self.epochs, seed=0, progress=self.progress)

    @functools.cached_property
    def training_figures(self):
        from . import training_figures
        return training_figures.compare_heads_figures(self.training)


@dataclass(frozen=True)
class Figure:
    """One file of the tour.

    Attributes
    ----------
    name : str
        The file written into the tour's folder.
    title : str
        Its heading in index.html; ``{t.attribute}`` fields are filled from the `Tour`.
    draw : callable
        ``draw(tour, path) -> str``: computes the figure, writes it to `path` and returns the
        sentence index.html shows under the title.
    group : str, optional
        The figures of a group are drawn one after another in one process, in the table's
        order: they share a result too costly to compute twice (the trained models).
    alone : bool
        Drawn after every other figure, with nothing else running: it times the kernels.
    """
    name: str
    title: str
    draw: Callable[[Tour, Path], str]
    group: str | None = None
    alone: bool = False


# ---- the figures, in the order of index.html ------------------------------------------------

def _sentence_heads(t, path):
    from .. import analysis, viz

    tokens, attentions = t.patterns["tokens"], t.patterns["attentions"]
    L, H = t.n_layers, t.n_heads
    fig = viz.head_grid(attentions, tokens, layer=0, heads=list(range(min(4, H))), n_cols=2,
                        vmax=1.0, title=f'{t.label} Attention Heads - Layer 0\n"{PATTERN_TEXT}"',
                        panel_size=4.5)
    _save(fig, path)
    scores, dominant = t.patterns["scores"], t.patterns["dominant"]
    counts = {name: int((dominant == name).sum()) for name in analysis.PATTERNS}
    names = {"first_token": "first token" + (" ([CLS])" if tokens[0] == "[CLS]" else ""),
             "previous_token": "previous token", "next_token": "next token", "local": "local"}
    summary = ", ".join(f"{n} {names[name]}" for name, n in counts.items() if n)
    pl, ph = np.unravel_index(int(np.argmax(scores["previous_token"])), (L, H))
    return (f"Four heads of layer 0 of {t.label}, each with its own table of weights. By their "
            f"positional pattern scores its {L * H} heads are: {summary}. The sharpest "
            f"positional head, layer {pl}, head {ph}, puts "
            f"{scores['previous_token'][pl, ph]:.0%} of its weight on the previous token.")


def _layer_grid(t, path):
    from .. import viz

    tokens, attentions = t.net.attentions(GRID_TEXT)
    fig = viz.head_grid(attentions, tokens, layer=t.grid_layer, n_cols=4, vmax=0.5,
                        title=f'{t.label} Layer {t.grid_layer}: All {t.n_heads} Attention Heads\n'
                              f'"{GRID_TEXT}"')
    _save(fig, path)
    return ("Every head of a middle layer in one grid (colour capped at 0.5): "
            "different heads, different relationships between the same tokens.")


def _coreference(t, path):
    from matplotlib.figure import Figure as MplFigure

    from .. import viz
    from ..models import probes

    L, H = t.n_layers, t.n_heads
    coref = probes.coreference_probe(t.net)
    cl, ch, cw = coref["strongest"]
    fig = MplFigure(figsize=(max(8.0, 0.8 * H + 2), 0.55 * L + 1.6), layout="compressed")
    viz.heatmap(coref["weights"], _layer_labels(L), _head_labels(H), ax=fig.add_subplot(),
                vmax=None, annot=H <= 16, title=f'she -> doctor in every head\n"{coref["text"]}"',
                xlabel="head", ylabel="")
    _save(fig, path)
    return (f"The weight from 'she' to 'doctor' in every head; {len(coref['hits'])} heads exceed "
            f"0.1 and the strongest is layer {cl}, head {ch} ({cw:.2f}, against "
            f"{1 / len(coref['words']):.2f} for uniform attention).")


def _ambiguity(t, path):
    from matplotlib.figure import Figure as MplFigure

    from .. import viz

    sentence, word, candidates = AMBIGUOUS
    L, H = t.n_layers, t.n_heads
    fig = MplFigure(figsize=(max(12.0, 1.2 * H + 3), 0.45 * L + 2.6), layout="compressed")
    for ax, cand in zip(fig.subplots(1, 2), candidates):
        viz.heatmap(t.ambiguity["weights"][cand], [f"L{l}" for l in range(L)], _head_labels(H),
                    ax=ax, vmax=0.5, annot=False, title=f"{word} -> {cand}", xlabel="head",
                    ylabel="layer")
    fig.suptitle(f'"{sentence}": which reading does each head support?', fontsize=13,
                 fontweight="bold")
    _save(fig, path)
    return ("A prepositional-phrase attachment ambiguity: who has the telescope? Attention from "
            "'telescope' to each reading's word: "
            + ", ".join(f"{n} heads prefer '{c}'" for c, n in t.ambiguity["counts"].items())
            + ", so both readings are represented.")


def _head_diversity(t, path):
    from .. import analysis, viz

    attentions, L, H = t.patterns["attentions"], t.n_layers, t.n_heads
    layers = list(range(L)) if L <= 6 else sorted({int(round(x)) for x in np.linspace(0, L - 1, 6)})
    _save(viz.similarity_matrices(attentions, layers=layers, n_cols=3, annot=H <= 12), path)
    sim = analysis.head_similarity(attentions)
    off = ~np.eye(H, dtype=bool)
    mean_sim = [float(sim[l][off].mean()) for l in range(L)]
    most = int(np.argmin(mean_sim))
    return (f"Pairwise cosine similarity of the heads' attention maps, per layer (green = diverse, "
            f"red = redundant). Layer {most} has the most diverse heads (mean similarity "
            f"{mean_sim[most]:.2f}; the most alike layer: {max(mean_sim):.2f}).")


def _causal_mask(t, path):
    from matplotlib.figure import Figure as MplFigure

    import mha

    from .. import viz

    words = ["The", "cat", "sat", "on", "the", "mat"]
    emb = np.random.default_rng(42).standard_normal((6, 64)).astype(np.float32)
    _, masked = mha.MultiHeadAttention(64, 4, seed=42)(emb, causal=True)
    fig = MplFigure(figsize=(13, 5.2), layout="compressed")
    ax_mask, ax_att = fig.subplots(1, 2)
    viz.mask_heatmap(np.tril(np.ones((6, 6), dtype=bool)), words, ax=ax_mask,
                     title="Causal mask (1 = may attend)")
    viz.heatmap(masked[0], words, ax=ax_att, cmap="YlOrRd", vmax=None, title="Masked attention, head 0")
    _save(fig, path)
    return ("Causal masking: a decoder's query i may only see keys j <= i (True = may attend, as in "
            "torch's scaled_dot_product_attention); every weight above the diagonal is exactly 0.")


def _concat_projection(t, path):
    import mha

    from .. import viz

    small = mha.MultiHeadAttention(8, 4, bias=False, dtype=np.float64, seed=0)
    x = np.random.default_rng(0).standard_normal((3, 8))
    P = small.params
    split = lambda a: a.reshape(3, 4, 2).transpose(1, 0, 2)            # (heads, n, d_head)
    head_out, _ = mha.attention(split(x @ P["W_q"]), split(x @ P["W_k"]), split(x @ P["W_v"]))
    concat = head_out.transpose(1, 0, 2).reshape(3, 8)
    assert np.allclose(concat @ P["W_o"], small(x)[0])
    _save(viz.concat_projection(head_out[:, 0, :], P["W_o"]), path)
    return ("The concatenation and output projection with a real layer's numbers: one token's "
            "4 head outputs (2 each), side by side, then mixed by W_o so that every output "
            "feature draws on every head.")


def _training(t, path):
    from .. import train

    _save(t.training_figures["summary"], path)
    accs = ", ".join(f"{_plural(h, 'head')} {r['final_test_accuracy']:.1%}" for h, r in t.training.items())
    return (f"The period-3 task, trained on the C backward ({t.epochs} epochs, Adam): test accuracy "
            f"{accs}, against an expected ceiling of {train.pattern_ceiling():.1%} (the first two "
            f"tokens of a pattern cannot be predicted). Same parameter count for every head count.")


def _learned_patterns(t, path):
    from . import training

    _save(t.training_figures["patterns"], path)
    w = t.training[4]["attention"]                                     # (4, n, n), one sequence
    n = w.shape[-1]
    i, j = np.arange(n)[:, None], np.arange(n)[None, :]
    copies = (i - j >= 2) & ((i - j) % 3 == 2)                         # keys holding the next token
    mass = training.period_mass(w)                                        # (4,)
    first = (w * (copies & (j < 3))).sum() / max((w * copies).sum(), 1e-12)
    shares = ", ".join(f"head {h} {mass[h]:.0%}" for h in range(len(mass)))
    return (f"The 4-head model's attention on a test sequence. The next token repeats the tokens "
            f"2, 5, 8, ... positions back; the share of each head's weight on those copies "
            f"(from position 2 on): {shares}. {first:.0%} of the weight on copies goes to the "
            f"copy in the first period (the first three columns), not only to the key 2 back.")


def _speed(t, path):
    import mha

    from .. import viz
    from .timing import quartiles, time_in_turns

    xb = np.random.default_rng(0).standard_normal((16, 128, 256)).astype(np.float32)
    layers = {_plural(h, "Head"): mha.MultiHeadAttention(256, h, seed=0)
              for h in (1, 4, 8, 16)}
    fns = {label: (lambda lay=lay: lay(xb)) for label, lay in layers.items()}
    # one untimed call opens each turn and no settling time follows: nothing here spins after
    # a call for long (mha's pool threads spin 0.1 ms, then sleep; no NumPy product runs)
    times = {label: [1e3 * s for s in ts]
             for label, ts in time_in_turns(fns, t.timing_rounds, settle=0, measure=0.05).items()}
    medians = {label: quartiles(ts)[1] for label, ts in times.items()}
    fig = viz.speed_bars(medians, title="Inference Time on mha's C kernels: 1 to 16 Heads\n"
                                        "(same parameters, same arithmetic)")
    _save(fig, path)
    spread = ", ".join(f"{label} {q2:.1f} ms ({q1:.1f}-{q3:.1f})"
                       for label, (q1, q2, q3) in ((l, quartiles(ts)) for l, ts in times.items()))
    return (f"Forward pass with weights, batch 16 x 128 tokens, d_model 256, on "
            f"{mha.get_num_threads()} thread(s); the layers took turns for {t.timing_rounds} rounds, "
            f"median (quartiles) of every timed call: {spread}. The heads share parameters and "
            f"arithmetic; more heads mean smaller products and more weights to return.")


def _pruning(t, path):
    from .. import train, viz
    from . import training

    test = train.pattern_data(500, seed=2024)
    with _threads(t.threads or 1):
        prune = training.prune_experiment(model=t.training[8]["model"], test_data=test)
    _save(viz.pruning_plot(prune["curve"]), path)   # prune_figures' "pruning"
    return (f"The 8-head model, pruned one head at a time (least important by ablation first): "
            f"{prune['prunable']} of 8 heads can go before accuracy drops by more than one point "
            f"({prune['baseline_accuracy']:.1%} -> {prune['pruned_accuracy']:.1%} with heads "
            f"{prune['surviving_heads'].tolist()} left).")


def _attention_gif(t, path):
    from .. import viz

    viz.attention_gif(t.ambiguity["attentions"], t.ambiguity["tokens"], head=0, fps=1.5, path=path)
    return f"Head 0 of every layer of {t.label} on \"{AMBIGUOUS[0]}\", one layer per frame."


def _head_view(t, path):
    from .. import viz

    viz.head_view(t.ambiguity["attentions"], t.ambiguity["tokens"], title=AMBIGUOUS[0], path=path)
    return "BertViz-style, in one offline file: hover a token, click heads, switch layers."


def _beyond_attention(t, path):
    from .. import viz

    _save(viz.beyond_attention_figure(t.net, viz.BEYOND_TEXT), path)
    return ("Raw weights show one layer; rollout (Abnar & Zuidema 2020) multiplies the layers' "
            "weights with the residual added, attention flow takes the maximum flow through them, "
            "and value norms (Kobayashi et al. 2020) weigh each weight by the length of the vector "
            "it moves.")


def _value_norms(t, path):
    from .. import viz

    shares = viz.special_token_shares(t.net, viz.CLARK_TEXTS)
    _save(viz.kobayashi_figure(t.net, viz.CLARK_TEXTS, shares=shares), path)
    overall = shares["overall"]
    weight, norm = overall["weight"], overall["norm"]
    verdict = ("much weight, little effect, as Kobayashi et al. found for BERT" if weight > 2 * norm
               else "not the gap Kobayashi et al. found for BERT")
    return (f"Over {len(viz.CLARK_TEXTS)} sentences, {t.label}'s special tokens ([CLS]/[SEP] or "
            f"their kin such as <s>, </s>) get {weight:.0%} of the attention weight and "
            f"{norm:.0%} of the value norm ({overall['norm_summed']:.0%} of the norm summed over "
            f"heads): {verdict}.")


def _clark_metrics(t, path):
    from .. import viz

    _save(viz.clark_metrics_figure(t.net, viz.CLARK_TEXTS), path)
    return ("Clark et al. (2019)'s statistics of every head over a few sentences: where its "
            "attention goes ([CLS], [SEP], punctuation, the neighbours) and how spread it is.")


def _head_map(t, path):
    from .. import viz

    _save(viz.head_map_figure(t.net, viz.CLARK_TEXTS), path)
    return ("Every head placed so that distances match the Jensen-Shannon distances between "
            "their attention (classical MDS, as Clark et al. 2019): heads that attend alike sit "
            "together.")


def _model_view(t, path):
    from .. import viz

    tokens, attentions = t.net.attentions(viz.BEYOND_TEXT)
    viz.model_view(attentions, tokens, title=viz.BEYOND_TEXT, path=path)
    return "Every layer and head at once (BertViz's model view): click a thumbnail to open it."


#: The tour: one entry per file, in the order of index.html. Adding a figure is adding an entry.
FIGURES = (
    Figure("01_sentence_heads.png", "The heads of a sentence", _sentence_heads),
    Figure("02_layer_grid.png", "All {t.n_heads} heads of layer {t.grid_layer}", _layer_grid),
    Figure("03_coreference.png", "Coreference: does she look at doctor?", _coreference),
    Figure("04_ambiguity.png", "An ambiguous sentence", _ambiguity),
    Figure("05_head_diversity.png", "Head diversity", _head_diversity),
    Figure("06_causal_mask.png", "The causal mask", _causal_mask),
    Figure("07_concat_projection.png", "Concatenation and W_o", _concat_projection),
    Figure("08_training.png", "One head vs many", _training, group="training"),
    Figure("09_learned_patterns.png", "What the heads learned", _learned_patterns, group="training"),
    Figure("10_speed.png", "Speed of 1, 4, 8 and 16 heads", _speed, alone=True),
    Figure("11_pruning.png", "Pruning heads", _pruning, group="training"),
    Figure("12_beyond_attention.png", "Beyond raw attention: rollout, flow, value norms",
           _beyond_attention),
    Figure("13_value_norms.png", "Weight is not effect: value norms", _value_norms),
    Figure("14_clark_metrics.png", "What every head attends to", _clark_metrics),
    Figure("15_head_map.png", "A map of the heads", _head_map),
    Figure("attention_layers.gif", "One head across the layers", _attention_gif),
    Figure("head_view.html", "The interactive head view", _head_view),
    Figure("model_view.html", "The interactive model view", _model_view),
)

#: Every file the tour writes, in the order of index.html.
FILES = tuple(f.name for f in FIGURES) + ("index.html",)


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
    _draw_all(tour, FIGURES, jobs, finished)
    entries = [(figure.name, titles[figure.name], sentences[figure.name]) for figure in FIGURES]
    with steps.step("index.html"):
        _write_index(out, entries, tour.label, quick, steps.elapsed)
    return entries


def _draw(tour, figures, names):
    """Draw the figures `names` (of the table `figures`) one after another:
    [(name, sentence, seconds)]."""
    by_name = {figure.name: figure for figure in figures}
    results = []
    for name in names:
        start = time.perf_counter()
        sentence = by_name[name].draw(tour, tour.out / name)
        results.append((name, sentence, time.perf_counter() - start))
    return results


def _draw_all(tour, figures, jobs, finished):
    """Draw every figure of the table `figures`, calling ``finished([(name, sentence, seconds),
    ...])`` as they finish.

    With ``jobs > 1``, ``jobs - 1`` worker processes start on the groups (the training: a
    quarter of the work, and it needs no model) while this process draws the other figures
    from the front of the table; a worker with no group left takes the next figure from the
    back. The figures that run alone come last, in this process, once the workers are gone.
    """
    groups = {}
    for figure in figures:
        if figure.group is not None:
            groups.setdefault(figure.group, []).append(figure.name)
    tasks = collections.deque(tuple(names) for names in groups.values())
    tasks += [(f.name,) for f in figures if f.group is None and not f.alone]
    alone = [(f.name,) for f in figures if f.group is None and f.alone]
    workers = min(jobs - 1, len(tasks) - 1)
    if workers < 1:
        for task in list(tasks) + alone:
            finished(_draw(tour, figures, task))
        return
    executor = ProcessPoolExecutor(workers, multiprocessing.get_context("spawn"), _start_worker,
                                   (figures, str(tour.out.resolve()), tour.model_name, tour.quick,
                                    tour.threads))
    running = []

    def collect(wait):
        if wait and running:
            concurrent.futures.wait(running, return_when=concurrent.futures.FIRST_COMPLETED)
        for future in [f for f in running if f.done()]:
            running.remove(future)
            finished(future.result())           # a worker's exception is raised here

    try:
        for _ in range(len(groups)):            # the groups first, to the workers
            running.append(executor.submit(_draw_in_worker, tasks.popleft()))
        while tasks or running:
            collect(wait=not tasks)
            while tasks and len(running) < workers:
                running.append(executor.submit(_draw_in_worker, tasks.pop()))
            if tasks:
                finished(_draw(tour, figures, tasks.popleft()))
    except BaseException:                       # a figure failed or Ctrl-C: stop the workers now
        _stop_workers(executor)
        raise
    finally:
        executor.shutdown(wait=True, cancel_futures=True)
    for task in alone:
        finished(_draw(tour, figures, task))


def _default_jobs():
    """Processes of ``python -m mha tour``: 2 where this process may run on two cores or more
    (a worker trains while this process draws), else 1."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return 2 if (cores or 1) >= 2 else 1


_worker = None                              # a worker process's (Tour, figures)


def _start_worker(figures, out, model, quick, threads):
    """Initializer of a worker process: its own `Tour`, which loads the model only if a figure
    needs it. Ctrl-C reaches the whole process group: the parent stops the workers."""
    global _worker
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if threads is not None:
        import mha

        mha.set_num_threads(threads)
    _worker = (Tour(out, model, quick=quick, threads=threads, progress=False), figures)


def _draw_in_worker(names):
    return _draw(*_worker, names)


def _stop_workers(executor):
    """End the worker processes at once, abandoning the figures they draw."""
    terminate = getattr(executor, "terminate_workers", None)         # Python 3.14
    if terminate is not None:
        terminate()
        return
    for process in list((getattr(executor, "_processes", None) or {}).values()):
        process.terminate()


def _write_index(out, entries, label, quick, seconds):
    import mha

    cards = []
    for name, title, sentence in entries:
        t, s, n = html.escape(title), html.escape(sentence), html.escape(name)
        if name.endswith(".html"):
            body = (f'<p><a class="button" href="{n}">Open the head view</a></p>'
                    f'<iframe src="{n}" title="{t}" loading="lazy"></iframe>')
        else:
            body = f'<a href="{n}"><img src="{n}" alt="{t}"></a>'
        cards.append(f'<section><h2>{t}</h2><p>{s}</p>{body}'
                     f'<p class="file">{n}</p></section>')
    info = mha.build_info()
    page = f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>mha tour</title>
<style>
body {{ font-family: system-ui, -apple-system, "Segoe UI", sans-serif; margin: 0 auto;
       max-width: 1100px; padding: 1.5em; color: #222; background: #fafafa; }}
h1 {{ margin-bottom: 0.2em; }}
section {{ background: white; border: 1px solid #ddd; border-radius: 8px; padding: 1em 1.2em;
          margin: 1.2em 0; }}
section h2 {{ margin: 0 0 0.3em 0; font-size: 1.2em; }}
img {{ max-width: 100%; height: auto; display: block; margin: 0.6em auto; }}
iframe {{ width: 100%; height: 560px; border: 1px solid #ddd; }}
.file {{ color: #888; font-size: 0.85em; margin: 0; }}
.meta {{ color: #666; }}
a.button {{ background: #3498db; color: white; padding: 0.3em 0.8em; border-radius: 4px;
           text-decoration: none; }}
</style></head><body>
<h1>mha tour</h1>
<p class="meta">The key figure of each experiment, computed on mha's C kernels: model {html.escape(label)},
{'quick mode (30 training epochs), ' if quick else ''}{seconds:.0f} s on
{info['num_threads']} thread(s) ({html.escape(info['simd'])}). Regenerate with
<code>python -m mha tour</code>; the notebooks in <code>notebooks/</code> explain each figure.</p>
{chr(10).join(cards)}
</body></html>
"""
    (Path(out) / "index.html").write_text(page, encoding="utf-8")


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
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def main(argv=None):
    """Entry point of `python -m mha tour`; returns the exit status (0 ok, 2 error)."""
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:                 # --help (0) or a bad option (2, message printed)
        return int(e.code or 0)
    start = time.perf_counter()
    try:
        entries = run(args.out, args.model, quick=args.quick, threads=args.threads,
                      progress=not args.quiet, jobs=args.jobs or _default_jobs())
    except TourError as e:
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{parser.prog}: interrupted", file=sys.stderr)
        return 130
    out = Path(args.out)
    print(f"wrote {len(entries) + 1} files to {out} in {time.perf_counter() - start:.0f} s:")
    for name, _, _ in entries:
        print(f"  {out / name}")
    print(f"  {out / 'index.html'}  <- open this one")
    return 0


if __name__ == "__main__":
    sys.exit(main())
