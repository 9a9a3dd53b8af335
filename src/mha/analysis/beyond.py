"""Beyond raw attention weights: attention rollout and attention flow through the layers
(Abnar & Zuidema 2020), and the norms of what each key adds to a query's output (Kobayashi et
al. 2020)."""
from __future__ import annotations

import numpy as np
from numpy.typing import ArrayLike

from ..functional import head_write_norms
from ._inputs import _float_array, _selection

__all__ = ["HEAD_FUSIONS", "attention_rollout", "attention_flow", "value_norms"]

#: How :func:`attention_rollout` and :func:`attention_flow` combine the heads of a layer.
HEAD_FUSIONS = ("mean", "max", "min")


def _fused_layers(attentions: ArrayLike, head_fusion: str, residual: bool,
                  name: str = "attentions") -> np.ndarray:
    """(..., L, H, n, n) -> (..., L, n, n): heads fused, then 0.5 A + 0.5 I renormalised."""
    att = _float_array(attentions, name, 4, "(layers, heads, n, n) or (..., layers, heads, n, n)")
    n_q, n_k = att.shape[-2:]
    if n_q != n_k:
        raise ValueError(f"{name} has shape {att.shape}: rollout and flow need self-attention "
                         f"(n_q == n_k), got {n_q} queries and {n_k} keys")
    if head_fusion not in HEAD_FUSIONS:
        raise ValueError(f"head_fusion={head_fusion!r}: expected one of {HEAD_FUSIONS}")
    fused = getattr(att, head_fusion)(axis=-3)                   # (..., L, n, n)
    if residual:
        fused = fused + np.eye(n_k, dtype=fused.dtype)           # (A + I) / rowsum = 0.5 A + 0.5 I
        fused /= fused.sum(axis=-1, keepdims=True)               # for rows that sum to 1
    return fused


def attention_rollout(attentions: ArrayLike, *, head_fusion: str = "mean",
                      residual: bool = True) -> np.ndarray:
    r"""Compute attention rollout: the share of each layer's positions from each input token.

    Attention rollout (Abnar & Zuidema 2020) follows the attention through all the layers
    below layer l: how much of each position after layer l comes from each input token.

    Per layer the heads are fused, :math:`A_l = \mathrm{fuse}_h(\alpha_{l,h})` (mean, max or
    min over heads); with ``residual`` the skip connection is added as an identity and rows
    are renormalised, :math:`A_l \leftarrow (A_l + I) / \mathrm{rowsum}(A_l + I)`, which is
    :math:`0.5 A_l + 0.5 I` when the rows of :math:`A_l` sum to 1. Then

    .. math:: R_0 = A_0, \qquad R_l = A_l R_{l-1}.

    Parameters
    ----------
    attentions : array_like, shape (..., L, H, n, n)
        Softmax attention weights of every layer and head, rows = queries (e.g.
        ``model.attentions(text)[1]``; a list of per-layer (1, H, n, n) arrays such as Hugging
        Face's ``outputs.attentions`` is stacked). float32 stays float32, other real dtypes are
        computed in float64. Leading axes (a batch) are kept.
    head_fusion : {"mean", "max", "min"}
        How the heads of a layer are combined.
    residual : bool
        Add the residual connection as above (the paper's choice). Without it the fused
        weights are used as they are.

    Returns
    -------
    rollout : ndarray, shape (..., L, n, n)
        ``rollout[l, i, j]``: the share of position i after layer l that comes from input token
        j. Rows sum to 1 when the attention rows do (mean fusion) or with ``residual``.

    Raises
    ------
    ValueError
        Fewer than 4 axes, n_q != n_k, or an unknown ``head_fusion``.
    TypeError
        Non-real input.

    References
    ----------
    S. Abnar and W. Zuidema, "Quantifying Attention Flow in Transformers", ACL 2020,
    https://arxiv.org/abs/2005.00928.

    Examples
    --------
    >>> rng = np.random.default_rng(0)
    >>> w = rng.random((2, 3, 4, 4)); w /= w.sum(-1, keepdims=True)   # 2 layers, 3 heads
    >>> r = attention_rollout(w)
    >>> r.shape, bool(np.allclose(r.sum(-1), 1))
    ((2, 4, 4), True)
    """
    fused = _fused_layers(attentions, head_fusion, residual)
    out = np.empty_like(fused)
    out[..., 0, :, :] = fused[..., 0, :, :]
    for l in range(1, fused.shape[-3]):                          # a loop over layers only
        out[..., l, :, :] = fused[..., l, :, :] @ out[..., l - 1, :, :]
    return out


