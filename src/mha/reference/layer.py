"""The multi-head attention layer in NumPy, forward and backward: the oracle of
`mha.MultiHeadAttention`.

The configuration, parameters, checks and bookkeeping come from `mha.layer_base.LayerBase`
(shared with the C layer); this module holds only the layer's arithmetic, written like a
textbook's NumPy.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ..layer_base import KVCache, LayerBase
from .sdpa import attention, attention_backward

__all__ = ["MultiHeadAttention"]


class MultiHeadAttention(LayerBase):
    """Run a multi-head attention layer in pure NumPy, forward and backward.

    It is the oracle of `mha.MultiHeadAttention`, with the same constructor, attributes and
    methods; the same seed gives the same initial weights and the same dropout masks.

    ::

        Q = query @ W_q + b_q   -> (B, H,    n_q, d_head)
        K = key   @ W_k + b_k   -> (B, H_kv, n_k, d_head)
        V = value @ W_v + b_v   -> (B, H_kv, n_k, d_head)
        O_h = attention(Q, K, V, mask & key_padding_mask, causal, 1/sqrt(d_head), dropout,
                        softcap)
        out = concat_h(head_mask[h] * O_h) @ W_o + b_o            (B, n_q, d_model)

    Parameters
    ----------
    d_model : int
        Width of the query and of the output.
    n_heads : int
        Number of query heads H.
    n_kv_heads : int, optional
        Number of key/value heads H_kv, dividing H (grouped-query attention); defaults to H.
    d_head : int, optional
        Width of each head; defaults to d_model // n_heads.
    kdim, vdim : int, optional
        Widths of key and value (default d_model), for cross-attention.
    bias : bool, default True
        Add biases to the four projections.
    dropout : float, default 0.0
        Probability in [0, 1) on the attention weights, applied only while training.
    dtype : {numpy.float32, numpy.float64}, default numpy.float32
        Inputs of another float dtype are cast to it.
    seed : int, optional
        Seeds the initial weights and the dropout seeds.
    softcap : float, optional
        Attention logit soft-capping: each score s becomes ``c * tanh(s / c)`` before the masks.
        None (the default) or 0: no cap.

    See Also
    --------
    mha.MultiHeadAttention : The same layer on the C core.
    mha.reference.attention : The attention of each head.

    Examples
    --------
    >>> x = np.random.default_rng(0).standard_normal((2, 5, 8))
    >>> ref = MultiHeadAttention(8, 2, seed=0, dtype=np.float64)
    >>> fast = mha.MultiHeadAttention(8, 2, seed=0, dtype=np.float64)
    >>> bool(np.allclose(ref(x, causal=True)[0], fast(x, causal=True)[0]))
    True
    """

    def _forward(self, query: np.ndarray, key: np.ndarray, value: np.ndarray, *,
                 mask: np.ndarray | None, key_padding_mask: np.ndarray | None, causal: bool,
                 need_weights: bool, head_mask: np.ndarray, dropout: float, seed: int | None,
                 cache: KVCache | None) -> tuple[np.ndarray, np.ndarray | None, dict[str, Any]]:
        B, n_q, _ = query.shape
        n_new = key.shape[1]
        H, H_kv, D = self.n_heads, self.n_kv_heads, self.d_head
        W = self.params

        # 1. project, then split the features into heads
        Q = query @ W["W_q"]                                            # (B, n_q, H*D)
        K = key @ W["W_k"]                                              # (B, n_new, H_kv*D)
        V = value @ W["W_v"]                                            # (B, n_new, H_kv*D)
        if self.bias:
            Q, K, V = Q + W["b_q"], K + W["b_k"], V + W["b_v"]
        Q = Q.reshape(B, n_q, H, D).transpose(0, 2, 1, 3)               # (B, H, n_q, D)
        K = K.reshape(B, n_new, H_kv, D).transpose(0, 2, 1, 3)          # (B, H_kv, n_new, D)
        V = V.reshape(B, n_new, H_kv, D).transpose(0, 2, 1, 3)          # (B, H_kv, n_new, D)

        # 2. KV cache: append, then attend over everything cached
        if cache is not None:
            start, end = cache.length, cache.length + n_new
            cache.k[:, :, start:end] = K
            cache.v[:, :, start:end] = V
            cache.length = end
            K, V = cache.k[:, :, :end], cache.v[:, :, :end]             # (B, H_kv, n_k, D)

        # 3. one mask: key_padding_mask joins a bool mask by AND, a float mask as -inf
        if key_padding_mask is not None:
            real = key_padding_mask[:, None, None, :]                   # (B, 1, 1, n_k)
            if mask is None:
                mask = real
            elif mask.dtype == bool:
                mask = mask & real
            else:
                mask = mask + np.where(real, 0.0, -np.inf).astype(self.dtype)

        # 4. attention per head
        O, weights = attention(Q, K, V, mask, causal=causal, scale=self.scale,
                               dropout=dropout, seed=seed, need_weights=need_weights,
                               softcap=self.softcap)
        # O: (B, H, n_q, D), weights: (B, H, n_q, n_k)

        # 5. scale each head by head_mask, concatenate the heads, project
        C = (head_mask[:, None, None] * O).transpose(0, 2, 1, 3).reshape(B, n_q, H * D)
        out = C @ W["W_o"]                                              # (B, n_q, d_model)
        if self.bias:
            out = out + W["b_o"]
        saved = dict(query=query, key=key, value=value, Q=Q, K=K, V=V, O=O, C=C,
                     head_mask=head_mask, mask=mask, causal=causal, dropout=dropout, seed=seed)
        return out, weights, saved

    def _backward(self, d_out: np.ndarray, s: dict[str, Any]) -> tuple[
            np.ndarray, np.ndarray | None, np.ndarray | None, dict[str, np.ndarray]]:
        query, key, value = s["query"], s["key"], s["value"]
        Q, K, V, O, C = s["Q"], s["K"], s["V"], s["O"], s["C"]
        B, n_q, _ = query.shape
        n_k = key.shape[1]
        H, H_kv, D = self.n_heads, self.n_kv_heads, self.d_head
        W = self.params
        grads = {}

        # 5. out = C @ W_o + b_o
        grads["W_o"] = C.reshape(-1, H * D).T @ d_out.reshape(-1, self.d_model)
        if self.bias:
            grads["b_o"] = d_out.sum(axis=(0, 1))
        dC = d_out @ W["W_o"].T                                         # (B, n_q, H*D)

        # 5. C = concat_h(head_mask[h] * O_h)
        dC = dC.reshape(B, n_q, H, D).transpose(0, 2, 1, 3)             # (B, H, n_q, D)
        grads["head_mask"] = np.sum(dC * O, axis=(0, 2, 3))            # (H,)
        dO = s["head_mask"][:, None, None] * dC                         # (B, H, n_q, D)

        # 4. O = attention(Q, K, V)
        dQ, dK, dV = attention_backward(dO, Q, K, V, s["mask"], causal=s["causal"],
                                        scale=self.scale, dropout=s["dropout"], seed=s["seed"],
                                        softcap=self.softcap)

        # 1. Q, K, V = projections, split into heads: merge the heads back, then the linear maps
        dQ = dQ.transpose(0, 2, 1, 3).reshape(B, n_q, H * D)           # (B, n_q, H*D)
        dK = dK.transpose(0, 2, 1, 3).reshape(B, n_k, H_kv * D)         # (B, n_k, H_kv*D)
        dV = dV.transpose(0, 2, 1, 3).reshape(B, n_k, H_kv * D)         # (B, n_k, H_kv*D)
        grads["W_q"] = query.reshape(-1, self.d_model).T @ dQ.reshape(-1, H * D)
        grads["W_k"] = key.reshape(-1, self.kdim).T @ dK.reshape(-1, H_kv * D)
        grads["W_v"] = value.reshape(-1, self.vdim).T @ dV.reshape(-1, H_kv * D)
        if self.bias:
            grads["b_q"] = dQ.sum(axis=(0, 1))
            grads["b_k"] = dK.sum(axis=(0, 1))
            grads["b_v"] = dV.sum(axis=(0, 1))
        d_query = dQ @ W["W_q"].T                                       # (B, n_q, d_model)
        d_key = dK @ W["W_k"].T                                         # (B, n_k, kdim)
        d_value = dV @ W["W_v"].T                                       # (B, n_k, vdim)
        grads = {name: grads[name].astype(self.dtype, copy=False)
                 for name in list(self.params) + ["head_mask"]}

        # an omitted input was the same array as another one: its gradient flows there
        if not s["value_given"]:                                        # value = key
            d_key, d_value = d_key + d_value, None
        if not s["key_given"]:                                          # key = query
            d_query, d_key = d_query + d_key, None
        return d_query, d_key, d_value, grads
