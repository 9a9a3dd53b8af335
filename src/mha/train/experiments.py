"""The seeds' training experiments as functions returning plain results (dicts and arrays).

- :func:`compare_heads` -- seed 000 part 7: 1 vs 4 vs 8 heads on the period-3 task
- :func:`parameter_count`, :func:`transformer_parameters`, :func:`parameter_table` -- E12.1
- :func:`heads_sweep` -- E12.2: h in {1, 2, 4, 8, 16} at d_model 256
- :func:`prune_experiment` -- E12.3: ablation, importance ranking, iterative pruning
- :func:`benchmark_epoch` -- one training epoch in mha against the seed's PyTorch model

Each ``*_figures`` function turns a result into matplotlib figures (via :mod:`mha.viz`).
"""
import copy
import time

import numpy as np

from .. import analysis
from .data import pattern_ceiling, pattern_data, pattern_min_loss
from .model import Adam, SimpleAttentionModel, fit

__all__ = [
    "compare_heads", "compare_heads_figures",
    "parameter_count", "transformer_parameters", "parameter_table", "format_table",
    "heads_sweep", "heads_sweep_figures", "offset_profile", "period_mass",
    "prune_experiment", "prune_figures",
    "benchmark_epoch",
]


def _seeds(seed, n):
    """n independent int seeds derived from `seed` (None -> fresh entropy)."""
    return [int(s) for s in np.random.default_rng(seed).integers(0, 2**63, size=n)]


def _datasets(n_train, n_test, seq_len, vocab_size, period, seed):
    train_seed, test_seed, model_seed = _seeds(seed, 3)
    train = pattern_data(n_train, seq_len, vocab_size, period, seed=train_seed)
    test = pattern_data(n_test, seq_len, vocab_size, period, seed=test_seed)
    return train, test, model_seed


def _head_label(h):
    return f"{h} Head" if h == 1 else f"{h} Heads"


def _example(tokens, period):
    """The first sequence whose pattern has `period` distinct tokens (clearest picture)."""
    distinct = [len(set(row[:period].tolist())) for row in tokens]
    return tokens[int(np.argmax(distinct))]


def _train_one(n_heads, train, test, *, d_model, epochs, lr, batch_size, dtype, model_seed,
               progress, seq_len, vocab_size, period=3):
    model = SimpleAttentionModel(vocab_size, d_model, n_heads, seq_len, dtype=dtype,
                                 seed=model_seed)
    history = fit(model, *train, *test, epochs=epochs, lr=lr, batch_size=batch_size,
                  seed=model_seed, progress=progress, desc=_head_label(n_heads))
    example = _example(test[0], period)
    _, weights = model(example)                                        # (H, n, n)
    history.update(model=model, attention=weights, tokens=example.copy(),
                   n_parameters=model.num_parameters())
    return history


# --- seed 000, part 7 ------------------------------------------------------------------------

def compare_heads(head_counts=(1, 4, 8), *, d_model=32, epochs=100, lr=0.005, n_train=500,
                  n_test=100, seq_len=12, vocab_size=5, period=3, batch_size=None,
                  dtype=np.float32, seed=0, progress=True):
    """Seed 000's single-head vs multi-head comparison on the period-3 pattern task.

    Every model sees the same data and starts from the same seed (the seed's
    ``torch.manual_seed(42)`` before each model); full-batch Adam by default.

    Returns {n_heads: history}, history being :func:`fit`'s dict (loss, test_epochs,
    test_accuracy, final_loss, final_test_accuracy, seconds) plus:
        attention: (n_heads, seq_len, seq_len) learned weights on one test sequence (the first
            whose pattern has `period` distinct tokens)
        tokens: that sequence (seq_len,); n_parameters: trainable scalars; model: the model
    """
    train, test, model_seed = _datasets(n_train, n_test, seq_len, vocab_size, period, seed)
    return {int(h): _train_one(int(h), train, test, d_model=d_model, epochs=epochs, lr=lr,
                               batch_size=batch_size, dtype=dtype, model_seed=model_seed,
                               progress=progress, seq_len=seq_len, vocab_size=vocab_size,
                               period=period)
            for h in head_counts}


