"""Interactive, self-contained views of attention (BertViz-style), drawn on a canvas.

    view = mha.viz.head_view(attention, tokens)           # Jupyter shows it inline
    view.save("head_view.html")                           # one file: open it anywhere, offline
    mha.viz.model_view(attention, tokens)                 # every layer x head as thumbnails
    mha.viz.neuron_view(model, text, layer=2, head=5)     # q, k, q*k, q.k and softmax

The head view: two columns of tokens (queries left, keys right; different lists for
cross-attention) joined by one line per head and pair, coloured by head, as opaque as the
weight. Hover a token to see only its lines (per-head heat cells on the other column, its top
keys written out); click to pin it, shift-click more queries to see the sum of their
attention; toggle heads, or fuse them by mean or max; pick a layer, or the mean or max over
layers; switch between raw weights, rollout and value norms when given; export PNG or SVG.

Every page is one HTML file with its script and data inline: no CDN, no network, no
require.js. Weights are stored as bytes, round(255 * w / scale) with one scale per layer (1
for probabilities: resolution 1/255, a weight below 0.002 shows as 0), zlib-compressed per
layer and base64-encoded; a page inflates a layer when it is first shown. Drawing is on a
canvas, so 512 tokens x 12 layers x 12 heads stay fluent. In Jupyter a page sits in a
sandboxed ``<iframe srcdoc>``, so several views coexist. SVG export writes text and lines as
vectors (heatmaps above 20,000 cells as one embedded image).
"""
from __future__ import annotations

import base64
import html
import json
import os
import re
import zlib
from importlib import resources

import numpy as np

__all__ = ["head_view", "model_view", "neuron_view", "HeadView", "ModelView", "NeuronView"]


def _resource(name) -> str:
    return resources.files(__name__).joinpath(name).read_text(encoding="utf-8")


def _to_numpy(x):
    if hasattr(x, "detach") and hasattr(x, "cpu"):      # a torch tensor, without importing torch
        x = x.detach().cpu().numpy()
    return np.asarray(x)


def _as_layers(attention, name="attention"):
    """(layers, heads, n_q, n_k) float array from an array or a list of per-layer arrays."""
    if isinstance(attention, (list, tuple)):
        layers = []
        for i, a in enumerate(attention):
            a = _to_numpy(a)
            while a.ndim > 3 and a.shape[0] == 1:           # Hugging Face: (1, heads, n, n)
                a = a[0]
            if a.ndim != 3:
                raise ValueError(f"{name}[{i}] has shape {a.shape}: expected (heads, n_q, n_k) "
                                 "or (1, heads, n_q, n_k)")
            layers.append(a)
        attention = np.stack(layers)
    attention = _to_numpy(attention)
    if attention.dtype.kind not in "fiub":
        raise TypeError(f"{name} must be real numbers, got dtype {attention.dtype}")
    while attention.ndim > 4 and attention.shape[0] == 1:
        attention = attention[0]
    if attention.ndim == 3:
        attention = attention[None]
    if attention.ndim != 4:
        raise ValueError(f"{name} has shape {attention.shape}: expected (layers, heads, n_q, n_k) "
                         "or (heads, n_q, n_k)")
    return attention.astype(np.float64, copy=False)


def _quantise(values, probability, compression):
    """Per layer: (base64 zlib bytes of round(255 v / scale), scale). values (L, H, n_q, n_k)."""
    values = np.nan_to_num(values, nan=0.0, posinf=0.0, neginf=0.0)
    layers, scales = [], []
    for layer in values:
        scale = 1.0 if probability else float(layer.max(initial=0.0)) or 1.0
        q = np.rint(np.clip(layer / scale, 0.0, 1.0) * 255.0).astype(np.uint8)
        layers.append(base64.b64encode(zlib.compress(q.tobytes(), compression)).decode("ascii"))
        scales.append(scale)
    return layers, scales


def _source(name, label, values, probability, compression):
    layers, scales = _quantise(values, probability, compression)
    return {"name": name, "label": label, "kind": "probability" if probability else "norm",
            "n_heads": int(values.shape[1]), "scale": scales, "layers": layers}