def attention_flow(attentions: ArrayLike, *, head_fusion: str = "mean", residual: bool = True,
                   queries: ArrayLike | None = None, normalize: bool = True,
                   progress: bool | None = None) -> np.ndarray:
    r"""Compute attention flow: the maximum flow from each last-layer position to each token.

    Attention flow (Abnar & Zuidema 2020) is the maximum flow from each position after the
    last layer to each input token through the attention graph.

    The graph has a node per (layer boundary, position): input tokens at level 0, the output
    of layer l at level l + 1, and an edge from position a at level l + 1 to position b at
    level l with capacity :math:`A_l[a, b]`, the fused and residual-corrected weights of
    :func:`attention_rollout`. ``flow[i, j]`` is the value of the maximum flow from the last
    level's node i to input node j; with ``normalize`` each row is divided by its sum, as the
    authors' code does. Rollout multiplies the weights along every path; flow asks how much
    can pass through the narrowest cut, so it spreads more evenly over tokens.

    The maximum flows are exact (Dinic's algorithm in C, ``csrc/flow.c``, on the capacities
    rounded to multiples of :math:`2^{-61}` times the largest row sum: within about
    :math:`10^{-12}` of the real values at 128 tokens), n flows per query position, spread
    over ``mha.set_num_threads`` threads.

    Parameters
    ----------
    attentions : array_like, shape (L, H, n, n)
        Attention weights of one text, rows = queries (as :func:`attention_rollout`).
    head_fusion : {"mean", "max", "min"}
        How the heads of a layer are combined, as in :func:`attention_rollout`.
    residual : bool
        As in :func:`attention_rollout`.
    queries : int, sequence of int or bool array (n,), optional
        The positions of the last layer to compute the flow from (default all): the flow from
        [CLS] alone is ``queries=0`` and costs 1/n of the whole matrix.
    normalize : bool
        Divide each row by its sum (rows with no flow stay 0).
    progress : bool, optional
        Show a progress bar (tqdm.auto); default: when the work is large (n > 128).

    Returns
    -------
    flow : ndarray, shape (n_queries, n)
        In the input's float dtype (float32 or float64). n_queries = n by default.

    Raises
    ------
    ValueError
        Bad shape, an unknown ``head_fusion``, negative or non-finite weights.

    Notes
    -----
    The cost grows as L n^4 in the worst case: 128 tokens and 6 layers take a few seconds,
    512 tokens far longer (use ``queries``). Time on this project's 2-core test machine is in
    the README.

    References
    ----------
    S. Abnar and W. Zuidema, "Quantifying Attention Flow in Transformers", ACL 2020,
    https://arxiv.org/abs/2005.00928.
    E. A. Dinic, "Algorithm for solution of a problem of maximum flow in a network with power
    estimation", Soviet Math. Doklady 11, 1970.

    Examples
    --------
    >>> rng = np.random.default_rng(0)
    >>> w = rng.random((3, 2, 5, 5)); w /= w.sum(-1, keepdims=True)
    >>> f = attention_flow(w)
    >>> f.shape, bool(np.allclose(f.sum(-1), 1))
    ((5, 5), True)
    """
    from .. import _core

    fused = _fused_layers(attentions, head_fusion, residual)
    if fused.ndim != 3:
        raise ValueError(f"attentions has shape {np.shape(attentions)}: attention_flow takes one "
                         "text, (layers, heads, n, n)")
    n = fused.shape[-1]
    capacities = np.ascontiguousarray(fused, dtype=np.float64)
    if not np.all(np.isfinite(capacities)) or capacities.min(initial=0.0) < 0:
        raise ValueError("attentions must be finite and >= 0 (softmax weights)")
    rows = np.arange(n) if queries is None else np.atleast_1d(_selection(queries, n, "queries"))
    rows = rows.astype(np.int64)
    if progress is None:
        progress = n > 128 and len(rows) > 8
    chunks = np.array_split(rows, min(len(rows), 16)) if progress else [rows]
    flow = np.empty((len(rows), n))
    bar = None
    if progress:
        from tqdm.auto import tqdm
        bar = tqdm(total=len(rows), desc="attention flow", unit="query")
    done = 0
    try:
        for chunk in chunks:
            chunk = np.ascontiguousarray(chunk)
            flow[done:done + len(chunk)] = _core.attention_flow(capacities, sources=chunk)
            done += len(chunk)
            if bar is not None:
                bar.update(len(chunk))
    finally:
        if bar is not None:
            bar.close()
    if normalize:
        total = flow.sum(axis=-1, keepdims=True)
        flow = np.divide(flow, total, out=np.zeros_like(flow), where=total > 0)
    return flow.astype(fused.dtype, copy=False)


