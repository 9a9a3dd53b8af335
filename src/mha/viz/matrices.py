"""Attention matrices: one head, every head of a layer, head-by-head similarity, a mask, and
how heads' outputs are concatenated and projected."""
from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import numpy as np
from numpy.typing import ArrayLike

if TYPE_CHECKING:                        # matplotlib is imported when a figure is drawn
    from matplotlib.axes import Axes
    from matplotlib.colors import Colormap
    from matplotlib.figure import Figure

from .. import analysis
from ._common import _array, _figure, _figure_and_ax, _label_size, _labels, _matrix, _squeeze_to


def heatmap(weights: ArrayLike, tokens: Sequence[str] | None = None, key_tokens: Sequence[str] | None = None, *,
            title: str = "Attention Weights", ax: Axes | None = None, annot: bool | None = None,
            fmt: str = ".2f", cmap: str | Colormap = "Blues", vmin: float = 0.0,
            vmax: float | None = 1.0, colorbar: bool = True, xlabel: str = "Key (attending to)",
            ylabel: str = "Query (attending from)", figsize: tuple[float, float] = (8, 6),
            ) -> Figure:
    """Draw one attention matrix as an annotated heatmap.

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
    """Draw every head of one layer side by side.

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
    """Draw the head-by-head similarity of each layer (how diverse its heads are).

    Parameters
    ----------
    weights : array_like, shape (layers, heads, n, n) or (heads, n, n)
        Attention weights, rows = queries.
    layers : sequence of int, optional
        The layers to show (default all).
    metric : {"cosine", "js"}, default "cosine"
        Cosine similarity of the heads' weights (:func:`mha.analysis.head_similarity`) or
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
    """Draw a mask: 1 = may attend, 0 = masked.

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
        m = _squeeze_to(_array(mask, "mask"), 2, "mask", "(n_q, n_k)")
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
    """Draw how heads combine: per-head outputs, their concatenation, and W_o's mix.

    Parameters
    ----------
    head_outputs : array_like, shape (heads, d_head), optional
        One token's output of every head (e.g. ``O[b, :, i, :]``); default random values
        (standard normal).
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
    mix = _array(W_o, "W_o")
    if mix.ndim != 2 or mix.shape[0] != n_heads * d_head:
        raise ValueError(f"W_o has shape {mix.shape}: expected ({n_heads * d_head}, d_model)")
    projected = concat @ mix
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
