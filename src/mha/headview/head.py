"""The head view: two columns of tokens joined by one line per head and pair (head.js)."""
from __future__ import annotations

import os
from typing import Any, Iterable, Sequence

from numpy.typing import ArrayLike

from . import _data
from ._page import HTMLView, picture_view, write_page


class HeadView(HTMLView):
    """Hold a rendered head view (see :func:`head_view`).

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

    Examples
    --------
    >>> view = head_view(np.full((1, 2, 3, 3), 1 / 3), ["a", "b", "c"])
    >>> view.html.startswith("<!DOCTYPE html>"), view.n_heads
    (True, 2)
    """
    kind = "head view"


def head_view(attention: ArrayLike, tokens: Sequence[str] | None,
              key_tokens: Sequence[str] | None = None, *, sentence_b_start: int | None = None,
              rollout: bool | ArrayLike | None = None, norms: ArrayLike | None = None,
              layer: int = 0, heads: Iterable[int] | None = None, threshold: float | None = None,
              title: str | None = None, path: str | os.PathLike[str] | None = None,
              compression: int = 3) -> HeadView:
    """An interactive head view of attention: one self-contained HTML page.

    Parameters
    ----------
    attention : array_like, shape (layers, heads, n_q, n_k)
        Attention weights (one layer (heads, n_q, n_k) is fine; so is a list of per-layer
        arrays such as Hugging Face's ``outputs.attentions``, each (1, heads, n_q, n_k), torch
        tensors included), rows = queries. Clipped to [0, 1].
    tokens : sequence of str, length n_q
        The query tokens (and the keys too, for self-attention).
    key_tokens : sequence of str, length n_k, optional
        The key tokens for cross-attention (a decoder over an encoder, a query over a
        document); n_q may then differ from n_k.
    sentence_b_start : int, optional
        Index of the first token of sentence B (self-attention of a sentence pair): adds the
        A->A / A->B / B->A / B->B filter.
    rollout : bool or array_like (layers, n, n), optional
        ``True``: add attention rollout (:func:`mha.analysis.attention_rollout`) as a second
        picture to switch to; or pass your own (layers, n_q, n_k).
    norms : array_like, optional
        Value norms (:meth:`model.attention_norms <mha.models.TransformerModel.attention_norms>`
        or :func:`mha.analysis.value_norms`), (layers, heads, n_q, n_k) per head or
        (layers, n_q, n_k) over heads: a third picture, lines as opaque as norm / largest norm.
    layer, heads : int, sequence of int
        What is shown first (default layer 0, all heads).
    threshold : float, optional
        The initial "min weight" of the resting view (default 0 up to 60 tokens, 0.05 beyond).
    title : str, optional
        Shown above the picture (and in exported images).
    path : str or path-like, optional
        Also save the page there.
    compression : int
        The zlib level of the data (0 to 9).

    Returns
    -------
    HeadView
        Jupyter displays it inline; ``.save(path)``; ``.html``.

    Raises
    ------
    ValueError
        Token counts, shapes, ``sentence_b_start``, ``layer`` or ``heads`` that do not fit.
    TypeError
        Non-real attention.

    Examples
    --------
    >>> w = np.full((2, 3, 4, 4), 0.25)                       # 2 layers, 3 heads, 4 tokens
    >>> view = head_view(w, ["[CLS]", "hello", "world", "[SEP]"], rollout=True)
    >>> view.n_layers, view.n_heads, view.n_tokens
    (2, 3, 4)
    """
    att, tokens, key_tokens = _data.view_inputs(attention, tokens, key_tokens)
    L, H, n_q, n_k = att.shape
    if sentence_b_start is not None:
        sentence_b_start = int(sentence_b_start)
        if key_tokens is not None or not 0 < sentence_b_start < n_q:
            raise ValueError(f"sentence_b_start={sentence_b_start}: expected 0 < index < {n_q} "
                             "(self-attention of a sentence pair)")
    if not 0 <= int(layer) < L:
        raise ValueError(f"layer={layer}: expected 0 <= layer < {L}")
    heads = list(range(H)) if heads is None else sorted({int(h) for h in heads})
    if any(not 0 <= h < H for h in heads):
        raise ValueError(f"heads={heads}: expected head indices in [0, {H})")
    if threshold is None:
        threshold = 0.0 if max(n_q, n_k) <= 60 else 0.05
    sources = _data.sources(_data.pictures(att, rollout, norms), compression)
    payload: dict[str, Any] = {
        "kind": "head", "n_layers": L, "n_heads": H, "n_q": n_q, "n_k": n_k, "tokens": tokens,
        "key_tokens": key_tokens, "sentence_b_start": sentence_b_start, "layer": int(layer),
        "heads": heads, "threshold": float(threshold), "title": title or "",
        "encoding": "uint8 round(255 v / scale[layer]), zlib, base64", "sources": sources,
    }
    page = write_page("head", payload, title or "mha head view")
    n = max(n_q, n_k)
    row_h = 14 if n > 150 else (16 if n > 60 else 20)
    return picture_view(HeadView, page, int(min(110 + 52 + n * row_h + 20, 760)), sources,
                        att.shape, path)
