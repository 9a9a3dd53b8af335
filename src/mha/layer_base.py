"""What the C-backed layer (`mha.layer`) and the NumPy oracle (`mha.reference`) share, written once.

- The parameters: their names and layout, stored (in, out) so that ``x @ W`` is the projection
  (`PARAMS`), their initialisation (`init_params`), the import of a torch.nn.MultiheadAttention
  (`params_from_torch`) and head pruning (`prune_params`).
- `KVCache`, the keys and values of step-by-step decoding.
- `LayerBase`, a layer's configuration and bookkeeping: the constructor, train/eval, head_mask,
  prune_heads, from_torch, new_cache, and the checks of ``__call__`` and ``backward`` around the
  two methods each layer implements, ``_forward`` and ``_backward`` (the size checks, which the
  C layer's binding makes itself, in ``_check_sizes`` and ``_check_d_out``).

Neither layer's arithmetic is here, and this module imports neither layer. A bug here would sit
on both sides of every test that compares the two layers, so tests/test_layer_base.py tests it on
its own (the initialisation and layout against PyTorch's).
"""
from __future__ import annotations

import math
import operator
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping

import numpy as np
from numpy.typing import ArrayLike, DTypeLike

from . import checks

if TYPE_CHECKING:                        # typing.Self is Python 3.11+
    from typing_extensions import Self

__all__ = ["PARAMS", "init_params", "params_from_torch", "prune_params", "KVCache", "LayerBase"]

#: The layer's parameters, in the order `init_params` draws them: weights, then biases.
PARAMS = ("W_q", "W_k", "W_v", "W_o", "b_q", "b_k", "b_v", "b_o")

# past this no machine of ours allocates: say so instead of trying
_PARAMETER_BYTES_LIMIT = 1 << 40


def init_params(d_model: int, n_heads: int, *, n_kv_heads: int | None = None,
                d_head: int | None = None, kdim: int | None = None, vdim: int | None = None,
                bias: bool = True, dtype: DTypeLike = np.float32,
                rng: np.random.Generator | int) -> dict[str, np.ndarray]:
    """Draw a layer's initial parameters like torch.nn.MultiheadAttention.

    The distributions torch.nn.MultiheadAttention draws, generalised to grouped-query heads and
    any d_head: weights U(-a, a), drawn from `rng` in the order W_q, W_k, W_v, W_o (in float64,
    then cast to `dtype`); zero biases.

    - W_q, W_k, W_v when kdim == vdim == d_model: torch's fused ``in_proj_weight`` drawn by
      Xavier-uniform as one matrix, a = sqrt(6 / (d_model + (H + 2 H_kv) d_head)), which is
      sqrt(6 / (4 d_model)) for the usual H d_head = d_model, H_kv = H;
    - otherwise each of W_q, W_k, W_v by Xavier-uniform on its own shape,
      a = sqrt(6 / (fan_in + fan_out)) (torch's separate ``q/k/v_proj_weight``);
    - W_o: nn.Linear's default that torch keeps for ``out_proj``, a = 1 / sqrt(H d_head).

    Parameters
    ----------
    d_model, n_heads : int
        Width of the query and output, number of query heads H.
    n_kv_heads, d_head, kdim, vdim : int, optional
        As `mha.MultiHeadAttention` (checked by `mha.checks.layer_dims`).
    bias : bool
        Include the four biases.
    dtype : {numpy.float32, numpy.float64}, default numpy.float32
        The dtype of the arrays.
    rng : numpy.random.Generator or int
        The generator (advanced in place) or a seed for ``np.random.default_rng``.

    Returns
    -------
    dict of ndarray
        W_q (d_model, H*d_head), W_k (kdim, H_kv*d_head), W_v (vdim, H_kv*d_head),
        W_o (H*d_head, d_model); with bias, b_q (H*d_head,), b_k, b_v (H_kv*d_head,),
        b_o (d_model,). Stored (in, out): ``x @ W`` is the projection.

    Raises
    ------
    TypeError, ValueError
        Bad sizes or dtype (`mha.checks`).
    MemoryError
        The weights would need more than 1 TiB.

    References
    ----------
    torch.nn.MultiheadAttention._reset_parameters and torch.nn.Linear.reset_parameters
    (PyTorch 2.x). X. Glorot and Y. Bengio, "Understanding the difficulty of training deep feedforward neural
    networks", AISTATS 2010.

    Examples
    --------
    >>> p = init_params(8, 2, rng=0)
    >>> p["W_q"].shape, p["b_o"].shape
    ((8, 8), (8,))
    """
    d_model, n_heads, n_kv_heads, d_head, kdim, vdim = checks.layer_dims(
        d_model, n_heads, n_kv_heads, d_head, kdim, vdim)
    dtype = checks.layer_dtype(dtype)
    rng = np.random.default_rng(rng)  # a Generator is returned as is, not copied
    shapes = {                                                          # (fan_in, fan_out)
        "W_q": (d_model, n_heads * d_head),
        "W_k": (kdim, n_kv_heads * d_head),
        "W_v": (vdim, n_kv_heads * d_head),
        "W_o": (n_heads * d_head, d_model),
    }
    n_bytes = sum(fan_in * fan_out for fan_in, fan_out in shapes.values()) * dtype.itemsize
    if n_bytes > _PARAMETER_BYTES_LIMIT:
        raise MemoryError(f"the parameters W_q, W_k, W_v, W_o of d_model={d_model}, "
                          f"n_heads={n_heads}, d_head={d_head} would need {n_bytes / 2**30:.1f} GiB")
    bounds = {name: math.sqrt(6.0 / (fan_in + fan_out)) for name, (fan_in, fan_out) in shapes.items()}
    if kdim == vdim == d_model:
        # torch keeps Q, K, V as one (d_model, H d + 2 H_kv d) matrix and draws it at once
        fused_out = (n_heads + 2 * n_kv_heads) * d_head
        bounds["W_q"] = bounds["W_k"] = bounds["W_v"] = math.sqrt(6.0 / (d_model + fused_out))
    bounds["W_o"] = 1.0 / math.sqrt(n_heads * d_head)   # nn.Linear's default, which torch keeps
    params = {}
    for name, (fan_in, fan_out) in shapes.items():  # this order is part of the contract
        params[name] = rng.uniform(-bounds[name], bounds[name], size=(fan_in, fan_out)).astype(dtype)
    if bias:
        params["b_q"] = np.zeros(n_heads * d_head, dtype)
        params["b_k"] = np.zeros(n_kv_heads * d_head, dtype)
        params["b_v"] = np.zeros(n_kv_heads * d_head, dtype)
        params["b_o"] = np.zeros(d_model, dtype)
    return params