def compare_heads_figures(results, *, pattern_heads=None):
    """Seed 000's figures for a :func:`compare_heads` result.

    Returns {"summary": loss curves + test-accuracy bars, "patterns": heatmaps of every head
    of the `pattern_heads`-head model (default: 4 if present, else the largest)}.
    """
    from .. import viz

    losses = {_head_label(h): r["loss"] for h, r in results.items()}
    accuracies = {_head_label(h): r["final_test_accuracy"] for h, r in results.items()}
    if pattern_heads is None:
        pattern_heads = 4 if 4 in results else max(results)
    r = results[pattern_heads]
    tokens = [str(t) for t in r["tokens"]]
    patterns = viz.head_grid(
        r["attention"], tokens, n_cols=min(pattern_heads, 4), vmin=0.0, vmax=1.0,
        annot=len(tokens) <= 16,
        title=f"Trained {pattern_heads}-Head Model: Learned Patterns\n"
              f"Sequence: {' '.join(tokens)} (a repeating pattern)")
    return {"summary": viz.training_summary(losses, accuracies), "patterns": patterns}


# --- E12.1: parameter counts -----------------------------------------------------------------

def parameter_count(d_model=512, n_heads=8, *, bias=True, d_head=None):
    """Parameters of one multi-head attention layer (W_q, W_k, W_v, W_o, optional biases).

    d_head defaults to d_model // n_heads (so every head count gives 4 d_model^2 weights).
    Returns {"d_head", "W_q", "W_k", "W_v", "W_o", "b_q", "b_k", "b_v", "b_o", "weights",
    "biases", "total"} (biases 0 when bias=False); equals
    ``mha.MultiHeadAttention(d_model, n_heads, bias=bias).num_parameters()``.
    """
    d_model, n_heads = int(d_model), int(n_heads)
    d_head = d_model // n_heads if d_head is None else int(d_head)
    if d_head < 1:
        raise ValueError(f"d_head = {d_head}: need n_heads <= d_model or an explicit d_head")
    inner = n_heads * d_head
    counts = {"d_head": d_head, "W_q": d_model * inner, "W_k": d_model * inner,
              "W_v": d_model * inner, "W_o": inner * d_model}
    b = 1 if bias else 0
    counts.update(b_q=b * inner, b_k=b * inner, b_v=b * inner, b_o=b * d_model)
    counts["weights"] = sum(counts[k] for k in ("W_q", "W_k", "W_v", "W_o"))
    counts["biases"] = sum(counts[k] for k in ("b_q", "b_k", "b_v", "b_o"))
    counts["total"] = counts["weights"] + counts["biases"]
    return counts


def transformer_parameters(d_model=512, n_heads=8, d_ff=None, *, n_layers=6, vocab_size=37000,
                           bias=True, decoder=True, shared_embeddings=True):
    """Where a Transformer's parameters are (Vaswani et al. 2017; base: 512, 8, 2048, 6).

    A block is post-LN: self-attention, [cross-attention in the decoder], a two-layer FFN
    (d_model -> d_ff -> d_model, biases with bias=True), and one LayerNorm (2 d_model) per
    sub-layer. Sinusoidal positions have no parameters; with shared_embeddings one
    vocab_size x d_model matrix serves encoder, decoder and the output projection.

    Returns a dict: "mha", "ffn", "layer_norm", "embedding", "total" (whole model); their
    "*_share" of the total; and "block": the same for one encoder block (mha, ffn, layer_norm,
    total, mha_share, ffn_share).
    """
    d_model = int(d_model)
    d_ff = 4 * d_model if d_ff is None else int(d_ff)
    attention = parameter_count(d_model, n_heads, bias=bias)["total"]
    ffn = 2 * d_model * d_ff + ((d_ff + d_model) if bias else 0)
    norm = 2 * d_model
    block_total = attention + ffn + 2 * norm
    block = {"mha": attention, "ffn": ffn, "layer_norm": 2 * norm, "total": block_total,
             "mha_share": attention / block_total, "ffn_share": ffn / block_total}
    n_enc, n_dec = int(n_layers), int(n_layers) if decoder else 0
    totals = {
        "mha": attention * (n_enc + 2 * n_dec),
        "ffn": ffn * (n_enc + n_dec),
        "layer_norm": norm * (2 * n_enc + 3 * n_dec),
        "embedding": vocab_size * d_model * (1 if shared_embeddings else (3 if decoder else 2)),
    }
    totals["total"] = sum(totals.values())
    for key in ("mha", "ffn", "layer_norm", "embedding"):
        totals[f"{key}_share"] = totals[key] / totals["total"]
    totals["block"] = block
    return totals


