"""`python -m mha tour`: the seeds' key figures, computed on mha's C kernels, in one folder.

    python -m mha tour                      # ./mha-tour/index.html, the embedded MiniLM
    python -m mha tour --out figs --quick   # fewer training epochs: the same files, faster

What it writes (PNGs, one GIF, two HTML pages):

  01_sentence_heads.png     four heads of a real model on seed 000's sentence
  02_layer_grid.png         every head of one layer, seed 000's 3x4 grid
  03_coreference.png        she -> doctor in every layer and head (seed 000's probe)
  04_ambiguity.png          "The man saw the astronomer with a telescope" (seed 004)
  05_head_diversity.png     cosine similarity between the heads of each layer (seed 000)
  06_causal_mask.png        the causal mask and masked attention (seed 001)
  07_concat_projection.png  head outputs -> concatenation -> W_o (seed 000)
  08_training.png           1 vs 4 vs 8 heads on the period-3 task: loss and accuracy (seed 000)
  09_learned_patterns.png   what the 4 heads learned
  10_speed.png              1/4/8/16 heads, batch 16 x 128 tokens x 256 (seed 000)
  11_pruning.png            iterative head pruning until accuracy drops > 1 point (E12.3)
  attention_layers.gif      one head across the layers (seed 004)
  head_view.html            the interactive head view (seed 004), self-contained
  index.html                all of the above, with a sentence each

Progress goes to stderr; the list of files to stdout. Exit status: 0 on success, 2 for a bad
option, an unwritable folder or a model that cannot be loaded (with a one-line message).
"""
from __future__ import annotations

import argparse
import contextlib
import html
import sys
import time
from pathlib import Path

import numpy as np

__all__ = ["main", "run", "FILES"]

#: Every file the tour writes, in the order of index.html.
FILES = (
    "01_sentence_heads.png", "02_layer_grid.png", "03_coreference.png", "04_ambiguity.png",
    "05_head_diversity.png", "06_causal_mask.png", "07_concat_projection.png",
    "08_training.png", "09_learned_patterns.png", "10_speed.png", "11_pruning.png",
    "attention_layers.gif", "head_view.html", "index.html",
)

PATTERN_TEXT = "The cat sat on the mat because it was tired"
GRID_TEXT = "The quick brown fox jumps over the lazy dog"
AMBIGUOUS = ("The man saw the astronomer with a telescope", "telescope", ("man", "astronomer"))


class TourError(Exception):
    """A problem the user can fix (bad folder, missing model): reported in one line."""


class Progress:
    """Step lines on stderr: ``[ 3/11] training 1, 4 and 8 heads ... 12.3 s``."""

    def __init__(self, total, enabled=True, stream=None):
        self.total, self.enabled = total, enabled
        self.stream = stream or sys.stderr
        self.count = 0
        self.start = time.perf_counter()
        self._step_start = None

    def step(self, what):
        self.done()
        self.count += 1
        self._step_start = time.perf_counter()
        self._say(f"[{self.count:2d}/{self.total}] {what} ...")

    def done(self):
        if self._step_start is not None:
            self._say(f"        {time.perf_counter() - self._step_start:.1f} s")
            self._step_start = None

    def _say(self, text):
        if self.enabled:
            print(text, file=self.stream, flush=True)

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
    from . import models
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


