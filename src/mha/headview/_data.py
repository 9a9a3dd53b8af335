"""What the views hold: attention checked into (layers, heads, n_q, n_k), token labels, and the
pictures (raw weights, rollout, value norms) encoded as bytes for a page.

``labels`` and ``real_array`` are also the input checks of :mod:`mha.viz`'s figures.
"""
from __future__ import annotations

import base64
import zlib
from typing import Any, Iterable

import numpy as np
from numpy.typing import ArrayLike

from ..analysis._inputs import _to_numpy


def labels(tokens: Iterable[object] | None, n: int, name: str) -> list[str]:
    """n token labels as str (the positions when tokens is None); the count checked."""
    if tokens is None:
        return [str(i) for i in range(n)]
    names = [str(t) for t in tokens]
    if len(names) != n:
        raise ValueError(f"{name} has {len(names)} entries but the attention has {n} positions")
    return names


def real_array(x: Any, name: str = "weights") -> np.ndarray:
    """x (a torch tensor too) as a float64 array; TypeError unless it holds real numbers."""
    x = _to_numpy(x)
    if x.dtype.kind not in "fiub":
        raise TypeError(f"{name} must be real numbers, got dtype {x.dtype}")
    return x.astype(np.float64, copy=False)


def as_layers(attention: Any, name: str = "attention") -> np.ndarray:
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
    attention = real_array(attention, name)
    while attention.ndim > 4 and attention.shape[0] == 1:
        attention = attention[0]
    if attention.ndim == 3:
        attention = attention[None]
    if attention.ndim != 4:
        raise ValueError(f"{name} has shape {attention.shape}: expected (layers, heads, n_q, n_k) "
                         "or (heads, n_q, n_k)")
    return attention


def view_inputs(attention: Any, tokens: Iterable[object] | None,
                key_tokens: Iterable[object] | None,
                ) -> tuple[np.ndarray, list[str], list[str] | None]:
    """(attention (L, H, n_q, n_k), tokens, key_tokens or None), checked."""
    att = as_layers(attention)
    n_q, n_k = att.shape[2:]
    tokens = labels(tokens, n_q, "tokens")
    if key_tokens is None and n_q != n_k:
        raise ValueError(f"attention has shape {att.shape}: {n_q} queries and {n_k} keys need "
                         "key_tokens (cross-attention)")
    return att, tokens, None if key_tokens is None else labels(key_tokens, n_k, "key_tokens")


def pictures(att: np.ndarray, rollout: bool | ArrayLike | None, norms: ArrayLike | None,
             ) -> list[tuple[str, str, bool, np.ndarray]]:
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
        v = as_layers(norms, "norms")
        if v.shape[0] != L or v.shape[2:] != (n_q, n_k) or v.shape[1] not in (1, H):
            raise ValueError(f"norms has shape {np.shape(norms)}: expected ({L}, {H}, {n_q}, "
                             f"{n_k}) per head or ({L}, {n_q}, {n_k}) summed over heads")
        if not np.all(np.isfinite(v)) or v.min(initial=0.0) < 0:
            raise ValueError("norms must be finite and >= 0")
        label = "Value norms" + (" (sum of heads)" if v.shape[1] == 1 and H > 1 else "")
        out.append(("norms", label, False, v))
    return out


def packed(a: np.ndarray, compression: int) -> str:
    """The bytes of an array, zlib-compressed and base64-encoded (text for the page's JSON)."""
    return base64.b64encode(zlib.compress(np.ascontiguousarray(a).tobytes(), compression)).decode("ascii")


def sources(pictures: list[tuple[str, str, bool, np.ndarray]], compression: int,
            ) -> list[dict[str, Any]]:
    """The pictures as the page holds them: per layer the bytes round(255 v / scale), with one
    scale per layer (1 for probabilities, the layer's largest value otherwise)."""
    out = []
    for name, label, probability, values in pictures:
        values = np.nan_to_num(values, nan=0.0, posinf=0.0, neginf=0.0)
        layers, scales = [], []
        for layer in values:
            scale = 1.0 if probability else float(layer.max(initial=0.0)) or 1.0
            layers.append(packed(np.rint(np.clip(layer / scale, 0.0, 1.0) * 255.0).astype(np.uint8),
                                 compression))
            scales.append(scale)
        out.append({"name": name, "label": label, "kind": "probability" if probability else "norm",
                     "n_heads": int(values.shape[1]), "scale": scales, "layers": layers})
    return out
