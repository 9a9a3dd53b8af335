"""Pictures of attention: the seeds' figures, in matplotlib.

Every function returns a ``matplotlib.figure.Figure`` (built without pyplot, so nothing
piles up in pyplot's figure list): Jupyter shows the returned figure once, a script calls
``fig.savefig("x.png")``. Functions that draw one panel accept ``ax=`` to draw into your own
axes instead (they then return ``ax.figure``). Attention arrays are NumPy (torch tensors are
converted), rows = queries ("attending from"), columns = keys ("attending to").

- :func:`heatmap` -- one attention matrix with token labels and annotations (seeds 000, 001)
- :func:`head_grid` -- every head of a layer in a grid with ``n_cols`` (seed 002)
- :func:`similarity_matrices` -- head-by-head similarity per layer (seed 000)
- :func:`mask_heatmap` -- a (causal) mask (seed 001)
- :func:`concat_projection` -- head outputs, their concatenation, and W_o's mix (seed 000)
- :func:`training_curves`, :func:`accuracy_bars`, :func:`training_summary` (seed 000)
- :func:`speed_bars` -- time per configuration, e.g. 1/4/8/16 heads (seed 000)
- :func:`pruning_plot` -- a :class:`mha.analysis.PruningCurve` (seed 002, E12.3)
- :func:`attention_gif` -- one head (or the sum of heads) across layers, animated (seed 004)
- :func:`head_view` -- the interactive, self-contained HTML head view (seed 004); also
  cross-attention, rollout and value norms; :func:`model_view`, :func:`neuron_view`
- :func:`head_map` -- every head placed by Jensen-Shannon distance (Clark et al. 2019)
- :func:`beyond_attention_figure`, :func:`kobayashi_figure`, :func:`clark_metrics_figure`,
  :func:`head_map_figure` -- one figure each from a model (the tour's)

seaborn is not needed.
"""
from __future__ import annotations

import base64
import io
import os
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import numpy as np
from numpy.typing import ArrayLike

from . import analysis
from .headview import HeadView, ModelView, NeuronView, head_view, model_view, neuron_view

if TYPE_CHECKING:                        # matplotlib is imported when a figure is drawn
    from matplotlib.axes import Axes
    from matplotlib.colors import Colormap
    from matplotlib.figure import Figure

    from .models import TransformerModel

__all__ = [
    "heatmap", "head_grid", "similarity_matrices", "mask_heatmap", "concat_projection",
    "training_curves", "accuracy_bars", "training_summary", "speed_bars", "pruning_plot",
    "attention_gif", "AnimatedGIF", "head_view", "HeadView", "model_view", "ModelView",
    "neuron_view", "NeuronView", "head_map", "beyond_attention_figure", "special_token_shares",
    "kobayashi_figure", "clark_metrics_figure", "head_map_figure",
]

# seed 000's bar colours, then matplotlib's tab10
_COLORS = ["#e74c3c", "#3498db", "#2ecc71", "#f39c12", "#9b59b6", "#1abc9c", "#34495e",
           "#e67e22", "#7f8c8d", "#c0392b"]


# --- helpers ---------------------------------------------------------------------------------

def _figure(figsize, dpi=None):
    from matplotlib.figure import Figure
    return Figure(figsize=figsize, dpi=dpi, layout="compressed")


def _figure_and_ax(ax, figsize):
    if ax is not None:
        return ax.figure, ax
    fig = _figure(figsize)
    return fig, fig.add_subplot()


def _array(x, name="weights"):
    if hasattr(x, "detach") and hasattr(x, "cpu"):
        x = x.detach().cpu().numpy()
    x = np.asarray(x)
    if x.dtype.kind not in "fiub":
        raise TypeError(f"{name} must be real numbers, got dtype {x.dtype}")
    return x.astype(np.float64)


def _squeeze_to(x, ndim, name, expected):
    """Drop leading length-1 axes (a batch of one) until x has ndim axes."""
    while x.ndim > ndim and x.shape[0] == 1:
        x = x[0]
    if x.ndim != ndim:
        raise ValueError(f"{name} has shape {x.shape}: expected {expected}")
    return x


def _labels(tokens, n, name):
    if tokens is None:
        return [str(i) for i in range(n)]
    tokens = [str(t) for t in tokens]
    if len(tokens) != n:
        raise ValueError(f"{name} has {len(tokens)} entries but the attention has {n} positions")
    return tokens


def _label_size(n):
    return float(np.clip(260.0 / max(n, 1), 4.0, 10.0))


def _cell_text(v, fmt, cmap, vmin, vmax):
    """The text of one annotated cell and its colour: white on dark cells (as seaborn does)."""
    if not np.isfinite(v):
        return str(v), "black"
    r, g, b = cmap(np.clip((v - vmin) / ((vmax - vmin) or 1.0), 0, 1))[:3]
    return format(v, fmt), ("white" if 0.2126 * r + 0.7152 * g + 0.0722 * b < 0.5 else "black")


def _annotate(ax, values, fmt, cmap, vmin, vmax, fontsize):
    """Write each value in its cell; returns the Text artists, row by row."""
    import matplotlib as mpl
    cmap = mpl.colormaps[cmap] if isinstance(cmap, str) else cmap
    texts = []
    for (i, j), v in np.ndenumerate(values):
        text, color = _cell_text(v, fmt, cmap, vmin, vmax)
        texts.append(ax.text(j, i, text, ha="center", va="center", fontsize=fontsize, color=color))
    return texts