def params_from_torch(module: Any) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """Read the configuration and weights of a torch.nn.MultiheadAttention.

    torch stores Linear weights (out, in); they are transposed here to (in, out). The result
    does not depend on module.batch_first (mha layers are always batch first).

    Parameters
    ----------
    module : torch.nn.MultiheadAttention
        The torch layer (torch is imported here only).

    Returns
    -------
    config : dict
        Constructor arguments of `mha.MultiHeadAttention`: d_model, n_heads, n_kv_heads,
        d_head, kdim, vdim, bias, dropout, dtype.
    params : dict of ndarray
        Like `init_params`, new C-contiguous arrays (float64 if the module is float64, else
        float32).

    Raises
    ------
    TypeError
        `module` is not a torch.nn.MultiheadAttention.
    ValueError
        add_bias_kv=True, add_zero_attn=True, or biases on only some projections (mha has
        none of these).
    """
    import torch  # optional dependency: only this function needs it

    if not isinstance(module, torch.nn.MultiheadAttention):
        raise TypeError(f"expected a torch.nn.MultiheadAttention, got {type(module).__name__}")
    if module.bias_k is not None or module.bias_v is not None:
        raise ValueError("torch.nn.MultiheadAttention with add_bias_kv=True is not supported")
    if module.add_zero_attn:
        raise ValueError("torch.nn.MultiheadAttention with add_zero_attn=True is not supported")
    has_in_bias = module.in_proj_bias is not None
    has_out_bias = module.out_proj.bias is not None
    if has_in_bias != has_out_bias:
        raise ValueError("torch module has a bias on only some projections; mha needs all or none")

    dtype = np.dtype(np.float64 if module.out_proj.weight.dtype == torch.float64 else np.float32)

    def to_numpy(t: Any) -> np.ndarray:
        return t.detach().cpu().to(torch.float64).numpy()

    E = module.embed_dim
    if module._qkv_same_embed_dim:
        W_q, W_k, W_v = np.split(to_numpy(module.in_proj_weight), 3)   # each (E, E), (out, in)
    else:
        W_q = to_numpy(module.q_proj_weight)                            # (E, E)
        W_k = to_numpy(module.k_proj_weight)                            # (E, kdim)
        W_v = to_numpy(module.v_proj_weight)                            # (E, vdim)
    params = {"W_q": W_q.T, "W_k": W_k.T, "W_v": W_v.T, "W_o": to_numpy(module.out_proj.weight).T}
    if has_in_bias:
        b_q, b_k, b_v = np.split(to_numpy(module.in_proj_bias), 3)     # each (E,)
        params.update(b_q=b_q, b_k=b_k, b_v=b_v, b_o=to_numpy(module.out_proj.bias))
    params = {name: np.ascontiguousarray(a, dtype=dtype) for name, a in params.items()}

    config = dict(d_model=E, n_heads=module.num_heads, n_kv_heads=module.num_heads,
                  d_head=module.head_dim, kdim=module.kdim, vdim=module.vdim,
                  bias=has_in_bias, dropout=float(module.dropout), dtype=dtype)
    return config, params


