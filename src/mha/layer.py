"""The multi-head attention layer on mha's C kernels: `MultiHeadAttention`.

Its NumPy twin `mha.reference.MultiHeadAttention` is its base class: the constructor, the
parameters and their initialisation, train/eval, head_mask, prune_heads, num_parameters and
from_torch are shared, so the two cannot drift apart; this class replaces the forward and the
backward by one call each into the C core (projections, every head's attention, head mask
and output projection), with the GIL released.
"""

import numpy as np

from . import _C
from . import reference
from .functional import check_fits, prepare_mask

__all__ = ["MultiHeadAttention", "KVCache"]


class KVCache(reference.KVCache):
    """Keys and values of the tokens seen so far, for step-by-step decoding.

    Stored as the projections come out of the core, (batch_size, max_len, n_kv_heads*d_head),
    so a step appends rows without copying heads apart.

    Attributes:
        k, v: views (batch_size, n_kv_heads, max_len, d_head); positions [0, length) are filled
        length: number of cached positions
    """

    def __init__(self, batch_size, n_kv_heads, max_len, d_head, dtype=np.float32):
        for name, value in (("batch_size", batch_size), ("max_len", max_len)):
            if int(value) <= 0:
                raise ValueError(f"{name} must be a positive int, got {value}")
        check_fits("KV cache", (2, batch_size, max_len, n_kv_heads * d_head), dtype)
        self.n_kv_heads, self.d_head = int(n_kv_heads), int(d_head)
        self.k_rows = np.zeros((batch_size, max_len, n_kv_heads * d_head), dtype)
        self.v_rows = np.zeros((batch_size, max_len, n_kv_heads * d_head), dtype)
        self.length = 0

    def _heads(self, rows):
        B, max_len, _ = rows.shape
        return rows.reshape(B, max_len, self.n_kv_heads, self.d_head).transpose(0, 2, 1, 3)

    @property
    def k(self):
        return self._heads(self.k_rows)

    @property
    def v(self):
        return self._heads(self.v_rows)