def run(out="mha-tour", model="minilm", *, quick=False, threads=None, progress=True):
    """Compute every figure into the folder `out`; returns the list of (file, title, sentence).

    quick: 30 training epochs instead of the seed's 100 and fewer timing repeats (every file
    is still written). threads: threads for the C kernels (default: unchanged). Raises
    TourError for an unwritable folder or a model that cannot be loaded.
    """
    from matplotlib.figure import Figure

    import mha

    from . import analysis, train, viz
    from .bench import median_time
    from .models import probes

    created = not Path(out).exists()
    out = _check_writable(out)
    if threads is not None:
        mha.set_num_threads(threads)
    epochs = 30 if quick else 100
    repeats = 3 if quick else 10
    steps = Progress(10, progress)
    entries = []

    def add(name, title, sentence):
        entries.append((name, title, sentence))

    # --- a real model ---------------------------------------------------------------------
    steps.step(f"loading the model {model!r}")
    try:
        net = _load_model(model)
    except TourError:
        if created and not any(out.iterdir()):
            out.rmdir()                     # leave no empty folder behind
        raise
    L, H = net.n_layers, net.n_heads
    label = _display_name(model)

    steps.step(f"the heads of a sentence ({L} layers x {H} heads)")
    patterns = probes.head_patterns(net, PATTERN_TEXT)
    tokens, attentions = patterns["tokens"], patterns["attentions"]
    heads = list(range(min(4, H)))
    fig = viz.head_grid(attentions, tokens, layer=0, heads=heads, n_cols=2, vmax=1.0,
                        title=f'{label} Attention Heads - Layer 0\n"{PATTERN_TEXT}"',
                        panel_size=4.5)
    _save(fig, out / "01_sentence_heads.png")
    scores = patterns["scores"]
    dominant = patterns["dominant"]
    counts = {name: int((dominant == name).sum()) for name in analysis.PATTERNS}
    names = {"first_token": "first token" + (" ([CLS])" if tokens[0] == "[CLS]" else ""),
             "previous_token": "previous token", "next_token": "next token", "local": "local"}
    summary = ", ".join(f"{n} {names[name]}" for name, n in counts.items() if n)
    pl, ph = np.unravel_index(int(np.argmax(scores["previous_token"])), (L, H))
    add("01_sentence_heads.png", "The heads of a sentence",
        f"Four heads of layer 0 of {label}, each with its own table of weights. By seed 000's "
        f"pattern scores its {L * H} heads are: {summary}. The sharpest positional head, "
        f"layer {pl}, head {ph}, puts {scores['previous_token'][pl, ph]:.0%} of its weight "
        f"on the previous token.")

    grid_layer = (L - 1) // 2
    tokens_grid, att_grid = net.attentions(GRID_TEXT)
    fig = viz.head_grid(att_grid, tokens_grid, layer=grid_layer, n_cols=4, vmax=0.5,
                        title=f'{label} Layer {grid_layer}: All {H} Attention Heads\n"{GRID_TEXT}"')
    _save(fig, out / "02_layer_grid.png")
    add("02_layer_grid.png", f"All {H} heads of layer {grid_layer}",
        "Seed 000's grid of every head of a middle layer (colour capped at 0.5): "
        "different heads, different relationships between the same tokens.")

    steps.step("the coreference probe and an ambiguous sentence")
    coref = probes.coreference_probe(net)
    cl, ch, cw = coref["strongest"]
    fig = Figure(figsize=(max(8.0, 0.8 * H + 2), 0.55 * L + 1.6), layout="compressed")
    viz.heatmap(coref["weights"], _layer_labels(L), _head_labels(H), ax=fig.add_subplot(),
                vmax=None, annot=H <= 16, title=f'she -> doctor in every head\n"{coref["text"]}"',
                xlabel="head", ylabel="")
    _save(fig, out / "03_coreference.png")
    add("03_coreference.png", "Coreference: does she look at doctor?",
        f"The weight from 'she' to 'doctor' in every head; {len(coref['hits'])} heads exceed "
        f"0.1 and the strongest is layer {cl}, head {ch} ({cw:.2f}, against "
        f"{1 / len(coref['words']):.2f} for uniform attention).")

    sentence, word, candidates = AMBIGUOUS
    amb = probes.ambiguity_probe(net, sentence, word, candidates)
    fig = Figure(figsize=(max(12.0, 1.2 * H + 3), 0.45 * L + 2.6), layout="compressed")
    for ax, cand in zip(fig.subplots(1, 2), candidates):
        viz.heatmap(amb["weights"][cand], [f"L{l}" for l in range(L)], _head_labels(H), ax=ax,
                    vmax=0.5, annot=False, title=f"{word} -> {cand}", xlabel="head", ylabel="layer")
    fig.suptitle(f'"{sentence}": which reading does each head support?', fontsize=13,
                 fontweight="bold")
    _save(fig, out / "04_ambiguity.png")
    add("04_ambiguity.png", "An ambiguous sentence",
        "Seed 004: who has the telescope? Attention from 'telescope' to each reading's word: "
        + ", ".join(f"{n} heads prefer '{c}'" for c, n in amb["counts"].items())
        + ", so both readings are represented.")

    steps.step("head diversity per layer")
    layers = list(range(L)) if L <= 6 else sorted({int(round(x)) for x in np.linspace(0, L - 1, 6)})
    fig = viz.similarity_matrices(attentions, layers=layers, n_cols=3, annot=H <= 12)
    _save(fig, out / "05_head_diversity.png")
    sim = analysis.head_similarity(attentions)
    off = ~np.eye(H, dtype=bool)
    mean_sim = [float(sim[l][off].mean()) for l in range(L)]
    most = int(np.argmin(mean_sim))
    add("05_head_diversity.png", "Head diversity",
        f"Pairwise cosine similarity of the heads' attention maps, per layer (green = diverse, "
        f"red = redundant). Layer {most} has the most diverse heads (mean similarity "
        f"{mean_sim[most]:.2f}; the most alike layer: {max(mean_sim):.2f}).")

    steps.step("head view and GIF across layers")
    viz.head_view(amb["attentions"], amb["tokens"], title=sentence, path=out / "head_view.html")
    viz.attention_gif(amb["attentions"], amb["tokens"], head=0, fps=1.5,
                      path=out / "attention_layers.gif")

    # --- the layer itself -----------------------------------------------------------------
    steps.step("causal mask, concatenation and W_o")
    words = ["The", "cat", "sat", "on", "the", "mat"]
    rng = np.random.default_rng(42)
    emb = rng.standard_normal((6, 64)).astype(np.float32)
    layer = mha.MultiHeadAttention(64, 4, seed=42)
    _, masked = layer(emb, causal=True)
    fig = Figure(figsize=(13, 5.2), layout="compressed")
    ax_mask, ax_att = fig.subplots(1, 2)
    viz.mask_heatmap(np.tril(np.ones((6, 6), dtype=bool)), words, ax=ax_mask,
                     title="Causal mask (1 = may attend)")
    viz.heatmap(masked[0], words, ax=ax_att, cmap="YlOrRd", vmax=None,
                title="Masked attention, head 0")
    _save(fig, out / "06_causal_mask.png")
    add("06_causal_mask.png", "The causal mask",
        "Seed 001: a decoder's query i may only see keys j <= i (True = may attend, as in "
        "torch's scaled_dot_product_attention); every weight above the diagonal is exactly 0.")

    small = mha.MultiHeadAttention(8, 4, bias=False, dtype=np.float64, seed=0)
    x = np.random.default_rng(0).standard_normal((3, 8))
    P = small.params
    split = lambda a: a.reshape(3, 4, 2).transpose(1, 0, 2)            # (heads, n, d_head)
    head_out, _ = mha.attention(split(x @ P["W_q"]), split(x @ P["W_k"]), split(x @ P["W_v"]))
    concat = head_out.transpose(1, 0, 2).reshape(3, 8)
    assert np.allclose(concat @ P["W_o"], small(x)[0])
    _save(viz.concat_projection(head_out[:, 0, :], P["W_o"]), out / "07_concat_projection.png")
    add("07_concat_projection.png", "Concatenation and W_o",
        "Seed 000's picture with a real layer's numbers: one token's 4 head outputs (2 each), "
        "side by side, then mixed by W_o so that every output feature draws on every head.")

    # --- training -------------------------------------------------------------------------
    steps.step(f"training 1, 4 and 8 heads on the period-3 task ({epochs} epochs)")
    with _threads(threads or 1):            # tiny matrices: one thread is faster
        results = train.compare_heads((1, 4, 8), epochs=epochs, seed=0, progress=progress)
    figs = train.compare_heads_figures(results)
    _save(figs["summary"], out / "08_training.png")
    _save(figs["patterns"], out / "09_learned_patterns.png")
    accs = ", ".join(f"{h} head{'s' if h > 1 else ''} {r['final_test_accuracy']:.1%}"
                     for h, r in results.items())
    add("08_training.png", "One head vs many",
        f"Seed 000's task, trained on the C backward ({epochs} epochs, Adam): test accuracy "
        f"{accs}, against a ceiling of {train.pattern_ceiling():.1%} (the first two tokens "
        f"of a pattern cannot be predicted). Same parameter count for every head count.")
    add("09_learned_patterns.png", "What the heads learned",
        "The 4-head model's attention on a test sequence: a head that solves the task looks "
        "2 positions back, the second diagonal below the main one.")

    steps.step("speed of 1, 4, 8 and 16 heads")
    xb = np.random.default_rng(0).standard_normal((16, 128, 256)).astype(np.float32)
    times = {}
    for h in (1, 4, 8, 16):
        lay = mha.MultiHeadAttention(256, h, seed=0)
        times[f"{h} Head" + ("s" if h > 1 else "")] = 1e3 * median_time(lambda: lay(xb), repeats)
    fig = viz.speed_bars(times, title="Inference Time on mha's C kernels: Single vs Multi-Head\n"
                                      "(Same parameters, similar speed)")
    _save(fig, out / "10_speed.png")
    add("10_speed.png", "Speed of 1, 4, 8 and 16 heads",
        f"Forward pass with weights, batch 16 x 128 tokens, d_model 256, median of {repeats} "
        f"runs on {mha.get_num_threads()} thread(s): {min(times.values()):.1f} to "
        f"{max(times.values()):.1f} ms. The heads share parameters and arithmetic.")

    steps.step("head importance and pruning (E12.3)")
    test = train.pattern_data(500, seed=2024)
    with _threads(threads or 1):
        prune = train.prune_experiment(model=results[8]["model"], test_data=test)
    _save(train.prune_figures(prune)["pruning"], out / "11_pruning.png")
    add("11_pruning.png", "Pruning heads",
        f"The 8-head model, pruned one head at a time (least important by ablation first): "
        f"{prune['prunable']} of 8 heads can go before accuracy drops by more than one point "
        f"({prune['baseline_accuracy']:.1%} -> {prune['pruned_accuracy']:.1%} with heads "
        f"{prune['surviving_heads'].tolist()} left).")

    steps.step("index.html")
    add("attention_layers.gif", "One head across the layers",
        f"Seed 004's animation: head 0 of every layer of {label} on \"{sentence}\".")
    add("head_view.html", "The interactive head view",
        "BertViz-style, in one offline file: hover a token, click heads, switch layers.")
    _write_index(out, entries, label, quick, steps.elapsed)
    steps.done()
    return entries


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
<p class="meta">The seeds' key figures, computed on mha's C kernels: model {html.escape(label)},
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
        description="Compute the seeds' key figures on mha's C kernels and write them, with an "
                    "index.html that shows each with a sentence, to one folder.",
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
                        help="train for 30 epochs instead of the seed's 100 and time fewer "
                             "repeats: every file is still written, in about half the time")
    parser.add_argument("--threads", metavar="N", type=_positive_int, default=None,
                        help="threads for the C kernels (default: mha's default, all cores "
                             "or OMP_NUM_THREADS, except the tiny training models, which "
                             "run faster on one)")
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
                      progress=not args.quiet)
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