def parameter_table(d_model=512, n_heads_list=(1, 8), *, bias=(False, True), d_ff=None):
    """E12.1 as rows: one per (n_heads, bias), d_head = d_model // n_heads.

    Returns a list of dicts with d_model, n_heads, d_head, bias, W_q, W_k, W_v, W_o, biases,
    mha (attention total), ffn, block (one encoder block), mha_share, ffn_share.
    Print it with :func:`format_table`.
    """
    rows = []
    for b in ((bias,) if isinstance(bias, (bool, np.bool_)) else tuple(bias)):
        for h in n_heads_list:
            c = parameter_count(d_model, h, bias=bool(b))
            block = transformer_parameters(d_model, h, d_ff, bias=bool(b))["block"]
            rows.append({"d_model": int(d_model), "n_heads": int(h), "d_head": c["d_head"],
                         "bias": bool(b), "W_q": c["W_q"], "W_k": c["W_k"], "W_v": c["W_v"],
                         "W_o": c["W_o"], "biases": c["biases"], "mha": c["total"],
                         "ffn": block["ffn"], "block": block["total"],
                         "mha_share": block["mha_share"], "ffn_share": block["ffn_share"]})
    return rows


def format_table(rows, columns=None):
    """A list of dicts as a Markdown table (ints with thousands separators, floats as %
    when the column name ends in "share", else 4 significant digits)."""
    if not rows:
        return ""
    columns = list(rows[0]) if columns is None else list(columns)

    def cell(name, value):
        if isinstance(value, (bool, np.bool_)):
            return "yes" if value else "no"
        if isinstance(value, (int, np.integer)):
            return f"{int(value):,}"
        if isinstance(value, (float, np.floating)):
            return f"{value:.1%}" if name.endswith("share") else f"{value:.4g}"
        return str(value)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(c, row[c]) for c in columns) + " |" for row in rows]
    return "\n".join(lines)


# --- E12.2: how many heads? ------------------------------------------------------------------

def offset_profile(weights):
    """Mean attention a head pays to the key `k` positions back, for k = 0 .. n-1.

    weights: (..., n, n) causal attention -> (..., n): entry k averages weights[..., i, i-k]
    over the rows i >= k. On the period-3 task the useful head puts its mass at k = 2.
    """
    w = np.asarray(weights, dtype=np.float64)
    n = w.shape[-1]
    return np.stack([np.diagonal(w, offset=-k, axis1=-2, axis2=-1).mean(axis=-1)
                     for k in range(n)], axis=-1)


def period_mass(weights, period=3):
    """Attention mass a head puts on the tokens that equal the next one in a periodic sequence.

    weights: (..., n, n) causal attention over a sequence of period `period` -> (...): for
    each row i >= period - 1, the weight on keys j with (i - j) % period == period - 1 (the
    tokens i-2, i-5, ... for period 3: attending to any of them solves the task), averaged
    over those rows. 1 for a head that only looks at copies of the answer.
    """
    w = np.asarray(weights, dtype=np.float64)
    n = w.shape[-1]
    i, j = np.arange(n)[:, None], np.arange(n)[None, :]
    source = (i - j >= period - 1) & ((i - j) % period == period - 1)           # (n, n)
    rows = (w * source).sum(axis=-1)[..., period - 1:]
    return rows.mean(axis=-1)


