"""Attention and relevance over an image: :func:`image_attention`.

A vision transformer's tokens are a few prefix tokens (CLS, DeiT's distillation token,
registers) and then the patches row by row; a map over the tokens (one row of an attention
matrix, of rollout, of gradient relevance) is drawn over the image by reshaping its patch
part to the patch grid and stretching it over the picture.
"""
from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import numpy as np

from ._common import _figure

__all__ = ["image_attention", "patch_map"]


def _as_picture(image: Any) -> np.ndarray:
    """An image to show: PIL, uint8 (H, W, 3), or pixel values (3, H, W) / (1, 3, H, W)
    (normalised ones are rescaled to [0, 1] per image for display)."""
    if hasattr(image, "convert") and hasattr(image, "size"):           # a PIL image
        return np.asarray(image.convert("RGB"))
    array = np.asarray(image)
    while array.ndim == 4 and array.shape[0] == 1:
        array = array[0]
    if array.ndim == 3 and array.shape[0] in (1, 3) and array.shape[-1] not in (1, 3):
        array = array.transpose(1, 2, 0)
    if array.ndim != 3 or array.shape[-1] not in (1, 3):
        raise ValueError(f"image must be a PIL image, (H, W, 3) or pixel values (3, H, W), "
                         f"got shape {array.shape}")
    if array.dtype == np.uint8:
        return array
    array = array.astype(np.float64)
    low, high = array.min(), array.max()
    return (array - low) / (high - low) if high > low else np.zeros_like(array)