def value_norms(weights: ArrayLike, values: ArrayLike, W_o: ArrayLike, *,
                summed: bool = False) -> np.ndarray:
    r"""Compute norm-based attention: the length of what each key adds to each query's output.

    Norm-based attention (Kobayashi et al. 2020) measures
    :math:`\|\alpha_{ij} f_h(x_j)\|` instead of the weight :math:`\alpha_{ij}`.

    A head's output for query i is :math:`\sum_j \alpha_{h,ij} v_{h,j}`, and after the output
    projection its contribution to the layer's output is
    :math:`\sum_j \alpha_{h,ij} f_h(x_j)` with :math:`f_h(x_j) = v_{h,j} W_o^{(h)}`, where
    :math:`v_{h,j} = (x_j W_v + b_v)_h` is the value vector and :math:`W_o^{(h)}` the head's
    ``d_head`` rows of the output projection (the output bias :math:`b_o` is left out, as in
    the paper). Per head

    .. math:: N_{h,ij} = \alpha_{h,ij} \, \|f_h(x_j)\|,

    and over the heads of a layer (what the layer adds for key j)

    .. math:: N_{ij} = \Big\|\sum_h \alpha_{h,ij} f_h(x_j)\Big\|
              = \sqrt{\alpha_{:,ij}^\top G_j \, \alpha_{:,ij}}, \quad
              G_j[h, h'] = \langle f_h(x_j), f_{h'}(x_j) \rangle,

    a quadratic form in the weights with each key's Gram matrix, so no vector is built per
    (query, key) pair. The :math:`f_h(x_j)` are products on mha's C GEMM.

    Parameters
    ----------
    weights : array_like, shape (..., H, n_q, n_k)
        Softmax attention weights of one layer, rows = queries.
    values : array_like, shape (..., H_kv, n_k, d_head)
        The value vectors :math:`x W_v + b_v` split into heads (H_kv = H, or a divisor of H
        for grouped-query attention, where query head h reads value head h // (H // H_kv)).
        Leading axes match ``weights``'.
    W_o : array_like, shape (H * d_head, d_model)
        The output projection stored (in, out), so that ``heads @ W_o`` is the projection;
        rows h*d_head .. (h+1)*d_head - 1 belong to head h.
    summed : bool
        Return the norm of the sum over heads, (..., n_q, n_k), instead of each head's.

    Returns
    -------
    norms : ndarray, shape (..., H, n_q, n_k), or (..., n_q, n_k) with ``summed``
        The norms, float32 if every input is float32, else float64.

    Raises
    ------
    ValueError
        Shapes that do not fit together (the message names the argument).
    TypeError
        Non-real input.

    References
    ----------
    G. Kobayashi, T. Kuribayashi, S. Yokoi and K. Inui, "Attention is Not Only a Weight:
    Analyzing Transformers with Vector Norms", EMNLP 2020, https://arxiv.org/abs/2004.10102.

    Examples
    --------
    >>> rng = np.random.default_rng(0)
    >>> w = rng.random((2, 4, 4)); w /= w.sum(-1, keepdims=True)      # 2 heads, 4 tokens
    >>> v = rng.standard_normal((2, 4, 3))                             # d_head = 3
    >>> W_o = rng.standard_normal((6, 5))                              # d_model = 5
    >>> value_norms(w, v, W_o).shape, value_norms(w, v, W_o, summed=True).shape
    ((2, 4, 4), (4, 4))
    """
    w = _float_array(weights, "weights", 3, "(..., heads, n_q, n_k)")
    v = _float_array(values, "values", 3, "(..., kv_heads, n_k, d_head)")
    W = _float_array(W_o, "W_o", 2, "(heads * d_head, d_model)")
    dtype = np.result_type(w.dtype, v.dtype, W.dtype)
    H, n_q, n_k = w.shape[-3:]
    H_kv, n_kv, d_head = v.shape[-3:]
    if n_kv != n_k:
        raise ValueError(f"values has shape {v.shape} but weights has shape {w.shape}: "
                         f"values need n_k = {n_k} positions")
    if H_kv < 1 or H % H_kv:
        raise ValueError(f"values has {H_kv} heads but weights has {H}: the value heads must "
                         "divide the query heads")
    if v.shape[:-3] != w.shape[:-3]:
        raise ValueError(f"values has leading shape {v.shape[:-3]} but weights has "
                         f"{w.shape[:-3]}: they must match")
    if W.ndim != 2 or W.shape[0] != H * d_head:
        raise ValueError(f"W_o has shape {W.shape}: expected ({H * d_head}, d_model) for "
                         f"{H} heads of width {d_head}")
    return head_write_norms(w.astype(dtype, copy=False), v.astype(dtype, copy=False),
                            np.ascontiguousarray(W, dtype=dtype), summed)