class MultiHeadAttention(reference.MultiHeadAttention):
    __doc__ = reference.MultiHeadAttention.__doc__.replace(
        "Multi-head attention layer in pure NumPy", "Multi-head attention layer on the C core")

    def new_cache(self, batch_size, max_len):
        """An empty KVCache for `batch_size` sequences of up to `max_len` tokens."""
        return KVCache(batch_size, self.n_kv_heads, max_len, self.d_head, self.dtype)

    def _param_tuple(self):
        """(W_q, W_k, W_v, W_o, b_q, b_k, b_v, b_o, head_mask) as the core reads them."""
        P = self.params
        names = ("W_q", "W_k", "W_v", "W_o", "b_q", "b_k", "b_v", "b_o")
        arrays = [reference.c_array(P[n], self.dtype) if n in P else None for n in names]
        head_mask = reference.c_array(self.head_mask, self.dtype)
        if head_mask.shape != (self.n_heads,):
            raise ValueError(f"head_mask has shape {head_mask.shape} but expected ({self.n_heads},)")
        # all ones is the identity: skip the copy of the heads' outputs it would cost
        return tuple(arrays) + (None if np.all(head_mask == 1) else head_mask,)

    def __call__(self, query, key=None, value=None, *, mask=None, key_padding_mask=None,
                 causal=False, need_weights=True, average_weights=False, cache=None):
        key_given, value_given = key is not None, value is not None
        query, key, value, unbatched = self._inputs(query, key, value)
        B, n_q, _ = query.shape
        H, H_kv, D = self.n_heads, self.n_kv_heads, self.d_head

        k_rows = v_rows = None
        length = 0
        if cache is not None:
            if not isinstance(cache, KVCache):
                raise TypeError(f"cache must come from layer.new_cache(), not {type(cache).__name__}")
            if not (cache.k_rows.flags.writeable and cache.v_rows.flags.writeable):
                raise ValueError("the KV cache's buffers are read-only")
            if cache.k_rows.shape[0] != B or cache.k_rows.shape[2] != H_kv * D or cache.k_rows.dtype != self.dtype:
                raise ValueError(f"cache holds {cache.k.shape} (batch, n_kv_heads, max_len, d_head) of "
                                 f"{cache.k_rows.dtype} but this call has batch {B}, {H_kv} kv heads of "
                                 f"width {D}, {self.dtype}")
            if cache.length + key.shape[1] > cache.max_len:
                raise ValueError(f"cache overflow: {cache.length} cached + {key.shape[1]} new "
                                 f"positions > max_len={cache.max_len}")
            k_rows, v_rows, length = cache.k_rows, cache.v_rows, cache.length
        n_k = length + key.shape[1]

        mask4 = prepare_mask(mask, (B, H, n_q, n_k), self.dtype)
        kpm = None
        if key_padding_mask is not None:
            kpm = self._key_padding_mask(key_padding_mask, B, n_k, unbatched)[:, 0, 0, :]
            kpm = np.ascontiguousarray(kpm, dtype=bool)                  # (B, n_k)
        if need_weights:
            check_fits("weights", (B, H, n_q, n_k), self.dtype)
        params = self._param_tuple()
        # drawn last, so that a call that fails its checks leaves the dropout stream alone
        p = self.dropout if self.training else 0.0
        seed = int(self._rng.integers(0, 2**63)) if p > 0 else 0

        out, weights, q_proj, k_proj, v_proj, attn, lse = _C.layer_forward(
            query, key, value, params, H, H_kv, D, mask4, kpm, bool(causal), p, seed,
            bool(need_weights), k_rows, v_rows, length)
        if cache is not None:
            cache.length = n_k
        self._saved = dict(query=query, key=key, value=value, q_proj=q_proj, k_proj=k_proj,
                           v_proj=v_proj, attn=attn, lse=lse, params=params, mask=mask4, kpm=kpm,
                           causal=bool(causal), dropout=p, seed=seed, unbatched=unbatched,
                           key_given=key_given, value_given=value_given, cached=cache is not None)

        if weights is not None and average_weights:
            weights = weights.mean(axis=1)                              # (B, n_q, n_k)
        if unbatched:
            out = out[0]
            weights = None if weights is None else weights[0]
        return out, weights

    __call__.__doc__ = reference.MultiHeadAttention.__call__.__doc__

    def backward(self, d_out):
        s = self._saved
        if s is None:
            raise RuntimeError("backward() needs a forward call first")
        if s["cached"]:
            raise RuntimeError("backward() after a forward with a KV cache is not supported")
        B, n_q, _ = s["query"].shape
        d_out = np.asarray(d_out)
        if d_out.dtype.kind != "f":
            raise TypeError(f"d_out must be a floating-point array, got dtype {d_out.dtype}")
        given_shape = d_out.shape
        if s["unbatched"] and d_out.ndim == 2:
            d_out = d_out[None]
        if d_out.shape != (B, n_q, self.d_model):
            out_shape = (n_q, self.d_model) if s["unbatched"] else (B, n_q, self.d_model)
            raise ValueError(f"d_out has shape {given_shape} but the output has shape {out_shape}")
        d_out = reference.c_array(d_out, self.dtype)

        # an omitted input was the same array as another one: the core adds its gradient
        # there and returns None for it
        d_query, d_key, d_value, grads = _C.layer_backward(
            d_out, s["q_proj"], s["k_proj"], s["v_proj"], s["attn"], s["query"], s["key"],
            s["value"], s["params"], self.n_heads, self.n_kv_heads, self.d_head, s["mask"],
            s["kpm"], s["causal"], s["dropout"], s["seed"],
            key_is_query=not s["key_given"], value_is_key=not s["value_given"], lse=s["lse"])
        names = ("W_q", "W_k", "W_v", "W_o", "b_q", "b_k", "b_v", "b_o", "head_mask")
        self.grads = {n: g for n, g in zip(names, grads) if g is not None}
        if s["unbatched"]:
            d_query, d_key, d_value = (None if d is None else d[0] for d in (d_query, d_key, d_value))
        return d_query, d_key, d_value

    backward.__doc__ = reference.MultiHeadAttention.backward.__doc__

    def attention_norms(self, query, key=None, value=None, *, mask=None, key_padding_mask=None,
                        causal=False, summed=False):
        """Norm-based attention (Kobayashi et al. 2020) of this layer: ||alpha_ij f_h(x_j)||.

        f_h(x_j) = (value_j W_v + b_v)_h (head_mask[h] W_o[rows of head h]), the vector key j
        adds to query i's output through head h, scaled by its weight alpha_ij; the output
        bias is left out. Runs the layer's forward (in eval mode, keeping what backward needs
        from the last call) for the weights, then :func:`mha.analysis.value_norms`.

        Parameters
        ----------
        query, key, value, mask, key_padding_mask, causal
            As for calling the layer (no KV cache).
        summed : bool
            The norm of the sum over heads instead of each head's.

        Returns
        -------
        norms : ndarray, (B, n_heads, n_q, n_k), or (B, n_q, n_k) with ``summed``
            The B axis is dropped for unbatched input; in the layer's dtype.

        Examples
        --------
        >>> layer = MultiHeadAttention(8, 2, seed=0)
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
        _, _, value, unbatched = self._inputs(query, key, value)
        B, n_k, _ = value.shape
        P, H_kv, D = self.params, self.n_kv_heads, self.d_head
        v = _C.matmul(value.reshape(B * n_k, self.vdim), reference.c_array(P["W_v"], self.dtype))
        if "b_v" in P:
            v += P["b_v"]
        v = v.reshape(B, n_k, H_kv, D).transpose(0, 2, 1, 3)            # (B, H_kv, n_k, D)
        W_o = P["W_o"] * np.repeat(np.asarray(self.head_mask, self.dtype), D)[:, None]
        norms = value_norms(weights[None] if unbatched else weights, v, W_o, summed=summed)
        return norms[0] if unbatched else norms