def prune_params(params: Mapping[str, np.ndarray], heads: Iterable[int], n_heads: int,
                 n_kv_heads: int, d_head: int) -> dict[str, np.ndarray]:
    """Return a new params dict without the query heads `heads`.

    Removes those heads' columns of W_q, b_q and rows of W_o, and, since n_kv_heads must equal
    n_heads, the same key/value heads' columns of W_k, b_k, W_v, b_v. The layer's outputs are
    then those of the unpruned layer with ``head_mask[heads] = 0``.

    Parameters
    ----------
    params : dict of ndarray
        As `init_params` returns.
    heads : iterable of int
        Head indices in [0, n_heads); repeats are ignored.
    n_heads, n_kv_heads, d_head : int
        The layer's sizes.

    Returns
    -------
    dict of ndarray
        New arrays (copies even when `heads` is empty).

    Raises
    ------
    ValueError
        Grouped heads (n_kv_heads != n_heads), a head index out of range, or every head.

    Examples
    --------
    >>> p = prune_params(init_params(8, 4, rng=0), [1, 3], n_heads=4, n_kv_heads=4, d_head=2)
    >>> p["W_q"].shape, p["W_o"].shape
    ((8, 4), (4, 8))
    """
    heads = sorted({operator.index(h) for h in heads})
    if not heads:
        return {name: a.copy() for name, a in params.items()}
    if n_kv_heads != n_heads:
        raise ValueError(f"cannot prune heads with grouped key/value heads "
                         f"(n_kv_heads={n_kv_heads} != n_heads={n_heads})")
    for h in heads:
        if not 0 <= h < n_heads:
            raise ValueError(f"head {h} is out of range for n_heads={n_heads}")
    if len(heads) == n_heads:
        raise ValueError(f"cannot prune all {n_heads} heads")

    # feature f of the (H * d_head)-wide projections belongs to head f // d_head
    keep_heads = [h for h in range(n_heads) if h not in heads]
    keep = np.concatenate([np.arange(h * d_head, (h + 1) * d_head) for h in keep_heads])
    pruned = {}
    for name, a in params.items():
        if name in ("W_q", "W_k", "W_v"):
            pruned[name] = np.ascontiguousarray(a[:, keep])             # (in, H' * d_head)
        elif name in ("b_q", "b_k", "b_v"):
            pruned[name] = a[keep].copy()                               # (H' * d_head,)
        elif name == "W_o":
            pruned[name] = np.ascontiguousarray(a[keep, :])             # (H' * d_head, d_model)
        else:
            pruned[name] = a.copy()                                     # b_o
    return pruned


