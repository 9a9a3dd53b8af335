"""Pictures beyond raw attention, from arrays: the map of heads (Clark et al. 2019), what each
position draws on (raw weights, rollout, flow, value norms), the share of weight and of value
norm on special tokens (Kobayashi et al. 2020), and Clark et al.'s per-head statistics.

The functions in :mod:`mha.viz.model_figures` run a model and draw with these.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping, Sequence

import numpy as np
from numpy.typing import ArrayLike

from .. import analysis
from ._common import _COLORS, _figure, _figure_and_ax, _label_size, _matrix

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure


def head_map(attentions: ArrayLike | None = None, *, attention_mask: ArrayLike | None = None,
             points: ArrayLike | None = None,
             color: ArrayLike | None = None, color_label: str | None = None, labels: bool = True,
             ax: Axes | None = None, title: str = "Heads by Jensen-Shannon distance (MDS)", cmap: str = "viridis",
             figsize: tuple[float, float] = (7.5, 6.5)) -> Figure:
    """Every head of a model as a point, close to the heads that attend alike (Clark et al. 2019).

    Parameters
    ----------
    attentions : array_like, shape (L, H, n, n) or (B, L, H, n, n), optional
        The attention of one text or a padded batch; the map is
        :func:`mha.analysis.head_map` of it (classical MDS of the square root of the mean
        Jensen-Shannon divergence between heads).
    attention_mask : array_like of bool, shape (n,) or (B, n), optional
        True = real token: padding is left out of the distances (as
        :func:`mha.analysis.head_map`).
    points : array_like, shape (L, H, 2), optional
        Coordinates computed already (instead of ``attentions``).
    color : array_like, shape (L, H), optional
        A value per head to colour by (e.g. ``clark_metrics(...)["entropy"]``); default: the
        layer.
    color_label : str, optional
        The colour bar's label.
    labels : bool
        Write "layer-head" next to each point.
    ax : matplotlib.axes.Axes, optional
        Draw into these axes instead of a new figure.
    title : str
        The axes' title.
    cmap : str
        The colour map of ``color``.
    figsize : tuple of float
        The size of a new figure, in inches.

    Returns
    -------
    matplotlib.figure.Figure
        The map (``ax.figure`` when ``ax`` is given).

    Examples
    --------
    >>> w = np.random.default_rng(0).random((2, 3, 5, 5)); w /= w.sum(-1, keepdims=True)
    >>> fig = head_map(w)
    """
    if points is None:
        if attentions is None:
            raise ValueError("head_map needs attentions or points")
        points, _ = analysis.head_map(attentions, attention_mask=attention_mask)
    points = np.asarray(points, dtype=np.float64)
    if points.ndim != 3 or points.shape[-1] != 2:
        raise ValueError(f"points has shape {points.shape}: expected (layers, heads, 2)")
    L, H, _ = points.shape
    if color is None:
        values = np.repeat(np.arange(L, dtype=float)[:, None], H, axis=1)
        color_label = color_label or "layer"
    else:
        values = np.asarray(color, dtype=np.float64)
        if values.shape != (L, H):
            raise ValueError(f"color has shape {values.shape}: expected ({L}, {H})")
    fig, ax = _figure_and_ax(ax, figsize)
    sc = ax.scatter(points[..., 0].ravel(), points[..., 1].ravel(), c=values.ravel(), cmap=cmap,
                    s=46, edgecolors="black", linewidths=0.5)
    if labels:
        for l in range(L):
            for h in range(H):
                ax.annotate(f"{l}-{h}", points[l, h], fontsize=6.5, xytext=(3, 3),
                            textcoords="offset points", color="#333")
    cbar = ax.figure.colorbar(sc, ax=ax, shrink=0.8)
    cbar.set_label(color_label or "")
    ax.set_xticks([])
    ax.set_yticks([])
    ax.set_title(title, fontsize=12, fontweight="bold")
    ax.set_aspect("equal", adjustable="datalim")
    return fig


def _draws_on_figure(tokens: Sequence[str], panels: Sequence[tuple[np.ndarray, str]],
                    figsize: tuple[float, float]) -> Figure:
    """One (n, n) matrix per panel, side by side: [(values, title)], each on its own scale."""
    fig = _figure(figsize)
    axes = fig.subplots(1, len(panels))
    for ax, (values, name) in zip(np.atleast_1d(axes), panels):
        _matrix(ax, values, x_labels=tokens, y_labels=tokens, cmap="Blues", vmin=0.0,
                vmax=float(values.max()), annot=False, fmt=".2f", colorbar=False, title=None,
                label_rotation=90, fontsize=min(7.0, _label_size(len(tokens))))
        ax.set_title(name, fontsize=10, fontweight="bold")
    fig.suptitle("What each position draws on: raw weights, rollout, flow, value norms",
                 fontsize=13, fontweight="bold")
    return fig


def _special_share_bars(shares: Mapping[str, Any], figsize: tuple[float, float]) -> Figure:
    """Bars per layer of :func:`~mha.viz.special_token_shares`' three shares."""
    L = len(shares["weight"])
    fig, ax = _figure_and_ax(None, figsize)
    x = np.arange(L)
    ax.bar(x - 0.27, shares["weight"], 0.27, label="weight \u03b1", color=_COLORS[1])
    ax.bar(x, shares["norm"], 0.27, label="norm ||\u03b1 f_h(x)||, per head", color=_COLORS[0])
    ax.bar(x + 0.27, shares["norm_summed"], 0.27, label="norm ||\u03a3_h \u03b1 f_h(x)||",
           color=_COLORS[3])
    ax.set_xticks(x)
    ax.set_xlabel("Layer")
    ax.set_ylabel("Share on [CLS] and [SEP]")
    ax.set_ylim(0, 1)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=9)
    ax.set_title("Attention weight vs value norm on [CLS]/[SEP]", fontsize=12, fontweight="bold")
    return fig


def _clark_panels(metrics: Mapping[str, np.ndarray], figsize: tuple[float, float]) -> Figure:
    """Six (layer x head) heatmaps of :func:`mha.analysis.clark_metrics`' statistics."""
    names = [("mass_cls", "to [CLS]"), ("mass_sep", "to [SEP]"), ("mass_punct", "to punctuation"),
             ("mass_prev", "to previous token"), ("mass_next", "to next token"),
             ("entropy", "entropy (nats)")]
    fig = _figure(figsize)
    axes = fig.subplots(2, 3).ravel()
    L, H = metrics["entropy"].shape
    for ax, (key, label) in zip(axes, names):
        vmax = float(metrics["uniform_entropy"].max()) if key == "entropy" else 1.0
        im = ax.imshow(metrics[key], cmap="magma_r" if key != "entropy" else "viridis", vmin=0,
                       vmax=vmax, aspect="auto", interpolation="nearest")
        ax.set_title(label, fontsize=11, fontweight="bold")
        ax.set_xlabel("head")
        ax.set_ylabel("layer")
        ax.set_xticks(range(H))
        ax.set_yticks(range(L))
        ax.tick_params(labelsize=7)
        fig.colorbar(im, ax=ax, shrink=0.8)
    fig.suptitle("What the heads look at (Clark et al. 2019), token-weighted means",
                 fontsize=13, fontweight="bold")
    return fig