def _matrix(ax, values, *, x_labels, y_labels, cmap, vmin, vmax, annot, fmt, colorbar,
            title=None, xlabel=None, ylabel=None, label_rotation=45, fontsize=None):
    """imshow + token ticks + optional annotations/colorbar on one axes -> (image, texts)."""
    n_q, n_k = values.shape
    im = ax.imshow(values, cmap=cmap, vmin=vmin, vmax=vmax, aspect="equal",
                   interpolation="nearest")
    size = fontsize or _label_size(max(n_q, n_k))
    if x_labels is not None:
        ax.set_xticks(range(n_k))
        ax.set_xticklabels(x_labels, rotation=label_rotation, fontsize=size,
                           ha="right" if label_rotation else "center",
                           rotation_mode="anchor")
    else:
        ax.set_xticks([])
    if y_labels is not None:
        ax.set_yticks(range(n_q))
        ax.set_yticklabels(y_labels, fontsize=size)
    else:
        ax.set_yticks([])
    ax.tick_params(length=0)
    texts = []
    if annot:
        texts = _annotate(ax, values, fmt, cmap, vmin, vmax,
                          fontsize=max(5.0, min(10.0, 90.0 / max(n_q, n_k))))
    if colorbar:
        ax.figure.colorbar(im, ax=ax, shrink=0.85)
    if title:
        ax.set_title(title, fontsize=12, fontweight="bold")
    if xlabel:
        ax.set_xlabel(xlabel, fontsize=10)
    if ylabel:
        ax.set_ylabel(ylabel, fontsize=10)
    return im, texts


# --- attention matrices ----------------------------------------------------------------------

def heatmap(weights: ArrayLike, tokens: Sequence[str] | None = None, key_tokens: Sequence[str] | None = None, *,
            title: str = "Attention Weights", ax: Axes | None = None, annot: bool | None = None,
            fmt: str = ".2f", cmap: str | Colormap = "Blues", vmin: float = 0.0,
            vmax: float | None = 1.0, colorbar: bool = True, xlabel: str = "Key (attending to)",
            ylabel: str = "Query (attending from)", figsize: tuple[float, float] = (8, 6),
            ) -> Figure:
    """Draw one attention matrix as an annotated heatmap (seed 000's ``visualize_attention``).

    Parameters
    ----------
    weights : array_like, shape (n_q, n_k)
        Attention weights, rows = queries (leading axes of length 1 are dropped).
    tokens : sequence of str, optional
        The query labels, also used for the keys unless ``key_tokens`` is given.
    key_tokens : sequence of str, optional
        The key labels, for cross-attention.
    title : str, default "Attention Weights"
        The axes' title.
    ax : matplotlib.axes.Axes, optional
        Draw into these axes instead of a new figure (the figure returned is then ``ax.figure``).
    annot : bool, optional
        Write the values in the cells; by default when the matrix has at most 20 x 20 cells.
    fmt : str, default ".2f"
        The format of the cell values.
    cmap : str or matplotlib.colors.Colormap, default "Blues"
        The colour map.
    vmin, vmax : float or None, default 0.0 and 1.0
        The colour scale; ``vmax=None`` scales to the largest weight.
    colorbar : bool, default True
        Draw a colour bar.
    xlabel, ylabel : str
        The axis labels.
    figsize : tuple of float, default (8, 6)
        The size of a new figure, in inches.

    Returns
    -------
    matplotlib.figure.Figure
        The figure (built without pyplot: ``fig.savefig(path)`` writes it, Jupyter shows it).

    Raises
    ------
    ValueError
        A matrix that is not 2-D once axes of length 1 are dropped, or labels of the wrong length.

    Examples
    --------
    >>> fig = heatmap(np.eye(3), ["the", "cat", "sat"])
    >>> fig.axes[0].get_title()
    'Attention Weights'
    """
    values = _squeeze_to(_array(weights), 2, "weights", "(n_q, n_k)")
    n_q, n_k = values.shape
    y_labels = _labels(tokens, n_q, "tokens")
    x_labels = _labels(key_tokens if key_tokens is not None else (tokens if n_q == n_k else None),
                       n_k, "key_tokens")
    if annot is None:
        annot = max(n_q, n_k) <= 20
    vmax = float(np.nanmax(values)) if vmax is None else vmax
    fig, ax = _figure_and_ax(ax, figsize)
    _matrix(ax, values, x_labels=x_labels, y_labels=y_labels, cmap=cmap, vmin=vmin, vmax=vmax,
            annot=annot, fmt=fmt, colorbar=colorbar, title=title, xlabel=xlabel, ylabel=ylabel)
    return fig


