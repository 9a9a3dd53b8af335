"""Figures of the training experiments (matplotlib, drawn with `mha.viz`): each function takes an
experiment's result (`mha.apps.training`) and returns a dict of named figures."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping

import numpy as np

from .training import head_label

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["compare_heads_figures", "heads_sweep_figures", "prune_figures"]


def compare_heads_figures(results: Mapping[int, Mapping[str, Any]], *,
                          pattern_heads: int | None = None) -> dict[str, Figure]:
    """Draw the figures of a `compare_heads` result: loss curves, accuracy bars, learned patterns.

    Parameters
    ----------
    results : dict
        `compare_heads`' result, {n_heads: history}.
    pattern_heads : int, optional
        Whose attention to draw; default 4 if trained, else the largest head count.

    Returns
    -------
    dict of matplotlib.figure.Figure
        "summary": loss curves and test-accuracy bars; "patterns": heatmaps of every head of
        the `pattern_heads`-head model on its example test sequence.

    Examples
    --------
    >>> from mha.apps.training import compare_heads
    >>> results = compare_heads((1, 2), d_model=16, epochs=3, n_train=32, n_test=16, progress=False)
    >>> sorted(compare_heads_figures(results))
    ['patterns', 'summary']
    """
    from .. import viz

    losses = {head_label(h): r["loss"] for h, r in results.items()}
    accuracies = {head_label(h): r["final_test_accuracy"] for h, r in results.items()}
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


def heads_sweep_figures(results: Mapping[int, Mapping[str, Any]]) -> dict[str, Figure]:
    """Draw the figures of a `heads_sweep` result (the sweep over head counts).

    Parameters
    ----------
    results : dict
        `heads_sweep`' result, {n_heads: history}.

    Returns
    -------
    dict of matplotlib.figure.Figure
        "summary": loss curves and accuracy bars; "entropy": the attention entropy of every
        head per head count, with the ceiling of uniform causal attention.

    Examples
    --------
    >>> from mha.apps.training import heads_sweep
    >>> sweep = heads_sweep((1, 2), d_model=16, epochs=3, n_train=32, n_test=16, progress=False)
    >>> sorted(heads_sweep_figures(sweep))
    ['entropy', 'summary']
    """
    from matplotlib.figure import Figure

    from .. import viz

    losses = {head_label(h): r["loss"] for h, r in results.items()}
    accuracies = {head_label(h): r["final_test_accuracy"] for h, r in results.items()}
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
    ax.set_xticks(range(len(results)), [head_label(h) for h in results])
    ax.set_ylabel("Attention entropy per head (nats)", fontsize=12)
    ax.set_title("Attention Entropy per Head (bar = mean)", fontsize=13, fontweight="bold")
    ax.grid(True, alpha=0.3)
    ax.legend()
    return {"summary": summary, "entropy": fig}


def prune_figures(result: Mapping[str, Any]) -> dict[str, Figure]:
    """Draw the figures of a `prune_experiment` result (the head-pruning procedure).

    Parameters
    ----------
    result : dict
        `prune_experiment`'s result.

    Returns
    -------
    dict of matplotlib.figure.Figure
        "importance": ablation and gradient importance per head (surviving heads green);
        "pruning": accuracy against heads pruned; "surviving": heatmaps of the surviving heads.

    Examples
    --------
    >>> from mha.apps.training import prune_experiment
    >>> result = prune_experiment(4, d_model=16, epochs=3, n_train=32, n_test=32, progress=False)
    >>> sorted(prune_figures(result))
    ['importance', 'pruning', 'surviving']
    """
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
