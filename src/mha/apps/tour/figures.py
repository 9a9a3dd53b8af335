"""The tour's figures: what they share (`Tour`: the model, its probes, the trained models,
each computed once), one function per figure, and the table `FIGURES` that lists them in the
order of index.html. A new figure is a function and one entry."""
from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

import mha

__all__ = ["FIGURES", "FILES", "Figure", "Tour", "TourError"]

PATTERN_TEXT = "The cat sat on the mat because it was tired"
GRID_TEXT = "The quick brown fox jumps over the lazy dog"
AMBIGUOUS = ("The man saw the astronomer with a telescope", "telescope", ("man", "astronomer"))


class TourError(Exception):
    """A problem the user can fix (bad folder, missing model): reported in one line."""


def _load_model(name):
    from ... import models
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
        from ...analysis import probes
        return probes.head_patterns(self.net, PATTERN_TEXT)

    @functools.cached_property
    def ambiguity(self):
        from ...analysis import probes
        sentence, word, candidates = AMBIGUOUS
        return probes.ambiguity_probe(self.net, sentence, word, candidates)

    @functools.cached_property
    def training(self):
        from .. import training
        with mha.num_threads(self.threads or 1):       # tiny matrices: one thread is faster
            return training.compare_heads((1, 4, 8), epochs=self.epochs, seed=0, progress=self.progress)

    @functools.cached_property
    def training_figures(self):
        from .. import training_figures
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
    from ... import analysis, viz

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
    from ... import viz

    tokens, attentions = t.net.attentions(GRID_TEXT)
    fig = viz.head_grid(attentions, tokens, layer=t.grid_layer, n_cols=4, vmax=0.5,
                        title=f'{t.label} Layer {t.grid_layer}: All {t.n_heads} Attention Heads\n'
                              f'"{GRID_TEXT}"')
    _save(fig, path)
    return ("Every head of a middle layer in one grid (colour capped at 0.5): "
            "different heads, different relationships between the same tokens.")


def _coreference(t, path):
    from matplotlib.figure import Figure as MplFigure

    from ... import viz
    from ...analysis import probes

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

    from ... import viz

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
    from ... import analysis, viz

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

    from ... import viz

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
    from ... import viz

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
    from ... import train

    _save(t.training_figures["summary"], path)
    accs = ", ".join(f"{_plural(h, 'head')} {r['final_test_accuracy']:.1%}" for h, r in t.training.items())
    return (f"The period-3 task, trained on the C backward ({t.epochs} epochs, Adam): test accuracy "
            f"{accs}, against an expected ceiling of {train.pattern_ceiling():.1%} (the first two "
            f"tokens of a pattern cannot be predicted). Same parameter count for every head count.")


def _learned_patterns(t, path):
    from .. import training

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
    from ... import viz
    from ..timing import quartiles, time_in_turns

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
    from ... import train, viz
    from .. import training

    test = train.pattern_data(500, seed=2024)
    with mha.num_threads(t.threads or 1):
        prune = training.prune_experiment(model=t.training[8]["model"], test_data=test)
    _save(viz.pruning_plot(prune["curve"]), path)   # prune_figures' "pruning"
    return (f"The 8-head model, pruned one head at a time (least important by ablation first): "
            f"{prune['prunable']} of 8 heads can go before accuracy drops by more than one point "
            f"({prune['baseline_accuracy']:.1%} -> {prune['pruned_accuracy']:.1%} with heads "
            f"{prune['surviving_heads'].tolist()} left).")


def _attention_gif(t, path):
    from ... import viz

    viz.attention_gif(t.ambiguity["attentions"], t.ambiguity["tokens"], head=0, fps=1.5, path=path)
    return f"Head 0 of every layer of {t.label} on \"{AMBIGUOUS[0]}\", one layer per frame."


def _head_view(t, path):
    from ... import viz

    viz.head_view(t.ambiguity["attentions"], t.ambiguity["tokens"], title=AMBIGUOUS[0], path=path)
    return "BertViz-style, in one offline file: hover a token, click heads, switch layers."


def _beyond_attention(t, path):
    from ... import viz

    _save(viz.beyond_attention_figure(t.net, viz.BEYOND_TEXT), path)
    return ("Raw weights show one layer; rollout (Abnar & Zuidema 2020) multiplies the layers' "
            "weights with the residual added, attention flow takes the maximum flow through them, "
            "and value norms (Kobayashi et al. 2020) weigh each weight by the length of the vector "
            "it moves.")


def _value_norms(t, path):
    from ... import viz

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
    from ... import viz

    _save(viz.clark_metrics_figure(t.net, viz.CLARK_TEXTS), path)
    return ("Clark et al. (2019)'s statistics of every head over a few sentences: where its "
            "attention goes ([CLS], [SEP], punctuation, the neighbours) and how spread it is.")


def _head_map(t, path):
    from ... import viz

    _save(viz.head_map_figure(t.net, viz.CLARK_TEXTS), path)
    return ("Every head placed so that distances match the Jensen-Shannon distances between "
            "their attention (classical MDS, as Clark et al. 2019): heads that attend alike sit "
            "together.")


def _model_view(t, path):
    from ... import viz

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