def heads_sweep(head_counts=(1, 2, 4, 8, 16), *, d_model=256, epochs=30, lr=0.002,
                n_train=200, n_test=200, seq_len=12, vocab_size=5, period=3, batch_size=None,
                target=0.97, loss_margin=0.1, dtype=np.float32, seed=0, progress=True):
    """E12.2: the same task at a fixed d_model with more and more heads.

    Trains one model per head count on the period-3 task (same data, same seed) and measures
    convergence speed, final accuracy and attention entropy per head.

    Convergence speed, two ways (1-based epochs, None if never reached):
        epochs_to_target: first epoch whose test accuracy reaches target * pattern_ceiling(...)
            (the best accuracy the task allows: 0.867 at the seed's sizes);
        epochs_to_loss: first epoch whose training loss is within loss_margin nats of
            pattern_min_loss(...) (0.268 at the seed's sizes), the loss of a perfect model.
    The defaults (200 sequences, 30 full-batch epochs) converge and take about half a minute
    for all five head counts on two cores.

    Returns {n_heads: history} with :func:`fit`'s keys and :func:`compare_heads`' extras, plus
    epochs_to_target, epochs_to_loss, target_accuracy, target_loss and:
        entropy: (n_heads,) mean attention entropy (nats) of each head over the test set
        entropy_uniform: entropy of uniform causal attention (mean of ln(i+1)), a ceiling
        offsets: (n_heads, seq_len) :func:`offset_profile` of each head over the test set
        period_mass: (n_heads,) :func:`period_mass` of each head over the test set
    """
    train, test, model_seed = _datasets(n_train, n_test, seq_len, vocab_size, period, seed)
    goal = target * pattern_ceiling(seq_len, vocab_size, period)
    goal_loss = pattern_min_loss(seq_len, vocab_size, period) + loss_margin
    uniform = float(np.mean(np.log(np.arange(1, seq_len + 1))))
    results = {}
    for h in head_counts:
        r = _train_one(int(h), train, test, d_model=d_model, epochs=epochs, lr=lr,
                       batch_size=batch_size, dtype=dtype, model_seed=model_seed,
                       progress=progress, seq_len=seq_len, vocab_size=vocab_size,
                       period=period)
        reached = np.flatnonzero(r["test_accuracy"] >= goal)
        low = np.flatnonzero(r["loss"] <= goal_loss)
        _, weights = r["model"](test[0])                               # (B, H, n, n)
        r.update(epochs_to_target=int(r["test_epochs"][reached[0]]) if reached.size else None,
                 epochs_to_loss=int(low[0]) + 1 if low.size else None, target_loss=goal_loss,
                 entropy=analysis.entropy(weights).mean(axis=0), entropy_uniform=uniform,
                 offsets=offset_profile(weights).mean(axis=0), target_accuracy=goal,
                 period_mass=period_mass(weights, period).mean(axis=0))
        results[int(h)] = r
    return results


def heads_sweep_figures(results):
    """E12.2 figures: {"summary": loss curves + accuracy bars, "entropy": entropy of every
    head per head count (with the uniform-attention ceiling)}."""
    from matplotlib.figure import Figure

    from .. import viz

    losses = {_head_label(h): r["loss"] for h, r in results.items()}
    accuracies = {_head_label(h): r["final_test_accuracy"] for h, r in results.items()}
    summary = viz.training_summary(losses, accuracies)
    fig = Figure(figsize=(8, 5), layout="compressed")
    ax = fig.add_subplot()
    for i, (h, r) in enumerate(results.items()):
        e = r["entropy"]
        ax.scatter(np.full(e.shape, i) + np.linspace(-0.25, 0.25, e.size), e, s=30,
                   edgecolor="black", linewidth=0.5, zorder=3)
        ax.hlines(e.mean(), i - 0.3, i + 0.3, color="black", linewidth=2, zorder=4)
    uniform = next(iter(results.values()))["entropy_uniform"]
    ax.axhline(uniform, color="#e74c3c", linestyle="--", label="uniform causal attention")
    ax.set_xticks(range(len(results)), [_head_label(h) for h in results])
    ax.set_ylabel("Attention entropy per head (nats)", fontsize=12)
    ax.set_title("Attention Entropy per Head (bar = mean)", fontsize=13, fontweight="bold")
    ax.grid(True, alpha=0.3)
    ax.legend()
    return {"summary": summary, "entropy": fig}


# --- E12.3: head importance and pruning -------------------------------------------------------