def _infer_layout(n: int, aspect: float) -> tuple[int, tuple[int, int]]:
    """(n_prefix, (rows, cols)) of n tokens: the fewest prefix tokens (up to 16) that leave a
    grid of the image's aspect ratio rows / cols (a square one for a square image)."""
    for prefix in range(min(n, 17)):
        count = n - prefix
        rows = round(math.sqrt(count * aspect))
        if rows > 0 and count % rows == 0 and abs(rows / (count // rows) - aspect) < 1e-9 + (
                0 if aspect == 1 else 0.25 * aspect):
            return prefix, (rows, count // rows)
    raise ValueError(f"cannot tell the patch grid of {n} tokens: pass grid= and n_prefix=")


def patch_map(values: Any, *, grid: tuple[int, int] | None = None,
              n_prefix: int | None = None, query: int = 0, aspect: float = 1.0
              ) -> np.ndarray:
    """Turn a map over an image's tokens into a (rows, cols) map over its patches.

    Parameters
    ----------
    values : array_like, shape (n, n), (n,) or (rows, cols)
        A token-by-token matrix (attention, rollout, relevance: row ``query`` is taken), a
        vector over the tokens, or a map already on the grid (returned as it is).
    grid : (int, int), optional
        The patch grid (default: inferred from the count, square or of ``aspect``).
    n_prefix : int, optional
        The tokens before the patches (CLS, distillation token, registers); default: what the
        grid leaves.
    query : int, default 0
        The row of a matrix to show (0: CLS).
    aspect : float, default 1.0
        The image's height / width, to infer a grid.

    Returns
    -------
    ndarray of float64, shape (rows, cols)
        The values on the patches (the prefix tokens' left out).

    Raises
    ------
    ValueError
        Values that do not fit the grid, or a grid that cannot be inferred.

    Examples
    --------
    >>> from mha.viz import patch_map
    >>> patch_map(np.arange(17.0)).shape                     # CLS + 4 x 4 patches
    (4, 4)
    >>> patch_map(np.eye(21)[0] + 1, n_prefix=5)[0, 0]       # CLS + 4 registers
    1.0
    """
    array = np.asarray(values, dtype=np.float64)
    while array.ndim > 2 and array.shape[0] == 1:
        array = array[0]
    if array.ndim == 2 and array.shape[0] == array.shape[1] and (
            grid is None or array.shape != tuple(grid)):
        if not -array.shape[0] <= query < array.shape[0]:
            raise IndexError(f"query {query} is outside the {array.shape[0]} tokens")
        array = array[query]
    elif array.ndim == 2:
        if grid is not None and array.shape != tuple(grid):
            raise ValueError(f"a map of shape {array.shape} does not match grid {grid}")
        return array
    if array.ndim != 1:
        raise ValueError(f"values must have shape (n, n), (n,) or (rows, cols), got "
                         f"{np.shape(values)}")
    n = len(array)
    if grid is None:
        if n_prefix is None:
            n_prefix, grid = _infer_layout(n, aspect)
        else:
            count = n - n_prefix
            rows = max(1, round(math.sqrt(max(count, 0) * aspect)))
            if count <= 0 or count % rows:
                raise ValueError(f"{count} patches make no grid of the image's aspect: pass "
                                 f"grid=")
            grid = (rows, count // rows)
    elif n_prefix is None:
        n_prefix = n - grid[0] * grid[1]
    if n_prefix < 0 or n - n_prefix != grid[0] * grid[1]:
        raise ValueError(f"{n} tokens do not hold {n_prefix} prefix tokens and a "
                         f"{grid[0]} x {grid[1]} grid")
    return array[n_prefix:].reshape(grid)


def image_attention(image: Any, relevance_or_maps: Any, *,
                    grid: tuple[int, int] | None = None, n_prefix: int | None = None,
                    query: int = 0, titles: Sequence[str] | None = None, alpha: float = 0.6,
                    cmap: str = "inferno", figsize: tuple[float, float] | None = None) -> Any:
    """Draw a map over an image's patches on top of the image.

    The CLS token's row of a relevance matrix (:func:`mha.analysis.gradient_relevance`),
    of rollout (:func:`mha.analysis.attention_rollout`) or of one head's attention, or a
    vector over the tokens, is reshaped to the patch grid and stretched over the picture,
    beside the picture alone. Several maps (a list, or a dict by title) make one panel each.

    Parameters
    ----------
    image : PIL.Image, ndarray of uint8 (H, W, 3), or pixel values (3, H, W)
        The picture (normalised pixel values are rescaled to [0, 1] for display).
    relevance_or_maps : array_like, or list or dict of array_like
        Each a matrix (n, n) (its row ``query``), a vector (n,) over the tokens, or a map
        (rows, cols) on the patch grid.
    grid : (int, int), optional
        The patch grid (default: inferred from the token count and the image's aspect).
    n_prefix : int, optional
        The tokens before the patches (CLS 1, DeiT 2, 1 + registers).
    query : int, default 0
        The row of a matrix (0: CLS).
    titles : sequence of str, optional
        One per map (a dict's keys by default).
    alpha : float, default 0.6
        The opacity of the map.
    cmap : str, default "inferno"
        The colormap.
    figsize : (float, float), optional
        The figure's size (default: 3 inches a panel).

    Returns
    -------
    matplotlib.figure.Figure
        The image, then one panel per map.

    Raises
    ------
    ValueError
        An image or a map of the wrong shape, or a grid that cannot be inferred.

    Examples
    --------
    >>> from mha.viz import image_attention
    >>> image = np.random.default_rng(0).integers(0, 256, (32, 32, 3), dtype=np.uint8)
    >>> relevance = np.random.default_rng(1).random((17, 17))     # CLS + 4 x 4 patches
    >>> fig = image_attention(image, {"relevance": relevance, "rollout": relevance.T})
    >>> len(fig.axes)                   # the image, two maps and their colorbars
    5
    """
    picture = _as_picture(image)
    height, width = picture.shape[:2]
    if isinstance(relevance_or_maps, Mapping):
        names = list(relevance_or_maps)
        maps = [relevance_or_maps[k] for k in names]
        titles = list(titles) if titles is not None else [str(k) for k in names]
    elif isinstance(relevance_or_maps, (list, tuple)):
        maps = list(relevance_or_maps)
    else:
        maps = [relevance_or_maps]
    if titles is None:
        titles = ["relevance"] if len(maps) == 1 else [f"map {i}" for i in range(len(maps))]
    if len(titles) != len(maps):
        raise ValueError(f"{len(titles)} titles for {len(maps)} maps")
    grids = [patch_map(m, grid=grid, n_prefix=n_prefix, query=query, aspect=height / width)
             for m in maps]
    fig = _figure(figsize or (3.0 * (len(grids) + 1), 3.2))
    axes = fig.subplots(1, len(grids) + 1, squeeze=False)[0]
    axes[0].imshow(picture)
    axes[0].set_title("image")
    for ax, values, title in zip(axes[1:], grids, titles):
        ax.imshow(picture)
        shown = ax.imshow(values, cmap=cmap, alpha=alpha, extent=(0, width, height, 0),
                          interpolation="nearest")
        fig.colorbar(shown, ax=ax, shrink=0.8)
        ax.set_title(title)
    for ax in axes:
        ax.set_xticks([])
        ax.set_yticks([])
    return fig
