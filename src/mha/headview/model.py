"""The model view: every layer x head as a thumbnail; one opens large (model.js)."""
from __future__ import annotations

import os
from typing import Any, Sequence

import numpy as np
from numpy.typing import ArrayLike

from . import _data
from ._page import HTMLView, picture_view, write_page


class ModelView(HTMLView):
    """Hold a rendered model view (see :func:`model_view`).

    Parameters
    ----------
    page : str
        The whole standalone HTML page.
    height : int
        The height of the iframe in Jupyter, in pixels.
    payload_bytes : int
        The base64 characters of the data in the page.
    **info
        The view's sizes, kept as attributes (``n_layers``, ``n_heads``, ``n_tokens``, ...).

    Attributes
    ----------
    html : str
        The whole page.
    """
    kind = "model view"


def _thumbnails(values: np.ndarray, size: int) -> tuple[np.ndarray, tuple[int, int]]:
    """Block-max pooling of (L, H, n_q, n_k) to at most size x size cells (peaks stay
    visible) -> (pooled (L, H, tq, tk), (tq, tk))."""
    values = np.nan_to_num(values, nan=0.0, posinf=0.0, neginf=0.0)
    L, H, n_q, n_k = values.shape
    bq, bk = -(-n_q // size), -(-n_k // size)
    tq, tk = -(-n_q // bq), -(-n_k // bk)
    padded = np.zeros((L, H, tq * bq, tk * bk))
    padded[:, :, :n_q, :n_k] = values
    return padded.reshape(L, H, tq, bq, tk, bk).max(axis=(3, 5)), (tq, tk)


def thumbnail_bytes(pooled: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each thumbnail on its own colour scale: round(255 sqrt(v / top)), top its largest value.

    Scaled to its own top, every head reaches the darkest colour, however long the text (at 43
    tokens a diffuse head's largest weight may be 0.1); the square root lifts the weights near
    the row average (1/n) off white. Returns (uint8 (L, H, tq, tk), top (L, H)).
    """
    top = pooled.max(axis=(2, 3))
    safe = np.where(top > 0, top, 1.0)[:, :, None, None]
    scaled = np.sqrt(np.clip(pooled / safe, 0.0, 1.0))
    return np.rint(scaled * 255.0).astype(np.uint8), top


def model_view(attention: ArrayLike, tokens: Sequence[str] | None,
               key_tokens: Sequence[str] | None = None, *, rollout: bool | ArrayLike | None = None,
               norms: ArrayLike | None = None, title: str | None = None,
               path: str | os.PathLike[str] | None = None, thumbnail: int = 64,
               compression: int = 3) -> ModelView:
    """Every layer x head as a thumbnail (BertViz's model view); click one to open it large.

    The large view is the head's full (n_q, n_k) heatmap with the tokens on its axes, coloured
    linearly from 0 to the head's largest value: hover a cell for the query, key and value;
    step through heads and layers with the arrow keys. The thumbnails are max-pooled to at most
    ``thumbnail`` x ``thumbnail`` cells, so 512 tokens x 12 layers x 12 heads open at once; each
    is coloured from 0 to its own largest value on a square-root scale, so that every head
    shows its pattern at any length (hover a thumbnail for that value). Each layer's full data
    is inflated when one of its heads is opened. PNG and SVG export.

    Parameters
    ----------
    attention : array_like, shape (layers, heads, n_q, n_k)
        As for :func:`head_view`.
    tokens, key_tokens : sequences of str
        Query tokens; key tokens for cross-attention.
    rollout, norms : optional
        Extra pictures to switch to, as for :func:`head_view`.
    title : str, optional
        Shown above the picture (and in exported images).
    path : str or path-like, optional
        Also save the page there.
    thumbnail : int
        The largest thumbnail side, in cells.
    compression : int
        The zlib level of the data (0 to 9).

    Returns
    -------
    ModelView
        Jupyter displays it inline; ``.save(path)``; ``.html``.

    Raises
    ------
    ValueError
        Token counts or shapes that do not fit.

    Examples
    --------
    >>> w = np.full((2, 3, 4, 4), 0.25)
    >>> model_view(w, ["a", "b", "c", "d"]).n_heads
    3
    """
    att, tokens, key_tokens = _data.view_inputs(attention, tokens, key_tokens)
    L, H, n_q, n_k = att.shape
    pictures = _data.pictures(att, rollout, norms)
    sources = _data.sources(pictures, compression)
    for src, (_, _, _, values) in zip(sources, pictures):
        pooled, shape = _thumbnails(values, int(thumbnail))
        thumbs, top = thumbnail_bytes(pooled)
        src.update(thumbs=_data.packed(thumbs, compression), thumb_shape=list(shape),
                   thumb_top=top.tolist())
    payload: dict[str, Any] = {"kind": "model", "n_layers": L, "n_heads": H, "n_q": n_q, "n_k": n_k,
               "tokens": tokens, "key_tokens": key_tokens, "title": title or "",
               "sources": sources}
    page = write_page("model", payload, title or "mha model view")
    return picture_view(ModelView, page, int(min(160 + L * 84, 900)), sources, att.shape, path)