def prune_experiment(n_heads=8, *, d_model=32, epochs=100, lr=0.005, n_train=500, n_test=500,
                     seq_len=12, vocab_size=5, period=3, max_drop=0.01, step=1,
                     dtype=np.float32, seed=0, progress=True, model=None, test_data=None):
    """E12.3: zero one head at a time, rank heads, prune until accuracy drops > max_drop.

    Trains a model on the period-3 task (or takes `model` and `test_data` = (tokens, targets)),
    then, on the test set:
      1. ablation importance: accuracy drop when each head alone is zeroed (head_mask);
      2. gradient importance: mean |dL/d head_mask| over test batches (Michel et al. 2019);
      3. iterative pruning, `step` heads at a time (int, or a fraction of the heads), the
         least important first by ablation recomputed on the pruned model, until the end;
         ``prunable`` = heads removed before accuracy drops by more than max_drop (absolute:
         0.01 = one accuracy point).
    The surviving heads are then removed for real (``prune_heads`` on a copy) to check that
    the smaller model scores the same.

    Returns a dict: baseline_accuracy, ablation (H,), gradient (H,), ranking (heads, most
    important first), curve (:class:`mha.analysis.PruningCurve`), prunable, surviving_heads,
    pruned_accuracy, attention (H, n, n) on a test sequence (the first with `period` distinct
    tokens), tokens, offsets (H, n)
    and period_mass (H,) (:func:`offset_profile`, :func:`period_mass` over the test set),
    history (None when `model` is given), model, test_data (tokens, targets).
    """
    history = None
    if model is None:
        train, test, model_seed = _datasets(max(1, n_train), n_test, seq_len, vocab_size,
                                            period, seed)
        history = _train_one(int(n_heads), train, test, d_model=d_model, epochs=epochs, lr=lr,
                             batch_size=None, dtype=dtype, model_seed=model_seed,
                             progress=progress, seq_len=seq_len, vocab_size=vocab_size,
                             period=period)
        model = history.pop("model")
        test_tokens, test_targets = test
    else:
        if test_data is None:
            raise ValueError("prune_experiment(model=...) needs test_data=(tokens, targets)")
        test_tokens, test_targets = (np.asarray(a) for a in test_data)
    layer = model.attention
    H = layer.n_heads

    def evaluate(mask):
        with analysis.use_head_mask(layer, mask):
            return model.accuracy(test_tokens, test_targets)

    baseline = evaluate(np.ones(H))
    ablation = analysis.head_importance_ablation(evaluate, H)
    grads = []
    for start in range(0, len(test_tokens), 50):
        model.loss_and_grads(test_tokens[start:start + 50], test_targets[start:start + 50])
        grads.append(analysis.head_mask_grads(layer))
    gradient = analysis.head_importance_gradient(np.array(grads))
    curve = analysis.pruning_curve(evaluate, H, step=step, max_drop=max_drop)
    surviving = np.flatnonzero(curve.prunable_mask)

    pruned = copy.deepcopy(model)
    removed = [int(h) for h in range(H) if h not in set(surviving.tolist())]
    if len(surviving) and removed:
        pruned.attention.prune_heads(removed)
    pruned_accuracy = pruned.accuracy(test_tokens, test_targets) if len(surviving) else float("nan")

    _, weights = model(test_tokens)                                    # (B, H, n, n)
    example = int(np.argmax([len(set(row[:period].tolist())) for row in test_tokens]))
    return {
        "baseline_accuracy": baseline, "ablation": ablation, "gradient": gradient,
        "ranking": np.argsort(-ablation, kind="stable"), "curve": curve,
        "prunable": curve.prunable, "surviving_heads": surviving,
        "pruned_accuracy": pruned_accuracy, "attention": weights[example],
        "tokens": np.asarray(test_tokens[example]).copy(),
        "offsets": offset_profile(weights).mean(axis=0),
        "period_mass": period_mass(weights, period).mean(axis=0), "history": history,
        "model": model,
        "test_data": (test_tokens, test_targets),
    }