def _json(payload):
    """JSON safe inside <script>: <, > and & escaped so no token can close the tag."""
    return (json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
            .replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026"))


_PLACEHOLDER = re.compile(r"__MHA_([A-Z]+)__")


def _page(view, payload, title):
    """page.html with view's controls and script, the shared code and the data filled in (one
    pass, so nothing inserted, a token or a title, is read as a placeholder)."""
    parts = {"TITLE": html.escape(title), "KIND": f"{view} view",
             "CONTROLS": _resource(f"{view}_controls.html"), "COMMON": _resource("common.js"),
             "SCRIPT": _resource(f"{view}.js"), "DATA": _json(payload)}
    return _PLACEHOLDER.sub(lambda m: parts[m.group(1)], _resource("page.html"))


def _view_inputs(attention, tokens, key_tokens):
    """(attention (L, H, n_q, n_k), tokens, key_tokens or None), checked."""
    att = _as_layers(attention)
    n_q, n_k = att.shape[2:]
    tokens = _labels(tokens, n_q, "tokens")
    if key_tokens is None and n_q != n_k:
        raise ValueError(f"attention has shape {att.shape}: {n_q} queries and {n_k} keys need "
                         "key_tokens (cross-attention)")
    return att, tokens, None if key_tokens is None else _labels(key_tokens, n_k, "key_tokens")


def _labels(tokens, n, name):
    tokens = [str(t) for t in tokens]
    if len(tokens) != n:
        raise ValueError(f"{name} has {len(tokens)} entries but the attention has {n} positions")
    return tokens


class HTMLView:
    """Hold a rendered view: one self-contained HTML page.

    ``save(path)`` writes it; Jupyter displays it through ``_repr_html_`` (a sandboxed iframe,
    so views do not collide).

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
    kind = "view"

    def __init__(self, page: str, *, height: int, payload_bytes: int, **info):
        self.html = page
        self.height = height                  # iframe height in Jupyter (px)
        self.payload_bytes = payload_bytes    # base64 characters of the data
        for key, value in info.items():
            setattr(self, key, value)

    def save(self, path):
        """Write the standalone HTML page to a file.

        Parameters
        ----------
        path : str or os.PathLike
            Where to write (UTF-8).

        Returns
        -------
        str
            The path written.
        """
        path = os.fspath(path)
        with open(path, "w", encoding="utf-8") as f:
            f.write(self.html)
        return path

    def _repr_html_(self):
        return (f'<iframe srcdoc="{html.escape(self.html, quote=True)}" '
                f'style="width:100%;height:{self.height}px;border:1px solid #ddd;" '
                f'sandbox="allow-scripts allow-downloads" loading="eager" '
                f'title="mha {self.kind}"></iframe>')

    def _shape(self):
        return f"{self.n_layers} layers x {self.n_heads} heads x {self.n_tokens} tokens"

    def __repr__(self):
        return f"<{type(self).__name__}: {self._shape()}, {len(self.html) / 1e6:.2f} MB page>"


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


class NeuronView(HTMLView):
    """Hold a rendered neuron view (see :func:`neuron_view`).

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
    kind = "neuron view"

    def _shape(self):
        return (f"{len(self.layers)} of {self.n_layers} layers x {self.n_heads} heads x "
                f"{self.n_tokens} tokens, d_head {self.d_head}")


def _pictures(att, rollout, norms):
    """What a view can show: [(name, label, probability, values (L, heads, n_q, n_k))], the raw
    weights first, then rollout and value norms when asked for."""
    L, H, n_q, n_k = att.shape
    out = [("attention", "Raw weights", True, att)]
    if rollout is not None and rollout is not False:
        if rollout is True:
            if n_q != n_k:
                raise ValueError("rollout=True needs self-attention (n_q == n_k); pass an array")
            from ..analysis import attention_rollout
            rollout = attention_rollout(att)
        r = np.asarray(rollout, dtype=np.float64)
        r = r[:, None] if r.ndim == 3 else r
        if r.shape != (L, 1, n_q, n_k):
            raise ValueError(f"rollout has shape {np.shape(rollout)}: expected ({L}, {n_q}, {n_k})")
        out.append(("rollout", "Rollout", True, r))
    if norms is not None:
        v = _as_layers(norms, "norms")
        if v.shape[0] != L or v.shape[2:] != (n_q, n_k) or v.shape[1] not in (1, H):
            raise ValueError(f"norms has shape {np.shape(norms)}: expected ({L}, {H}, {n_q}, "
                             f"{n_k}) per head or ({L}, {n_q}, {n_k}) summed over heads")
        if not np.all(np.isfinite(v)) or v.min(initial=0.0) < 0:
            raise ValueError("norms must be finite and >= 0")
        label = "Value norms" + (" (sum of heads)" if v.shape[1] == 1 and H > 1 else "")
        out.append(("norms", label, False, v))
    return out


def _picture_view(cls, page, height, sources, shape, path):
    """A head or model view object (saved to path when given)."""
    L, H, n_q, n_k = shape
    view = cls(page, height=height, n_layers=L, n_heads=H, n_tokens=n_q, n_keys=n_k,
               sources=[s["name"] for s in sources],
               payload_bytes=sum(len(s.get("thumbs", "")) + sum(map(len, s["layers"])) for s in sources))
    if path is not None:
        view.save(path)
    return view


def _sources(pictures, compression):
    return [_source(name, label, values, probability, compression)
            for name, label, probability, values in pictures]


def head_view(attention, tokens, key_tokens=None, *, sentence_b_start=None, rollout=None,
              norms=None, layer=0, heads=None, threshold=None, title=None, path=None,
              compression=3) -> HeadView:
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
    att, tokens, key_tokens = _view_inputs(attention, tokens, key_tokens)
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
    sources = _sources(_pictures(att, rollout, norms), compression)
    payload = {
        "kind": "head", "n_layers": L, "n_heads": H, "n_q": n_q, "n_k": n_k, "tokens": tokens,
        "key_tokens": key_tokens, "sentence_b_start": sentence_b_start, "layer": int(layer),
        "heads": heads, "threshold": float(threshold), "title": title or "",
        "encoding": "uint8 round(255 v / scale[layer]), zlib, base64", "sources": sources,
    }
    page = _page("head", payload, title or "mha head view")
    n = max(n_q, n_k)
    row_h = 14 if n > 150 else (16 if n > 60 else 20)
    return _picture_view(HeadView, page, int(min(110 + 52 + n * row_h + 20, 760)), sources,
                         att.shape, path)


def _thumbnails(values, size):
    """Block-max pooling of (L, H, n_q, n_k) to at most size x size cells (peaks stay
    visible); returns uint8 round(255 v / scale) per layer, all layers in one array."""
    values = np.nan_to_num(values, nan=0.0, posinf=0.0, neginf=0.0)
    L, H, n_q, n_k = values.shape
    bq, bk = -(-n_q // size), -(-n_k // size)
    tq, tk = -(-n_q // bq), -(-n_k // bk)
    padded = np.zeros((L, H, tq * bq, tk * bk))
    padded[:, :, :n_q, :n_k] = values
    return padded.reshape(L, H, tq, bq, tk, bk).max(axis=(3, 5)), (tq, tk)


def model_view(attention, tokens, key_tokens=None, *, rollout=None, norms=None, title=None,
               path=None, thumbnail=64, compression=3) -> ModelView:
    """Every layer x head as a thumbnail (BertViz's model view); click one to open it large.

    The large view is the head's full (n_q, n_k) heatmap with the tokens on its axes: hover a
    cell for the query, key and value; step through heads and layers with the arrow keys.
    The thumbnails are max-pooled to at most ``thumbnail`` x ``thumbnail`` cells, so 512
    tokens x 12 layers x 12 heads open at once; each layer's full data is inflated when one of
    its heads is opened. PNG and SVG export.

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
    att, tokens, key_tokens = _view_inputs(attention, tokens, key_tokens)
    L, H, n_q, n_k = att.shape
    pictures = _pictures(att, rollout, norms)
    sources = _sources(pictures, compression)
    for src, (_, _, _, values) in zip(sources, pictures):
        pooled, (tq, tk) = _thumbnails(values, int(thumbnail))
        scale = np.asarray(src["scale"])[:, None, None, None]
        q = np.rint(np.clip(pooled / scale, 0, 1) * 255).astype(np.uint8)
        src["thumbs"] = base64.b64encode(zlib.compress(q.tobytes(), compression)).decode("ascii")
        src["thumb_shape"] = [tq, tk]
    payload = {"kind": "model", "n_layers": L, "n_heads": H, "n_q": n_q, "n_k": n_k,
               "tokens": tokens, "key_tokens": key_tokens, "title": title or "",
               "sources": sources}
    page = _page("model", payload, title or "mha model view")
    return _picture_view(ModelView, page, int(min(140 + L * 84, 900)), sources, att.shape, path)


def _float_layers(arrays, compression):
    """float32 little-endian bytes of each array, zlib + base64."""
    return [base64.b64encode(zlib.compress(np.ascontiguousarray(a, dtype="<f4").tobytes(),
                                           compression)).decode("ascii") for a in arrays]


def neuron_view(model, text, *, layer=0, head=0, pair=None, layers=None, truncation=False,
                title=None, path=None, compression=3) -> NeuronView:
    """How one head's attention is computed (BertViz's neuron view), from mha's own q and k.

    For a query token (hover or click it): its query vector q, every key vector k, the
    elementwise product q * k, the score q . k times the scale, and the softmax over the keys
    the query can see; colours: blue negative, orange positive. Works for every model family
    mha loads (it only needs ``model.qkv(text)``), grouped-query attention included (query
    head h reads key head h // (n_heads // n_kv_heads)).

    Parameters
    ----------
    model : mha.models.TransformerModel
        A loaded model (``mha.models.load(...)``).
    text : str
        One text.
    layer, head : int
        Shown first; the page switches between the layers it holds and all heads.
    pair : str, optional
        The second text of a sentence pair.
    layers : sequence of int or "all", optional
        The layers whose q and k go into the page (float32). Default: all layers when that is
        at most 4 million numbers (MiniLM: up to 868 tokens), else only ``layer``.
    truncation : bool
        Cut a text longer than the model's positions instead of raising.
    title : str, optional
        Shown above the picture (and in exported images).
    path : str or path-like, optional
        Also save the page there.
    compression : int
        The zlib level of the data (0 to 9).

    Returns
    -------
    NeuronView
        Jupyter displays it inline; ``.save(path)``; ``.html``.

    Raises
    ------
    ValueError
        ``layer``, ``head`` or ``layers`` out of range.

    Examples
    --------
    >>> import mha.models                                            # doctest: +SKIP
    >>> view = neuron_view(mha.models.load("minilm"), "The cat sat.", layer=2, head=5)  # doctest: +SKIP
    """
    tokens, q, k, _ = model.qkv(text, pair, truncation=truncation)
    L, H, n, d_head = q.shape
    H_kv = k.shape[1]
    if not 0 <= int(layer) < L:
        raise ValueError(f"layer={layer}: expected 0 <= layer < {L}")
    if not 0 <= int(head) < H:
        raise ValueError(f"head={head}: expected 0 <= head < {H}")
    if layers is None:
        layers = list(range(L)) if L * (H + H_kv) * n * d_head <= 4_000_000 else [int(layer)]
    elif layers == "all":
        layers = list(range(L))
    else:
        layers = sorted({int(l) for l in layers} | {int(layer)})
        if any(not 0 <= l < L for l in layers):
            raise ValueError(f"layers={layers}: expected layer indices in [0, {L})")
    scales = [float(model.attention_scale(l)) if hasattr(model, "attention_scale")
              else 1.0 / float(np.sqrt(d_head)) for l in range(L)]
    payload = {
        "kind": "neuron", "n_layers": L, "n_heads": H, "n_kv_heads": H_kv, "n": n,
        "d_head": d_head, "tokens": [str(t) for t in tokens], "causal": bool(model.causal),
        "scale": scales, "layers": layers, "layer": int(layer), "head": int(head),
        "title": title or "", "name": getattr(model, "name", None) or type(model).__name__,
        "q": _float_layers([q[l] for l in layers], compression),
        "k": _float_layers([k[l] for l in layers], compression),
        "encoding": "float32 little-endian, zlib, base64; q (heads, n, d_head), k (kv_heads, n, d_head)",
    }
    page = _page("neuron", payload, title or "mha neuron view")
    view = NeuronView(page, height=int(min(150 + n * 18, 800)),
                      payload_bytes=sum(map(len, payload["q"])) + sum(map(len, payload["k"])),
                      n_layers=L, n_heads=H, n_kv_heads=H_kv, n_tokens=n, d_head=d_head,
                      layers=layers)
    if path is not None:
        view.save(path)
    return view
