"""The multi-head attention layer on mha's C kernels: `MultiHeadAttention`.

The configuration, parameters, checks and bookkeeping come from `mha.layer_base.LayerBase`
(shared with the NumPy oracle `mha.reference.MultiHeadAttention`); this class runs the forward
and the backward as one call each into the C core (projections, every head's attention, head
mask and output projection), with the GIL released. The forward hands back one opaque context
(the forward's inputs, parameters, masks and saved buffers) that the backward replays; the
binding checks every size against the parameters, so this layer leaves `_check_sizes` empty.
"""
from __future__ import annotations

from typing import Any

import numpy as np
from numpy.typing import ArrayLike

from . import _core, checks
from .layer_base import KVCache, LayerBase

__all__ = ["MultiHeadAttention", "KVCache"]

class MultiHeadAttention(LayerBase):
    """Run a multi-head attention layer on the C core, forward and backward.

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
        Width of each head; defaults to d_model // n_heads (any positive value is allowed).
    kdim, vdim : int, optional
        Widths of key and value (default d_model), for cross-attention.
    bias : bool, default True
        Add biases to the four projections.
    dropout : float, default 0.0
        Probability in [0, 1) on the attention weights, applied only while training.
    dtype : {numpy.float32, numpy.float64}, default numpy.float32
        Inputs of another float dtype are cast to it.
    seed : int, optional
        Seeds the generator of the initial weights (Xavier-uniform, like PyTorch) and of the
        dropout seeds.
    softcap : float, optional
        Attention logit soft-capping (Gemma 2): a positive finite c turns each score s into
        ``c * tanh(s / c)`` before the masks, in the forward and the backward (as
        `mha.attention`'s ``softcap``). None (the default) or 0: no cap.

    Attributes
    ----------
    params : dict of ndarray
        W_q, W_k, W_v, W_o (and b_q, b_k, b_v, b_o), stored (in, out): ``x @ W`` is the
        projection.
    grads : dict of ndarray
        The same keys plus "head_mask", overwritten by each backward.
    head_mask : ndarray
        (n_heads,) multipliers on each head's output (1 keep, 0 prune).
    training : bool
        Dropout only while True (see train() / eval()).

    See Also
    --------
    mha.reference.MultiHeadAttention : The same layer in NumPy, the tests' oracle.

    Notes
    -----
    Masks: `mask` is bool (True = may attend, the OPPOSITE of torch.nn.MultiheadAttention)
    or float (added to the scores), broadcasting to (B, n_heads, n_q, n_k);
    `key_padding_mask` is bool (B, n_k), True = real token, False = padding.

    Calls on one layer from several threads are safe for inference (eval mode); for training
    use one layer per thread, since backward() uses the last forward's inputs and dropout
    draws from the layer's generator.

    Examples
    --------
    >>> layer = mha.MultiHeadAttention(d_model=64, n_heads=8, seed=0)
    >>> x = np.random.default_rng(0).standard_normal((2, 10, 64))
    >>> out, weights = layer(x, causal=True)
    >>> out.shape, weights.shape
    ((2, 10, 64), (2, 8, 10, 10))
    >>> d_x, _, _ = layer.backward(np.ones_like(out))
    """

    def _check_sizes(self, query: np.ndarray, key: np.ndarray, value: np.ndarray, *,
                     key_padding_mask: np.ndarray | None, head_mask: np.ndarray,
                     cache: KVCache | None) -> None:
        """Nothing: the binding checks the sizes against the parameters (csrc/module.c)."""

    def _check_d_out(self, d_out: np.ndarray, out_shape: tuple[int, ...], unbatched: bool) -> None:
        """Nothing: the binding checks d_out against the forward's output."""

    def _forward(self, query: np.ndarray, key: np.ndarray, value: np.ndarray, *,
                 mask: np.ndarray | None, key_padding_mask: np.ndarray | None, causal: bool,
                 need_weights: bool, head_mask: np.ndarray, dropout: float, seed: int | None,
                 cache: KVCache | None) -> tuple[np.ndarray, np.ndarray | None, dict[str, Any]]:
        # the parameters as the core reads them, by name (the binding leaves out a head mask of
        # all ones, the identity)
        params = {name: checks.contiguous(a, self.dtype) for name, a in self.params.items()}
        params["head_mask"] = checks.contiguous(head_mask)
        out, weights, context = _core.layer_forward(
            query, key, value, params=params, heads=self.n_heads, kv_heads=self.n_kv_heads,
            d_head=self.d_head, mask=mask, key_padding_mask=key_padding_mask, causal=causal,
            dropout=dropout, seed=seed, need_weights=need_weights, cache=cache,
            key_is_query=key is query, value_is_key=value is key, softcap=self.softcap)
        return out, weights, {"context": context}

    def _backward(self, d_out: np.ndarray, saved: dict[str, Any]) -> tuple[
            np.ndarray, np.ndarray | None, np.ndarray | None, dict[str, np.ndarray]]:
        d_query, d_key, d_value, grads = _core.layer_backward(
            checks.contiguous(d_out, self.dtype), saved["context"])
        return d_query, d_key, d_value, grads

    def attention_norms(self, query: ArrayLike, key: ArrayLike | None = None,
                        value: ArrayLike | None = None, *, mask: ArrayLike | None = None,
                        key_padding_mask: ArrayLike | None = None, causal: bool = False,
                        summed: bool = False) -> np.ndarray:
        """Compute this layer's norm-based attention (Kobayashi et al. 2020), ||alpha_ij f_h(x_j)||.

        f_h(x_j) = (value_j W_v + b_v)_h (head_mask[h] W_o[rows of head h]), the vector key j
        adds to query i's output through head h, scaled by its weight alpha_ij; the output
        bias is left out. Runs the layer's forward (in eval mode, keeping what backward needs
        from the last call) for the weights, then :func:`mha.analysis.value_norms`.

        Parameters
        ----------
        query : array_like, shape (B, n_q, d_model) or (n_q, d_model)
            As for calling the layer (no KV cache).
        key, value : array_like, optional
            As for calling the layer.
        mask : array_like, optional
            As for calling the layer.
        key_padding_mask : array_like of bool, shape (B, n_k), optional
            As for calling the layer.
        causal : bool, default False
            As for calling the layer.
        summed : bool
            The norm of the sum over heads instead of each head's.

        Returns
        -------
        norms : ndarray, shape (B, n_heads, n_q, n_k), or (B, n_q, n_k) with ``summed``
            The B axis is dropped for unbatched input; in the layer's dtype.

        References
        ----------
        G. Kobayashi, T. Kuribayashi, S. Yokoi and K. Inui, "Attention is Not Only a Weight:
        Analyzing Transformers with Vector Norms", EMNLP 2020, https://arxiv.org/abs/2004.10102.

        Examples
        --------
        >>> layer = mha.MultiHeadAttention(8, 2, seed=0)
        >>> x = np.ones((3, 8), np.float32)
        >>> layer.attention_norms(x).shape, layer.attention_norms(x, summed=True).shape
        ((2, 3, 3), (3, 3))
        """
        from .analysis import value_norms

        training, saved = self.training, self._saved
        self.training = False
        try:
            _, weights = self(query, key, value, mask=mask, key_padding_mask=key_padding_mask,
                              causal=causal, need_weights=True)
        finally:
            self.training, self._saved = training, saved
        assert weights is not None                                      # need_weights=True
        _, _, value, unbatched = checks.layer_inputs(
            query, key, value, d_model=self.d_model, kdim=self.kdim, vdim=self.vdim, dtype=self.dtype)
        B, n_k, _ = value.shape
        P, H_kv, D = self.params, self.n_kv_heads, self.d_head
        v = _core.matmul(value.reshape(B * n_k, self.vdim), checks.contiguous(P["W_v"], self.dtype))
        if "b_v" in P:
            v += P["b_v"]
        v = v.reshape(B, n_k, H_kv, D).transpose(0, 2, 1, 3)            # (B, H_kv, n_k, D)
        W_o = P["W_o"] * np.repeat(np.asarray(self.head_mask, self.dtype), D)[:, None]
        norms = value_norms(weights[None] if unbatched else weights, v, W_o, summed=summed)
        return norms[0] if unbatched else norms