def head_grid(weights: ArrayLike, tokens: Sequence[str] | None = None, *, n_cols: int = 4,
              layer: int | None = None, heads: Sequence[int] | None = None,
              title: str = "Attention Patterns per Head", cmap: str | Colormap = "Blues",
              vmin: float = 0.0, vmax: float | None = None, annot: bool = False,
              fmt: str = ".2f", colorbar: bool = True, panel_size: float = 4.0) -> Figure:
    """Draw every head of one layer side by side (seed 002's ``visualize_heads``).

    Parameters
    ----------
    weights : array_like, shape (heads, n_q, n_k) or (layers, heads, n_q, n_k)
        Attention weights, rows = queries.
    tokens : sequence of str, optional
        The query labels (also the keys' when n_q == n_k).
    n_cols : int, default 4
        Panels per row.
    layer : int, optional
        The layer to show when ``weights`` has a layer axis longer than 1.
    heads : sequence of int, optional
        The heads to show (default all).
    title : str, default "Attention Patterns per Head"
        The figure's title.
    cmap : str or matplotlib.colors.Colormap, default "Blues"
        The colour map.
    vmin, vmax : float or None, default 0.0 and None
        The colour scale shared by the panels; ``vmax=None`` is the largest weight shown.
    annot : bool, default False
        Write the values in the cells.
    fmt : str, default ".2f"
        The format of the cell values.
    colorbar : bool, default True
        One colour bar shared by the panels.
    panel_size : float, default 4.0
        The size of each panel, in inches.

    Returns
    -------
    matplotlib.figure.Figure
        One panel per head.

    Raises
    ------
    ValueError
        A 4-D array with several layers and no ``layer``, or a shape that is not 3-D.

    Examples
    --------
    >>> w = np.random.default_rng(0).random((4, 5, 5))
    >>> len(head_grid(w / w.sum(-1, keepdims=True), n_cols=2).axes)      # 4 panels + colour bar
    5
    """
    values = _array(weights)
    if values.ndim == 4:
        if layer is None:
            if values.shape[0] != 1:
                raise ValueError(f"weights has shape {values.shape}: pass layer= to pick one "
                                 "of the layers, or give (heads, n, n)")
            layer = 0
        values = values[layer]
    values = _squeeze_to(values, 3, "weights", "(heads, n_q, n_k) or (layers, heads, n_q, n_k)")
    heads = list(range(values.shape[0])) if heads is None else [int(h) for h in heads]
    n_q, n_k = values.shape[1:]
    labels_q = _labels(tokens, n_q, "tokens")
    labels_k = labels_q if n_q == n_k else None
    n_cols = max(1, min(int(n_cols), len(heads)))
    n_rows = -(-len(heads) // n_cols)
    vmax = float(np.nanmax(values[heads])) if vmax is None else vmax
    fig = _figure((panel_size * n_cols, panel_size * n_rows + 0.6))
    axes = fig.subplots(n_rows, n_cols, squeeze=False).ravel()
    im = None
    for ax, h in zip(axes, heads):
        im, _ = _matrix(ax, values[h], x_labels=labels_k, y_labels=labels_q, cmap=cmap, vmin=vmin,
                     vmax=vmax, annot=annot, fmt=fmt, colorbar=False,
                     fontsize=min(7.0, _label_size(max(n_q, n_k))))
        name = f"Layer {layer}, Head {h}" if layer is not None else f"Head {h}"
        ax.set_title(name, fontsize=10, fontweight="bold")
    for ax in axes[len(heads):]:
        ax.set_visible(False)
    if colorbar and im is not None:
        fig.colorbar(im, ax=list(axes[:len(heads)]), shrink=0.6)
    if title:
        fig.suptitle(title, fontsize=14, fontweight="bold")
    return fig


def similarity_matrices(weights: ArrayLike, *, layers: Sequence[int] | None = None,
                        metric: str = "cosine", n_cols: int = 3, annot: bool = True,
                        title: str | None = None, cmap: str = "RdYlGn_r",
                        panel_size: float = 3.6) -> Figure:
    """Draw the head-by-head similarity of each layer (seed 000's head-diversity figure).

    Parameters
    ----------
    weights : array_like, shape (layers, heads, n, n) or (heads, n, n)
        Attention weights, rows = queries.
    layers : sequence of int, optional
        The layers to show (default all).
    metric : {"cosine", "js"}, default "cosine"
        Cosine similarity (seed 000's head_diversity, :func:`mha.analysis.head_similarity`) or
        Jensen-Shannon distance (:func:`mha.analysis.head_distance`); both on a 0..1 scale.
    n_cols : int, default 3
        Panels per row.
    annot : bool, default True
        Write the values in the cells (for at most 16 heads).
    title : str, optional
        The figure's title (default: one that names the metric).
    cmap : str, default "RdYlGn_r"
        The colour map.
    panel_size : float, default 3.6
        The size of each panel, in inches.

    Returns
    -------
    matplotlib.figure.Figure
        One panel per layer.

    Raises
    ------
    ValueError
        An unknown ``metric`` or a shape that is not 3-D or 4-D.

    Examples
    --------
    >>> w = np.random.default_rng(0).random((2, 3, 4, 4))
    >>> fig = similarity_matrices(w / w.sum(-1, keepdims=True), metric="js")
    """
    values = _array(weights)
    if values.ndim == 3:
        values = values[None]
    values = _squeeze_to(values, 4, "weights", "(layers, heads, n, n) or (heads, n, n)")
    layers = list(range(values.shape[0])) if layers is None else [int(l) for l in layers]
    if metric in ("cosine", "cos"):
        matrices = analysis.head_similarity(values[layers])
        default_title = ("Head Diversity: Pairwise Cosine Similarity Between Attention Heads\n"
                         "(Lower = more diverse = better)")
    elif metric in ("js", "jensen-shannon", "jensen_shannon"):
        matrices = analysis.head_distance(values[layers])
        default_title = ("Head Diversity: Jensen-Shannon Distance Between Attention Heads\n"
                         "(Higher = more diverse)")
    else:
        raise ValueError(f"metric={metric!r}: expected 'cosine' or 'js'")
    n_heads = matrices.shape[-1]
    panel_size = max(panel_size, 0.4 * n_heads) if panel_size is None or n_heads > 9 else panel_size
    n_cols = max(1, min(int(n_cols), len(layers)))
    n_rows = -(-len(layers) // n_cols)
    fig = _figure((panel_size * n_cols + 0.8, panel_size * n_rows + 0.9))
    axes = fig.subplots(n_rows, n_cols, squeeze=False).ravel()
    head_labels = [str(h) for h in range(n_heads)]
    im = None
    for ax, layer, matrix in zip(axes, layers, matrices):
        im, _ = _matrix(ax, matrix, x_labels=head_labels, y_labels=head_labels, cmap=cmap, vmin=0.0,
                     vmax=1.0, annot=annot and n_heads <= 16, fmt=".2f", colorbar=False,
                     title=f"Layer {layer}", xlabel="Head", ylabel="Head", label_rotation=0,
                     fontsize=7)
    for ax in axes[len(layers):]:
        ax.set_visible(False)
    if im is not None:
        fig.colorbar(im, ax=list(axes[:len(layers)]), shrink=0.6)
    fig.suptitle(default_title if title is None else title, fontsize=13, fontweight="bold")
    return fig


def mask_heatmap(mask: int | ArrayLike, tokens: Sequence[str] | None = None, *,
                 title: str = "Causal Attention Mask", ax: Axes | None = None, cmap: str = "Blues",
                 annot: bool | None = None, figsize: tuple[float, float] = (6, 5)) -> Figure:
    """Draw a mask as seed 001 does: 1 = may attend, 0 = masked.

    Parameters
    ----------
    mask : int or array_like, shape (n_q, n_k)
        An int n draws the causal mask ``tril(ones(n, n))``; a bool or 0/1 array has True = may
        attend (mha's convention); a float array is an additive mask (-inf = masked).
    tokens : sequence of str, optional
        The query labels (also the keys' when n_q == n_k); default the positions.
    title : str, default "Causal Attention Mask"
        The axes' title.
    ax : matplotlib.axes.Axes, optional
        Draw into these axes instead of a new figure (the figure returned is then ``ax.figure``).
    cmap : str, default "Blues"
        The colour map.
    annot : bool, optional
        Write 0/1 in the cells; by default for at most 24 x 24 cells.
    figsize : tuple of float, default (6, 5)
        The size of a new figure, in inches.

    Returns
    -------
    matplotlib.figure.Figure
        The figure (built without pyplot: ``fig.savefig(path)`` writes it, Jupyter shows it).

    Examples
    --------
    >>> fig = mask_heatmap(4)
    """
    if isinstance(mask, (int, np.integer)):
        allowed = np.tril(np.ones((int(mask), int(mask))))
    else:
        m = mask.detach().cpu().numpy() if hasattr(mask, "detach") else np.asarray(mask)
        m = _squeeze_to(m, 2, "mask", "(n_q, n_k)")
        if m.dtype == bool or m.dtype.kind in "iu":
            allowed = (m != 0).astype(float)
        else:
            allowed = np.isfinite(m).astype(float) if np.isinf(m).any() else (m != 0).astype(float)
    n_q, n_k = allowed.shape
    labels_q = _labels(tokens, n_q, "tokens") if tokens is not None else None
    labels_k = labels_q if tokens is not None and n_q == n_k else None
    if annot is None:
        annot = max(n_q, n_k) <= 24
    fig, ax = _figure_and_ax(ax, figsize)
    _matrix(ax, allowed, x_labels=labels_k if labels_k else [str(j) for j in range(n_k)],
            y_labels=labels_q if labels_q else [str(i) for i in range(n_q)], cmap=cmap, vmin=0,
            vmax=1, annot=annot, fmt=".0f", colorbar=False, title=title,
            xlabel="Key Position", ylabel="Query Position",
            label_rotation=45 if tokens is not None else 0)
    return fig


def concat_projection(head_outputs: ArrayLike | None = None, W_o: ArrayLike | None = None, *,
                      n_heads: int = 4, d_head: int = 2, seed: int | None = None,
                      title: str = "Multi-Head Attention: Concat + Project") -> Figure:
    """Draw seed 000's picture: per-head outputs, their concatenation, and W_o's mix.

    Parameters
    ----------
    head_outputs : array_like, shape (heads, d_head), optional
        One token's output of every head (e.g. ``O[b, :, i, :]``); default random values like
        the seed's.
    W_o : array_like, shape (heads * d_head, d_model), optional
        The output projection; default random.
    n_heads, d_head : int, default 4 and 2
        The sizes of the random ``head_outputs``.
    seed : int, optional
        Seed of the random values.
    title : str
        The figure's title.

    Returns
    -------
    matplotlib.figure.Figure
        Three panels.

    Raises
    ------
    ValueError
        ``W_o`` without heads * d_head rows.

    Examples
    --------
    >>> fig = concat_projection(seed=0)
    """
    rng = np.random.default_rng(seed)
    if head_outputs is None:
        head_outputs = rng.standard_normal((n_heads, d_head))
    heads = _squeeze_to(_array(head_outputs, "head_outputs"), 2, "head_outputs", "(heads, d_head)")
    n_heads, d_head = heads.shape
    concat = heads.reshape(1, n_heads * d_head)
    if W_o is None:
        W_o = rng.standard_normal((n_heads * d_head, n_heads * d_head)) * 0.3
    W_o = _array(W_o, "W_o")
    if W_o.ndim != 2 or W_o.shape[0] != n_heads * d_head:
        raise ValueError(f"W_o has shape {W_o.shape}: expected ({n_heads * d_head}, d_model)")
    projected = concat @ W_o
    fig = _figure((18, 4))
    axes = fig.subplots(1, 3)
    lim = max(np.abs(heads).max(), np.abs(projected).max(), 1e-12)
    kw = dict(cmap="RdBu", aspect="auto", vmin=-lim, vmax=lim, interpolation="nearest")
    axes[0].imshow(heads, **kw)
    axes[0].set_title(f"Individual Head Outputs\n({n_heads} heads x {d_head} dims)",
                      fontweight="bold")
    axes[0].set_ylabel("Head")
    axes[0].set_xlabel("Dimension")
    axes[0].set_xticks(range(d_head))
    axes[0].set_yticks(range(n_heads))
    axes[0].set_yticklabels([f"Head {i}" for i in range(n_heads)])
    axes[1].imshow(concat, **kw)
    axes[1].set_title(f"After Concatenation\n(1 x {n_heads * d_head} dims)", fontweight="bold")
    axes[1].set_xlabel("Dimension")
    axes[1].set_xticks(range(n_heads * d_head))
    axes[1].set_yticks([])
    for i in range(1, n_heads):
        axes[1].axvline(x=i * d_head - 0.5, color="white", linewidth=2)
    im = axes[2].imshow(projected, **kw)
    axes[2].set_title("After W_o Projection\n(mixed across heads)", fontweight="bold")
    axes[2].set_xlabel("Dimension")
    axes[2].set_xticks(range(projected.shape[1]))
    axes[2].set_yticks([])
    fig.colorbar(im, ax=list(axes), shrink=0.8)
    if title:
        fig.suptitle(title, fontsize=14, fontweight="bold")
    return fig


# --- training and speed ----------------------------------------------------------------------

def _named(values):
    if isinstance(values, Mapping):
        return [str(k) for k in values], list(values.values())
    values = list(values)
    return [str(i) for i in range(len(values))], values


def training_curves(losses: Mapping[str, Sequence[float]] | Sequence[Sequence[float]], *,
                    ax: Axes | None = None, title: str = "Training Loss: Single vs Multi-Head",
                    xlabel: str = "Epoch", ylabel: str = "Loss", log: bool = False,
                    figsize: tuple[float, float] = (8, 5)) -> Figure:
    """Draw loss curves, one line per model.

    Parameters
    ----------
    losses : mapping of str to sequence of float, or sequence of sequences
        E.g. ``{"1 Head": [...], "4 Heads": [...]}``; a sequence is labelled by position.
    ax : matplotlib.axes.Axes, optional
        Draw into these axes instead of a new figure (the figure returned is then ``ax.figure``).
    title : str
        The axes' title.
    xlabel, ylabel : str, default "Epoch" and "Loss"
        The axis labels.
    log : bool, default False
        A logarithmic y axis.
    figsize : tuple of float, default (8, 5)
        The size of a new figure, in inches.

    Returns
    -------
    matplotlib.figure.Figure
        The figure (built without pyplot: ``fig.savefig(path)`` writes it, Jupyter shows it).

    Examples
    --------
    >>> fig = training_curves({"1 Head": [1.0, 0.5, 0.3], "4 Heads": [1.0, 0.3, 0.1]})
    """
    names, curves = _named(losses)
    fig, ax = _figure_and_ax(ax, figsize)
    for name, curve, color in zip(names, curves, _cycle(len(names))):
        ax.plot(np.asarray(curve, dtype=float), label=name, alpha=0.85, linewidth=2, color=color)
    if log:
        ax.set_yscale("log")
    ax.set_xlabel(xlabel, fontsize=12)
    ax.set_ylabel(ylabel, fontsize=12)
    ax.set_title(title, fontsize=13, fontweight="bold")
    ax.legend(fontsize=11)
    ax.grid(True, alpha=0.3)
    return fig


def _cycle(n):
    return [_COLORS[i % len(_COLORS)] for i in range(n)]


def _bars(ax, names, values, labels, ylabel, title):
    bars = ax.bar(names, values, color=_cycle(len(names)), edgecolor="black", linewidth=1.2)
    top = max([v for v in values if np.isfinite(v)] + [0.0])
    for bar, text in zip(bars, labels):
        ax.text(bar.get_x() + bar.get_width() / 2, bar.get_height() + 0.015 * (top or 1.0),
                text, ha="center", va="bottom", fontsize=11, fontweight="bold")
    ax.set_ylabel(ylabel, fontsize=12)
    ax.set_title(title, fontsize=13, fontweight="bold")
    ax.grid(True, alpha=0.3, axis="y")
    ax.set_axisbelow(True)
    return bars


def accuracy_bars(accuracies: Mapping[str, float] | Sequence[float], *, ax: Axes | None = None,
                  title: str = "Test Accuracy Comparison", ylabel: str = "Test Accuracy",
                  figsize: tuple[float, float] = (8, 5)) -> Figure:
    """Draw accuracy (0..1) per model as labelled bars.

    Parameters
    ----------
    accuracies : mapping of str to float, or sequence of float
        E.g. ``{"1 Head": 0.71, "4 Heads": 0.98}``.
    ax : matplotlib.axes.Axes, optional
        Draw into these axes instead of a new figure (the figure returned is then ``ax.figure``).
    title : str
        The axes' title.
    ylabel : str, default "Test Accuracy"
        The y axis label.
    figsize : tuple of float, default (8, 5)
        The size of a new figure, in inches.

    Returns
    -------
    matplotlib.figure.Figure
        The figure (built without pyplot: ``fig.savefig(path)`` writes it, Jupyter shows it).

    Examples
    --------
    >>> fig = accuracy_bars({"1 Head": 0.71, "4 Heads": 0.98})
    """
    names, values = _named(accuracies)
    values = [float(v) for v in values]
    fig, ax = _figure_and_ax(ax, figsize)
    _bars(ax, names, values, [f"{v:.1%}" for v in values], ylabel, title)
    ax.set_ylim(0, 1.05 if max(values + [0]) <= 1 else max(values) * 1.1)
    return fig


def training_summary(losses: Mapping[str, Sequence[float]], accuracies: Mapping[str, float], *,
                     figsize: tuple[float, float] = (16, 5)) -> Figure:
    """Draw seed 000's two panels: loss curves and test-accuracy bars.

    Parameters
    ----------
    losses : mapping of str to sequence of float
        As in :func:`training_curves`.
    accuracies : mapping of str to float
        As in :func:`accuracy_bars`.
    figsize : tuple of float, default (16, 5)
        The size of the figure, in inches.

    Returns
    -------
    matplotlib.figure.Figure
        Two panels.

    Examples
    --------
    >>> fig = training_summary({"1 Head": [1.0, 0.4]}, {"1 Head": 0.9})
    """
    fig = _figure(figsize)
    ax_loss, ax_acc = fig.subplots(1, 2)
    training_curves(losses, ax=ax_loss)
    accuracy_bars(accuracies, ax=ax_acc)
    return fig


def speed_bars(times: Mapping[str, float] | Sequence[float], *, ax: Axes | None = None, unit: str = "ms",
               title: str = "Inference Time: Single vs Multi-Head Attention\n"
                            "(Same parameters, similar speed)",
               figsize: tuple[float, float] = (10, 5)) -> Figure:
    """Draw the time per configuration as labelled bars.

    Parameters
    ----------
    times : mapping of str to float, or sequence of float
        E.g. ``{"1 Head": 3.1, "4 Heads": 3.3}``, in ``unit``.
    ax : matplotlib.axes.Axes, optional
        Draw into these axes instead of a new figure (the figure returned is then ``ax.figure``).
    unit : str, default "ms"
        The unit of the times, written on the bars and the axis.
    title : str
        The axes' title.
    figsize : tuple of float, default (10, 5)
        The size of a new figure, in inches.

    Returns
    -------
    matplotlib.figure.Figure
        The figure (built without pyplot: ``fig.savefig(path)`` writes it, Jupyter shows it).

    Examples
    --------
    >>> fig = speed_bars({"1 Head": 3.1, "4 Heads": 3.3})
    """
    names, values = _named(times)
    values = [float(v) for v in values]
    fig, ax = _figure_and_ax(ax, figsize)
    _bars(ax, names, values, [f"{v:.2f} {unit}" for v in values], f"Time ({unit})", title)
    ax.set_ylim(0, max(values + [0]) * 1.15 or 1.0)
    return fig


def pruning_plot(curve: analysis.PruningCurve, *, ax: Axes | None = None, title: str = "Iterative Head Pruning",
                 metric_name: str = "Accuracy", figsize: tuple[float, float] = (8, 5)) -> Figure:
    """Draw the metric against the fraction of heads pruned, with the tolerated drop.

    Parameters
    ----------
    curve : mha.analysis.PruningCurve
        From :func:`mha.analysis.pruning_curve`.
    ax : matplotlib.axes.Axes, optional
        Draw into these axes instead of a new figure (the figure returned is then ``ax.figure``).
    title : str, default "Iterative Head Pruning"
        The axes' title.
    metric_name : str, default "Accuracy"
        The y axis label and legend entry.
    figsize : tuple of float, default (8, 5)
        The size of a new figure, in inches.

    Returns
    -------
    matplotlib.figure.Figure
        The figure (built without pyplot: ``fig.savefig(path)`` writes it, Jupyter shows it).

    Examples
    --------
    >>> value = np.array([0.5, 0.1, 0.3, 0.1])
    >>> fig = pruning_plot(mha.analysis.pruning_curve(lambda m: float(m @ value), 4, step=1))
    """
    fig, ax = _figure_and_ax(ax, figsize)
    x = 100.0 * curve.n_pruned / curve.n_heads
    ax.plot(x, curve.metric, "o-", color=_COLORS[1], linewidth=2, label=metric_name)
    tol = curve.max_drop * abs(curve.baseline) if curve.relative else curve.max_drop
    edge = curve.baseline - tol if curve.higher_is_better else curve.baseline + tol
    ax.axhline(edge, color=_COLORS[0], linestyle="--", linewidth=1.5,
               label=f"baseline {'-' if curve.higher_is_better else '+'} "
                     f"{curve.max_drop:g}{' (relative)' if curve.relative else ''}")
    ax.axvline(100.0 * curve.prunable / curve.n_heads, color=_COLORS[2], linestyle=":",
               linewidth=2, label=f"{curve.prunable}/{curve.n_heads} heads prunable")
    ax.set_xlabel("Heads pruned (%)", fontsize=12)
    ax.set_ylabel(metric_name, fontsize=12)
    ax.set_title(title, fontsize=13, fontweight="bold")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=10)
    return fig


# --- animation -------------------------------------------------------------------------------

class AnimatedGIF:
    """Hold GIF bytes with a Jupyter display.

    Parameters
    ----------
    data : bytes
        The GIF file's bytes.
    n_frames : int
        The number of frames.

    Examples
    --------
    >>> w = np.full((2, 1, 3, 3), 1 / 3)
    >>> gif = attention_gif(w)
    >>> gif.n_frames, gif.data[:6]
    (2, b'GIF89a')
    """

    def __init__(self, data: bytes, n_frames: int):
        self.data = data
        self.n_frames = n_frames

    def save(self, path: str | os.PathLike[str]) -> str:
        """Write the GIF to a file.

        Parameters
        ----------
        path : str or os.PathLike
            Where to write.

        Returns
        -------
        str
            The path written.
        """
        path = os.fspath(path)
        with open(path, "wb") as f:
            f.write(self.data)
        return path

    def _repr_html_(self):
        b64 = base64.b64encode(self.data).decode("ascii")
        return f'<img src="data:image/gif;base64,{b64}" alt="attention across layers"/>'

    def __repr__(self):
        return f"<AnimatedGIF: {self.n_frames} frames, {len(self.data)} bytes>"


def attention_gif(attentions: ArrayLike, tokens: Sequence[str] | None = None,
                  path: str | os.PathLike[str] | None = None, *, head: int | str = 0,
                  fps: float = 2.0, cmap: str | Colormap = "Blues", vmax: float | None = None,
                  annot: bool | None = None, figsize: tuple[float, float] = (7, 6),
                  dpi: int = 80) -> AnimatedGIF:
    """Animate one head (or the sum or mean of heads) across layers, one frame per layer.

    Parameters
    ----------
    attentions : array_like, shape (layers, heads, n, n), or list of arrays
        Attention weights of every layer, rows = queries; a list of per-layer arrays (Hugging
        Face's ``outputs.attentions`` works) is stacked.
    tokens : sequence of str, optional
        The token labels.
    path : str or os.PathLike, optional
        Also write the GIF there.
    head : int or {"sum", "mean"}, default 0
        The head to show, or the sum or mean of the heads.
    fps : float, default 2.0
        Frames per second.
    cmap : str, default "Blues"
        The colour map.
    vmax : float, optional
        The top of the colour scale shared by all frames (default: the largest value shown).
    annot : bool, optional
        Write the values in the cells; by default for at most 12 tokens.
    figsize : tuple of float, default (7, 6)
        The size of a frame, in inches.
    dpi : int, default 80
        The resolution of a frame.

    Returns
    -------
    AnimatedGIF
        The GIF, shown inline in Jupyter.

    Raises
    ------
    ValueError
        A shape that is not (layers, heads, n, n).

    Examples
    --------
    >>> w = np.random.default_rng(0).random((3, 2, 4, 4))
    >>> attention_gif(w / w.sum(-1, keepdims=True), head="mean").n_frames
    3
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from PIL import Image

    if isinstance(attentions, (list, tuple)):
        attentions = np.stack([_squeeze_to(_array(a), 3, "attentions[l]", "(heads, n, n)")
                               for a in attentions])
    values = _squeeze_to(_array(attentions, "attentions"), 4, "attentions",
                         "(layers, heads, n, n)")
    if head == "sum":
        frames, what = values.sum(axis=1), "Sum of heads"
    elif head == "mean":
        frames, what = values.mean(axis=1), "Mean of heads"
    else:
        frames, what = values[:, int(head)], f"Head {int(head)}"
    n = frames.shape[-1]
    labels = _labels(tokens, n, "tokens")
    vmax = float(np.nanmax(frames)) if vmax is None else vmax
    if annot is None:
        annot = n <= 12
    import matplotlib as mpl
    colormap = mpl.colormaps[cmap] if isinstance(cmap, str) else cmap
    fig = _figure(figsize, dpi)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    im, texts = _matrix(ax, frames[0], x_labels=labels, y_labels=labels, cmap=colormap, vmin=0.0,
                        vmax=vmax, annot=annot, fmt=".2f", colorbar=True,
                        title=f"Layer 0 - {what}", xlabel="Key (attending to)",
                        ylabel="Query (attending from)")
    fig.canvas.draw()                        # lay out once, then only repaint the data
    fig.set_layout_engine("none")
    images = []
    for layer, frame in enumerate(frames):
        im.set_data(frame)
        ax.set_title(f"Layer {layer} - {what}", fontsize=12, fontweight="bold")
        for text, v in zip(texts, frame.ravel()):
            label, color = _cell_text(v, ".2f", colormap, 0.0, vmax)
            text.set_text(label)
            text.set_color(color)
        fig.canvas.draw()
        rgba = np.asarray(fig.canvas.buffer_rgba())
        images.append(Image.fromarray(rgba[..., :3].copy()).convert(
            "P", palette=Image.Palette.ADAPTIVE, colors=255))
    buffer = io.BytesIO()
    images[0].save(buffer, format="GIF", save_all=True, append_images=images[1:],
                   duration=int(round(1000.0 / fps)), loop=0, optimize=False)
    gif = AnimatedGIF(buffer.getvalue(), len(images))
    if path is not None:
        gif.save(path)
    return gif


# --- beyond raw attention: head map and the tour's figures -------------------------------------

def head_map(attentions: ArrayLike | None = None, *, points: ArrayLike | None = None,
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
        points, _ = analysis.head_map(attentions)
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


BEYOND_TEXT = "The doctor said that she would help the patient, because she is kind."
CLARK_TEXTS = (
    "The doctor said that she would help the patient, because she is kind.",
    "The man saw the astronomer with a telescope.",
    "Time flies like an arrow; fruit flies like a banana.",
    "After the storm, the river rose and the old bridge, built in 1890, was closed.",
    "She gave him the book that he had asked for, and he thanked her.",
    "Researchers found that many attention heads attend to the separator token.",
)


def _special_keys(tokens):
    classes = analysis.token_classes(list(tokens))
    return classes["cls"] | classes["sep"]


def beyond_attention_figure(model: TransformerModel, text: str = BEYOND_TEXT, *, layer: int = -1,
                            figsize: tuple[float, float] = (17, 4.8)) -> Figure:
    """Draw four views of what a layer's positions draw on, side by side, for one text.

    The views are raw attention (mean over heads), attention rollout, attention flow and the
    value norms summed over heads (Abnar & Zuidema 2020; Kobayashi et al. 2020).

    Parameters
    ----------
    model : mha.models.TransformerModel
        A loaded model, e.g. ``mha.models.load("minilm")``.
    text : str
        The text (default a sentence of the tour).
    layer : int, default -1
        The layer shown for raw weights and value norms (rollout and flow end there too).
    figsize : tuple of float, default (17, 4.8)
        The size of the figure, in inches.

    Returns
    -------
    matplotlib.figure.Figure
        Four panels.

    Examples
    --------
    >>> model = mha.models.load("minilm")
    >>> fig = beyond_attention_figure(model, "The cat sat on the mat.")
    """
    tokens, att = model.attentions(text)
    _, norms = model.attention_norms(text, summed=True)
    L = att.shape[0]
    layer = layer % L
    raw = att[layer].mean(axis=0)
    rollout = analysis.attention_rollout(att[:layer + 1])[-1]
    flow = analysis.attention_flow(att[:layer + 1])
    norm = norms[layer] / norms[layer].sum(axis=-1, keepdims=True)
    fig = _figure(figsize)
    axes = fig.subplots(1, 4)
    panels = [(raw, f"Raw attention, layer {layer}\n(mean of heads)"),
              (rollout, f"Rollout, layers 0-{layer}"), (flow, f"Attention flow, layers 0-{layer}"),
              (norm, f"Value norms ||Σ_h α f_h(x)||, layer {layer}\n(rows scaled to sum 1)")]
    for ax, (values, name) in zip(axes, panels):
        _matrix(ax, values, x_labels=tokens, y_labels=tokens, cmap="Blues", vmin=0.0,
                vmax=float(values.max()), annot=False, fmt=".2f", colorbar=False, title=None,
                label_rotation=90, fontsize=min(7.0, _label_size(len(tokens))))
        ax.set_title(name, fontsize=10, fontweight="bold")
    fig.suptitle("What each position draws on: raw weights, rollout, flow, value norms",
                 fontsize=13, fontweight="bold")
    return fig


def special_token_shares(model: TransformerModel, texts: str | Sequence[str] = CLARK_TEXTS,
                         ) -> dict[str, Any]:
    """Compare, per layer, the attention weight and the value norm that go to [CLS]/[SEP].

    This is Kobayashi et al.'s (2020) comparison: the shares are means over queries, heads and
    texts.

    Parameters
    ----------
    model : mha.models.TransformerModel
        A loaded model.
    texts : str or sequence of str
        The texts (default the tour's).

    Returns
    -------
    dict
        ``"weight"``, ``"norm"``: (L,) shares per layer (heads averaged; norm shares of each
        head's own norms); ``"norm_summed"``: (L,) the same for the norm summed over heads;
        ``"overall"``: dict of the three averaged over layers.

    Examples
    --------
    >>> shares = special_token_shares(mha.models.load("minilm"), ["The cat sat on the mat."])
    >>> shares["weight"].shape
    (6,)
    """
    weight, norm, summed = [], [], []
    for text in ([texts] if isinstance(texts, str) else texts):
        tokens, _, _, v = model.qkv(text)                   # two forward passes a text, not five
        _, att = model.attentions(text)
        W_o = [model.output_projection(l)[0] for l in range(model.n_layers)]
        per_head = np.stack([analysis.value_norms(att[l], v[l], W_o[l]) for l in range(len(W_o))])
        total = np.stack([analysis.value_norms(att[l], v[l], W_o[l], summed=True) for l in range(len(W_o))])
        keys = _special_keys(tokens)
        weight.append(analysis.attention_mass(att, keys).mean(axis=-1))
        norm.append(analysis.attention_mass(per_head, keys, normalize=True).mean(axis=-1))
        summed.append(analysis.attention_mass(total, keys, normalize=True))
    out = {"weight": np.mean(weight, axis=0), "norm": np.mean(norm, axis=0),
           "norm_summed": np.mean(summed, axis=0)}
    out["overall"] = {k: float(v.mean()) for k, v in out.items()}
    return out


def kobayashi_figure(model: TransformerModel, texts: str | Sequence[str] = CLARK_TEXTS, *,
                     shares: Mapping[str, Any] | None = None,
                     figsize: tuple[float, float] = (8, 4.8)) -> Figure:
    """Draw per layer the share of weight and of value norm on [CLS]/[SEP] as bars.

    Kobayashi et al. (2020) find much weight but little norm on these tokens.

    Parameters
    ----------
    model : mha.models.TransformerModel
        A loaded model.
    texts : str or sequence of str
        The texts (default the tour's).
    shares : dict, optional
        From :func:`special_token_shares` (computed on ``texts`` when None).
    figsize : tuple of float, default (8, 4.8)
        The size of the figure, in inches.

    Returns
    -------
    matplotlib.figure.Figure
        The bars.

    Examples
    --------
    >>> fig = kobayashi_figure(mha.models.load("minilm"), ["The cat sat on the mat."])
    """
    shares = special_token_shares(model, texts) if shares is None else shares
    L = len(shares["weight"])
    fig, ax = _figure_and_ax(None, figsize)
    x = np.arange(L)
    ax.bar(x - 0.27, shares["weight"], 0.27, label="weight α", color=_COLORS[1])
    ax.bar(x, shares["norm"], 0.27, label="norm ||α f_h(x)||, per head", color=_COLORS[0])
    ax.bar(x + 0.27, shares["norm_summed"], 0.27, label="norm ||Σ_h α f_h(x)||", color=_COLORS[3])
    ax.set_xticks(x)
    ax.set_xlabel("Layer")
    ax.set_ylabel("Share on [CLS] and [SEP]")
    ax.set_ylim(0, 1)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=9)
    ax.set_title("Attention weight vs value norm on [CLS]/[SEP]", fontsize=12, fontweight="bold")
    return fig


def clark_metrics_figure(model: TransformerModel, texts: str | Sequence[str] = CLARK_TEXTS, *,
                         metrics: Mapping[str, np.ndarray] | None = None,
                         figsize: tuple[float, float] = (16, 6.4)) -> Figure:
    """Draw Clark et al.'s (2019) statistics of every head as (layer x head) heatmaps.

    The panels are the attention to [CLS], [SEP], punctuation, the previous and the next token,
    and the entropy.

    Parameters
    ----------
    model : mha.models.TransformerModel
        A loaded model.
    texts : str or sequence of str
        The texts (default the tour's).
    metrics : dict, optional
        From :func:`mha.analysis.clark_metrics` of a batch (computed on ``texts`` when None).
    figsize : tuple of float, default (16, 6.4)
        The size of the figure, in inches.

    Returns
    -------
    matplotlib.figure.Figure
        Six panels.

    Examples
    --------
    >>> fig = clark_metrics_figure(mha.models.load("minilm"), ["The cat sat on the mat."])
    """
    if metrics is None:
        enc = model.encode(list(texts))
        metrics = analysis.clark_metrics(enc.attentions, enc.tokens, attention_mask=enc.attention_mask,
                                         causal=model.causal)
    names = [("mass_cls", "to [CLS]"), ("mass_sep", "to [SEP]"), ("mass_punct", "to punctuation"),
             ("mass_prev", "to previous token"), ("mass_next", "to next token"),
             ("entropy", "entropy (nats)")]
    fig = _figure(figsize)
    axes = fig.subplots(2, 3).ravel()
    L, H = metrics["entropy"].shape
    for ax, (key, label) in zip(axes, names):
        values = metrics[key]
        vmax = float(metrics["uniform_entropy"].max()) if key == "entropy" else 1.0
        im = ax.imshow(values, cmap="magma_r" if key != "entropy" else "viridis", vmin=0, vmax=vmax,
                       aspect="auto", interpolation="nearest")
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


def head_map_figure(model: TransformerModel, texts: str | Sequence[str] = CLARK_TEXTS, *,
                    figsize: tuple[float, float] = (7.5, 6.5)) -> Figure:
    """Draw :func:`head_map` of a model's heads over a few texts, coloured by mean entropy.

    Parameters
    ----------
    model : mha.models.TransformerModel
        A loaded model.
    texts : str or sequence of str
        The texts (default the tour's).
    figsize : tuple of float, default (7.5, 6.5)
        The size of the figure, in inches.

    Returns
    -------
    matplotlib.figure.Figure
        The map.

    Examples
    --------
    >>> fig = head_map_figure(mha.models.load("minilm"), ["The cat sat.", "A dog ran."])
    """
    enc = model.encode(list(texts))
    metrics = analysis.clark_metrics(enc.attentions, enc.tokens, attention_mask=enc.attention_mask,
                                     causal=model.causal)
    return head_map(enc.attentions, color=metrics["entropy"], color_label="mean entropy (nats)",
                    figsize=figsize)