class KVCache:
    """Hold the keys and values of the tokens seen so far, for step-by-step decoding.

    Stored as the projections come out of the core, (batch_size, max_len, n_kv_heads*d_head),
    so that a step appends rows without copying heads apart. Both layers use this class, and the
    causal language models keep one per layer (`append`); the attention kernel reads the heads
    view ``k[:, :, :length]`` (last axis contiguous) in place.

    Parameters
    ----------
    batch_size, n_kv_heads, max_len, d_head : int
        Positive sizes.
    dtype : {numpy.float32, numpy.float64}, default numpy.float32
        The layer's dtype.

    Attributes
    ----------
    k_rows, v_rows : ndarray
        (batch_size, max_len, n_kv_heads*d_head); rows [0, length) are filled. The buffers are
        fixed (written in place, never replaced).
    k, v : ndarray
        Views of k_rows, v_rows as (batch_size, n_kv_heads, max_len, d_head).
    length : int
        Number of cached positions.

    Raises
    ------
    TypeError, ValueError
        Sizes that are not positive ints.
    MemoryError
        Buffers that cannot fit in memory.

    Examples
    --------
    >>> cache = mha.KVCache(batch_size=1, n_kv_heads=2, max_len=16, d_head=4)
    >>> cache.k.shape, cache.length
    ((1, 2, 16, 4), 0)
    """

    def __init__(self, batch_size: int, n_kv_heads: int, max_len: int, d_head: int,
                 dtype: DTypeLike = np.float32) -> None:
        batch_size, max_len = checks.cache_sizes(batch_size, max_len)
        checks.fits("KV cache", (2, batch_size, max_len, n_kv_heads * d_head), dtype)
        self.n_kv_heads, self.d_head = int(n_kv_heads), int(d_head)
        self.k_rows = np.zeros((batch_size, max_len, n_kv_heads * d_head), dtype)
        self.v_rows = np.zeros((batch_size, max_len, n_kv_heads * d_head), dtype)
        self.length = 0
        # the heads views, made once (a decode step appends to them for every layer)
        self._k, self._v = (rows.reshape(batch_size, max_len, self.n_kv_heads, self.d_head)
                            .transpose(0, 2, 1, 3) for rows in (self.k_rows, self.v_rows))

    @property
    def k(self) -> np.ndarray:
        return self._k

    @property
    def v(self) -> np.ndarray:
        return self._v

    @property
    def batch_size(self) -> int:
        return self.k_rows.shape[0]

    @property
    def max_len(self) -> int:
        return self.k_rows.shape[1]

    def reset(self) -> None:
        """Forget the cached tokens (the buffers are reused)."""
        self.length = 0

    def append(self, k: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Write new keys and values after the cached ones; return views of all of them.

        Parameters
        ----------
        k, v : ndarray, shape (batch_size, n_kv_heads, n, d_head)
            The new positions' keys and values (any strides).

        Returns
        -------
        k, v : ndarray, shape (batch_size, n_kv_heads, length, d_head)
            Views of every cached position, this call's included (``length`` has moved on).

        Raises
        ------
        ValueError
            More positions than ``max_len``.
        """
        start, stop = self.length, self.length + k.shape[2]
        if stop > self.max_len:
            raise ValueError(f"cache overflow: {self.length} cached + {k.shape[2]} new "
                             f"positions > max_len={self.max_len}")
        self._k[:, :, start:stop] = k
        self._v[:, :, start:stop] = v
        self.length = stop
        return self._k[:, :, :stop], self._v[:, :, :stop]

    def __repr__(self) -> str:
        return (f"KVCache(batch_size={self.batch_size}, n_kv_heads={self.n_kv_heads}, "
                f"max_len={self.max_len}, d_head={self.d_head}, length={self.length})")


class LayerBase:
    """The configuration and bookkeeping of a multi-head attention layer.

    Subclasses implement the arithmetic:

    - ``_forward(query, key, value, *, mask, key_padding_mask, causal, need_weights,
      head_mask, dropout, seed, cache) -> (out, weights, saved)`` on checked, batched arrays
      (see `__call__`); ``saved`` is a dict of what its ``_backward`` needs;
    - ``_backward(d_out, saved) -> (d_query, d_key, d_value, grads)`` with d_key (d_value) None
      when the key (value) was omitted, its gradient added to the query's (key's); ``saved``
      holds the dict ``_forward`` returned plus key_given and value_given.

    ``__call__`` and ``backward`` apply the dtype policy, batching, defaults and broadcasting;
    the sizes of the arrays against each other and the parameters are checked by
    ``_check_sizes`` and ``_check_d_out``, which the C layer overrides with nothing (its binding
    checks them).

    The constructor's parameters are those of `mha.MultiHeadAttention`.
    """

    # the two methods each subclass implements (see above), declared for the type checker
    _forward: Callable[..., tuple[np.ndarray, np.ndarray | None, dict[str, Any]]]
    _backward: Callable[[np.ndarray, dict[str, Any]], tuple[
        np.ndarray, np.ndarray | None, np.ndarray | None, dict[str, np.ndarray]]]

    def __init__(self, d_model: int, n_heads: int, *, n_kv_heads: int | None = None,
                 d_head: int | None = None, kdim: int | None = None, vdim: int | None = None,
                 bias: bool = True, dropout: float = 0.0, dtype: DTypeLike = np.float32,
                 seed: int | None = None, softcap: float | None = None) -> None:
        (self.d_model, self.n_heads, self.n_kv_heads, self.d_head, self.kdim,
         self.vdim) = checks.layer_dims(d_model, n_heads, n_kv_heads, d_head, kdim, vdim)
        self.bias = bool(bias)
        self.dropout = checks.dropout(dropout)
        self.softcap = checks.softcap(softcap)  # 0.0: no cap
        self.dtype = checks.layer_dtype(dtype)
        # one generator: the initial weights, then one dropout seed per training forward
        self._rng = checks.generator(seed)
        self.params = init_params(self.d_model, self.n_heads, n_kv_heads=self.n_kv_heads,
                                  d_head=self.d_head, kdim=self.kdim, vdim=self.vdim,
                                  bias=self.bias, dtype=self.dtype, rng=self._rng)
        self.grads = self._zero_grads()
        self.head_mask = np.ones(self.n_heads, self.dtype)
        self.training = True
        self._saved: dict[str, Any] | None = None  # what backward needs from the last forward

    @property
    def scale(self) -> float:
        """The softmax temperature, 1 / sqrt(d_head)."""
        return 1.0 / math.sqrt(self.d_head)

    def train(self, mode: bool = True) -> Self:
        """Switch dropout on or off.

        Parameters
        ----------
        mode : bool, default True
            True: dropout on (training); False: off.

        Returns
        -------
        self
            The layer, for chaining.
        """
        self.training = bool(mode)
        return self

    def eval(self) -> Self:
        """Switch dropout off.

        Returns
        -------
        self
            The layer, for chaining.
        """
        return self.train(False)

    def num_parameters(self) -> int:
        """Count the trainable scalars (weights and biases; head_mask is not a parameter).

        Returns
        -------
        int
            The total size of ``params``.
        """
        return sum(a.size for a in self.params.values())

    def new_cache(self, batch_size: int, max_len: int) -> KVCache:
        """Make an empty KV cache for step-by-step decoding.

        Calling the layer with ``cache=cache`` appends the new keys and values and attends over
        everything cached; step-by-step decoding equals the full causal forward, row for row.

        Parameters
        ----------
        batch_size : int
            The number of sequences.
        max_len : int
            The most tokens each sequence may hold.

        Returns
        -------
        KVCache
            Empty (``length == 0``), in the layer's dtype.

        Examples
        --------
        >>> layer = mha.MultiHeadAttention(8, 2, seed=0).eval()
        >>> x = np.random.default_rng(0).standard_normal((1, 4, 8)).astype(np.float32)
        >>> cache = layer.new_cache(1, 4)
        >>> steps = [layer(x[:, i:i + 1], causal=True, cache=cache)[0] for i in range(4)]
        >>> bool(np.allclose(np.concatenate(steps, axis=1), layer(x, causal=True)[0], atol=1e-6))
        True
        """
        return KVCache(batch_size, self.n_kv_heads, max_len, self.d_head, self.dtype)

    def _zero_grads(self) -> dict[str, np.ndarray]:
        grads = {name: np.zeros_like(a) for name, a in self.params.items()}
        grads["head_mask"] = np.zeros(self.n_heads, self.dtype)
        return grads

    def __call__(self, query: ArrayLike, key: ArrayLike | None = None,
                 value: ArrayLike | None = None, *, mask: ArrayLike | None = None,
                 key_padding_mask: ArrayLike | None = None, causal: bool = False,
                 need_weights: bool = True, average_weights: bool = False,
                 cache: KVCache | None = None) -> tuple[np.ndarray, np.ndarray | None]:
        """Attend from query to key and value.

        Parameters
        ----------
        query : array_like, shape (B, n_q, d_model) or (n_q, d_model)
            Floating; unbatched input drops the B axis of the results.
        key : array_like, shape (B, n_k, kdim), optional
            Defaults to ``query`` (self-attention).
        value : array_like, shape (B, n_k, vdim), optional
            Defaults to ``key``.
        mask : array_like, optional
            Bool (True = may attend, the OPPOSITE of torch.nn.MultiheadAttention) or float (added
            to the scores), broadcasting to (B, n_heads, n_q, n_k).
        key_padding_mask : array_like of bool, shape (B, n_k), optional
            True = real token, False = padding.
        causal : bool, default False
            Query i may attend key j iff j <= i + (n_k - n_q) (bottom-right aligned).
        need_weights : bool, default True
            Return the attention weights (False allocates no n_q x n_k buffer).
        average_weights : bool, default False
            Return the weights averaged over the heads, (B, n_q, n_k).
        cache : KVCache, optional
            From :meth:`new_cache`: the new keys and values are appended to it and every cached
            position is attended.

        Returns
        -------
        out : ndarray, shape (B, n_q, d_model)
            In the layer's dtype.
        weights : ndarray, shape (B, n_heads, n_q, n_k) or (B, n_q, n_k), or None
            The softmax probabilities before dropout; None with ``need_weights=False``.

        Raises
        ------
        TypeError
            Non-floating inputs or masks of the wrong dtype.
        ValueError
            Shapes that do not fit (the message names the argument), or a full cache.
        MemoryError
            Outputs that cannot fit in memory.
        """
        key_given, value_given = key is not None, value is not None
        query, key, value, unbatched = checks.layer_inputs(
            query, key, value, d_model=self.d_model, kdim=self.kdim, vdim=self.vdim, dtype=self.dtype)
        B, n_q, _ = query.shape
        n_k = key.shape[1]
        if cache is not None:
            if not isinstance(cache, KVCache):
                raise TypeError(f"cache must come from layer.new_cache(), not {type(cache).__name__}")
            n_k += cache.length
        if key_padding_mask is not None:
            key_padding_mask = checks.key_padding_mask(key_padding_mask, unbatched)
        head_mask = checks.head_mask(self.head_mask, self.dtype)
        self._check_sizes(query, key, value, key_padding_mask=key_padding_mask, head_mask=head_mask,
                          cache=cache)
        scores_shape = (B, self.n_heads, n_q, n_k)
        mask = checks.mask(mask, scores_shape, self.dtype)
        causal = checks.flag(causal, "causal")
        need_weights = checks.flag(need_weights, "need_weights")
        average_weights = checks.flag(average_weights, "average_weights")
        if need_weights:
            checks.fits("weights", scores_shape, self.dtype)
        # a call that fails (here or in the binding's checks) leaves the dropout stream alone
        p = self.dropout if self.training else 0.0
        state = self._rng.bit_generator.state if p > 0 else None
        seed = int(self._rng.integers(0, 2**63)) if p > 0 else None
        try:
            out, weights, saved = self._forward(
                query, key, value, mask=mask, key_padding_mask=key_padding_mask, causal=causal,
                need_weights=need_weights, head_mask=head_mask, dropout=p, seed=seed, cache=cache)
        except BaseException:
            if state is not None:
                self._rng.bit_generator.state = state
            raise
        self._saved = dict(saved, out_shape=out.shape, unbatched=unbatched, key_given=key_given,
                           value_given=value_given, cached=cache is not None)

        if weights is not None and average_weights:
            weights = weights.mean(axis=1)                              # (B, n_q, n_k)
        if unbatched:
            out = out[0]
            weights = None if weights is None else weights[0]
        return out, weights

    def backward(self, d_out: ArrayLike
                 ) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
        """Backpropagate a gradient through the last forward call; fill ``self.grads``.

        Parameters
        ----------
        d_out : array_like, shape of the last output
            The gradient of the loss with respect to ``out``.

        Returns
        -------
        d_query : ndarray
            The gradient with respect to ``query`` (in self-attention, the whole input gradient).
        d_key, d_value : ndarray or None
            The gradients with respect to ``key`` and ``value``; None for one that was omitted (its
            gradient is added to the query's, or the key's).

        Raises
        ------
        RuntimeError
            No forward call to backpropagate through (or one made with a KV cache).
        TypeError
            A non-floating ``d_out``.
        ValueError
            ``d_out`` of the wrong shape.
        """
        s = self._saved
        if s is None:
            raise RuntimeError("backward() needs a forward call first")
        if s["cached"]:
            raise RuntimeError("backward() after a forward with a KV cache is not supported")
        d_out = checks.d_out(d_out, s["unbatched"], self.dtype)
        self._check_d_out(d_out, s["out_shape"], s["unbatched"])
        d_query, d_key, d_value, self.grads = self._backward(d_out, s)
        if s["unbatched"]:
            d_query = d_query[0]
            d_key, d_value = (None if d is None else d[0] for d in (d_key, d_value))
        return d_query, d_key, d_value

    def _check_sizes(self, query: np.ndarray, key: np.ndarray, value: np.ndarray, *,
                     key_padding_mask: np.ndarray | None, head_mask: np.ndarray,
                     cache: KVCache | None) -> None:
        """Check a call's sizes against each other and the parameters: widths, batch sizes,
        key/value lengths, key_padding_mask, head_mask and the cache (``mha.checks``).

        For the NumPy oracle, which has no binding to check them; the C layer leaves them to
        its binding (csrc/module.c) and overrides this with nothing.
        """
        checks.layer_sizes(query, key, value, d_model=self.d_model, kdim=self.kdim, vdim=self.vdim)
        B, n_k = key.shape[0], key.shape[1]
        if cache is not None:
            checks.cache(cache, B, self.n_kv_heads, self.d_head, self.dtype, n_new=n_k)
            n_k += cache.length
        if key_padding_mask is not None:
            checks.key_padding_shape(key_padding_mask, B, n_k)
        checks.head_mask_shape(head_mask, self.n_heads)

    def _check_d_out(self, d_out: np.ndarray, out_shape: tuple[int, ...], unbatched: bool) -> None:
        """Check that backward's d_out has the output's shape (see `_check_sizes`)."""
        checks.d_out_shape(d_out, out_shape, unbatched)

    def prune_heads(self, heads: Iterable[int]) -> None:
        """Remove query heads for real: smaller W matrices, the outputs of ``head_mask[heads] = 0``.

        With n_kv_heads == n_heads the same key/value heads go too. Existing caches become invalid.

        Parameters
        ----------
        heads : iterable of int
            Current head indices in [0, n_heads).

        Raises
        ------
        ValueError
            Grouped heads, an index out of range, or every head.

        Examples
        --------
        >>> layer = mha.MultiHeadAttention(8, 4, seed=0)
        >>> x = np.ones((1, 3, 8), np.float32)
        >>> layer.head_mask[[1, 2]] = 0
        >>> masked, _ = layer(x)
        >>> layer.head_mask[:] = 1
        >>> layer.prune_heads([1, 2])
        >>> layer.n_heads, bool(np.allclose(layer(x)[0], masked, atol=1e-6))
        (2, True)
        """
        heads = sorted({operator.index(h) for h in heads})
        if not heads:
            return
        self.params = prune_params(self.params, heads, self.n_heads, self.n_kv_heads, self.d_head)
        keep = [h for h in range(self.n_heads) if h not in heads]
        self.head_mask = np.asarray(self.head_mask, dtype=self.dtype)[keep].copy()
        self.n_heads = self.n_kv_heads = len(keep)
        self.grads = self._zero_grads()
        self._saved = None

    @classmethod
    def from_torch(cls, module: Any) -> Self:
        """Build a layer with the weights, configuration and train/eval mode of a torch module.

        The layer is batch first whatever ``module.batch_first`` says. torch's bool masks mean
        True = masked: pass ``~mask`` here, and ``~key_padding_mask``.

        Parameters
        ----------
        module : torch.nn.MultiheadAttention
            The torch layer (torch is imported here only).

        Returns
        -------
        layer
            A layer of this class (``mha.MultiHeadAttention`` or the reference one).

        Raises
        ------
        TypeError
            Not a torch.nn.MultiheadAttention.
        ValueError
            Options mha does not have (add_bias_kv, add_zero_attn, biases on some projections only).
        """
        config, params = params_from_torch(module)
        layer = cls(**config)
        layer.params = params
        layer.grads = layer._zero_grads()
        layer.training = bool(module.training)
        return layer

    def __repr__(self) -> str:
        extra = ""
        if self.n_kv_heads != self.n_heads:
            extra += f", n_kv_heads={self.n_kv_heads}"
        if self.kdim != self.d_model or self.vdim != self.d_model:
            extra += f", kdim={self.kdim}, vdim={self.vdim}"
        cap = f", softcap={self.softcap}" if self.softcap else ""
        return (f"{type(self).__name__}(d_model={self.d_model}, n_heads={self.n_heads}, "
                f"d_head={self.d_head}{extra}, bias={self.bias}, dropout={self.dropout}{cap}, "
                f"dtype={self.dtype.name})")