def prune_figures(result):
    """E12.3 figures: {"importance": ablation and gradient importance per head, "pruning":
    accuracy against heads pruned, "surviving": heatmaps of the surviving heads}."""
    from matplotlib.figure import Figure

    from .. import viz

    H = result["ablation"].size
    fig = Figure(figsize=(10, 4.5), layout="compressed")
    ax_abl, ax_grad = fig.subplots(1, 2)
    for ax, values, title in ((ax_abl, 100 * result["ablation"], "Accuracy drop when zeroed (%)"),
                              (ax_grad, result["gradient"], "Gradient importance |dL/dmask|")):
        colors = ["#2ecc71" if h in set(result["surviving_heads"].tolist()) else "#bdc3c7"
                  for h in range(H)]
        ax.bar(range(H), values, color=colors, edgecolor="black")
        ax.set_xticks(range(H), [f"H{h}" for h in range(H)])
        ax.set_title(title, fontsize=12, fontweight="bold")
        ax.grid(True, alpha=0.3, axis="y")
    fig.suptitle("Head Importance (green = survives pruning)", fontsize=13, fontweight="bold")
    tokens = [str(t) for t in result["tokens"]]
    heads = result["surviving_heads"].tolist() or list(range(H))
    surviving = viz.head_grid(result["attention"], tokens, heads=heads, n_cols=min(4, len(heads)),
                              vmin=0.0, vmax=1.0, annot=len(tokens) <= 16,
                              title=f"Surviving heads ({len(result['surviving_heads'])} of {H})")
    return {"importance": fig, "pruning": viz.pruning_plot(result["curve"]),
            "surviving": surviving}


# --- speed -----------------------------------------------------------------------------------

def benchmark_epoch(n_heads=4, *, d_model=32, n_samples=500, seq_len=12, vocab_size=5,
                    threads=2, repeats=10, warmup=3, dtype=np.float32, lr=0.005, seed=0):
    """Time one full-batch training epoch of seed 000's task: mha against the seed's torch
    model (same weights, same thread count; epochs alternate so both see the same load).

    An epoch is forward, cross-entropy, backward and one Adam step on all n_samples sequences.
    Returns {"mha_seconds", "torch_seconds" (medians), "speedup" (torch / mha: > 1 means mha
    is faster), "mha_times", "torch_times" (every timed epoch), "threads", "config"}.
    Needs torch.
    """
    import torch

    import mha

    from .torch_port import torch_model

    tokens, targets = pattern_data(n_samples, seq_len, vocab_size, seed=seed)
    model = SimpleAttentionModel(vocab_size, d_model, n_heads, seq_len, dtype=dtype, seed=seed)
    module = torch_model(model)
    optimizer = Adam(model.params, lr=lr)
    t_optimizer = torch.optim.Adam(module.parameters(), lr=lr)
    criterion = torch.nn.CrossEntropyLoss()
    t_tokens, t_targets = torch.from_numpy(tokens), torch.from_numpy(targets)

    def mha_epoch():
        _, grads = model.loss_and_grads(tokens, targets)
        optimizer.step(grads)

    def torch_epoch():
        logits, _ = module(t_tokens)
        loss = criterion(logits.view(-1, vocab_size), t_targets.view(-1))
        t_optimizer.zero_grad()
        loss.backward()
        t_optimizer.step()
        loss.item()

    old_mha, old_torch = mha.get_num_threads(), torch.get_num_threads()
    mha.set_num_threads(threads)
    torch.set_num_threads(threads)
    mha_times, torch_times = [], []
    try:
        for i in range(warmup + repeats):
            for epoch, times in ((mha_epoch, mha_times), (torch_epoch, torch_times)):
                start = time.perf_counter()
                epoch()
                if i >= warmup:
                    times.append(time.perf_counter() - start)
    finally:
        mha.set_num_threads(old_mha)
        torch.set_num_threads(old_torch)
    mha_s, torch_s = float(np.median(mha_times)), float(np.median(torch_times))
    return {"mha_seconds": mha_s, "torch_seconds": torch_s, "speedup": torch_s / mha_s,
            "mha_times": mha_times, "torch_times": torch_times, "threads": int(threads),
            "config": dict(n_heads=n_heads, d_model=d_model, n_samples=n_samples,
                           seq_len=seq_len, vocab_size=vocab_size,
                           dtype=np.dtype(dtype).name)}
