"""Activation patching: which activations of a model carry the difference between two inputs.

A clean input gives the answer, a corrupted one does not. Each patch runs the model on the
corrupted input with one activation (a layer's residual at one position, a head's output, its
queries, its pattern, ...) replaced by the clean run's, and measures how far the output moves
back towards the clean one with ``patching_metric``. The functions have TransformerLens's names,
arguments and result shapes (``transformer_lens.patching``): one generic sweep,
:func:`generic_activation_patch`, and one small function per kind of activation.

    >>> _, clean_cache = model.run_with_cache(clean_ids)                 # doctest: +SKIP
    >>> def logit_diff(logits):                                          # doctest: +SKIP
    ...     return logits[0, -1, paris] - logits[0, -1, rome]
    >>> mha.patching.get_act_patch_resid_pre(model, corrupted_ids, clean_cache,
    ...                                      logit_diff)                 # doctest: +SKIP

How a sweep runs: one forward of the corrupted input keeps each layer's ``hook_resid_pre``;
a patch at layer l then resumes from that residual and runs layers l .. L-1 only (the layers
before it are the same in every patched run), and the patches of one layer run together, as
copies of the corrupted batch stacked on the batch axis. The metric still sees one run's
output at a time: what ``model.run_with_hooks(corrupted_tokens, ...)`` returns as output, the
logits of a causal model or the last hidden state of an encoder.

Grouped-query models: ``z``, ``q`` and ``pattern`` are patched per query head, ``k`` and
``v`` per key/value head (their head axis has ``n_kv_heads`` entries).
"""
from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Union

import numpy as np
from numpy.typing import ArrayLike

__all__ = [
    "generic_activation_patch",
    "layer_pos_patch_setter", "layer_pos_head_vector_patch_setter",
    "layer_head_vector_patch_setter", "layer_head_pattern_patch_setter",
    "layer_head_pos_pattern_patch_setter", "layer_head_dest_src_pos_pattern_patch_setter",
    "get_act_patch_resid_pre", "get_act_patch_resid_mid", "get_act_patch_attn_out",
    "get_act_patch_mlp_out",
    "get_act_patch_attn_head_out_all_pos", "get_act_patch_attn_head_q_all_pos",
    "get_act_patch_attn_head_k_all_pos", "get_act_patch_attn_head_v_all_pos",
    "get_act_patch_attn_head_pattern_all_pos",
    "get_act_patch_attn_head_out_by_pos", "get_act_patch_attn_head_q_by_pos",
    "get_act_patch_attn_head_k_by_pos", "get_act_patch_attn_head_v_by_pos",
    "get_act_patch_attn_head_pattern_by_pos", "get_act_patch_attn_head_pattern_dest_src_pos",
    "get_act_patch_attn_head_all_pos_every", "get_act_patch_attn_head_by_pos_every",
    "get_act_patch_block_every", "AXES",
]

#: metric(output) -> a scalar: output is the logits (B, n, vocab) of a causal model or the
#: last hidden state (B, n, d_model) of an encoder ((n, ...) for one text or 1-D ids)
Metric = Callable[[np.ndarray], Any]
#: patch_setter(corrupted_activation, index, clean_activation) -> the patched activation (or
#: None after editing it in place); index: the cell's indices, layer first
PatchSetter = Callable[[np.ndarray, Sequence[int], np.ndarray], Union[np.ndarray, None]]

#: the axes a sweep can run over; "head" and "head_index" count key/value heads for k and v
AXES = ("layer", "pos", "head_index", "head", "src_pos", "dest_pos")

#: rows (batch x positions) and output bytes that one stacked forward of a sweep may hold
_ROWS_PER_FORWARD = 512
_OUTPUT_BYTES = 64 << 20


def generic_activation_patch(model: Any, corrupted_tokens: str | Sequence[str] | ArrayLike,
                             clean_cache: Mapping[Any, np.ndarray], patching_metric: Metric,
                             patch_setter: PatchSetter, activation_name: str,
                             index_axis_names: Sequence[str] | None = None,
                             index_df: ArrayLike | None = None, return_index_df: bool = False,
                             *, progress: bool = True
                             ) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
    """Patch one kind of activation cell by cell and measure each patched run.

    For every cell (a tuple of indices, layer first) the model runs on the corrupted input
    with the activation ``activation_name`` of that layer passed through
    ``patch_setter(corrupted_activation, index, clean_activation)``, and
    ``patching_metric`` is taken of its output.

    Parameters
    ----------
    model : TransformerModel
        A model of :mod:`mha.models`.
    corrupted_tokens : str, list of str, or array_like of int, shape (n,) or (B, n)
        The corrupted input, as ``model.run_with_hooks`` takes it.
    clean_cache : ActivationCache
        The clean run's activations (``model.run_with_cache(clean)``), of the same batch size
        and length as the corrupted input; it must hold ``activation_name`` at every layer
        swept.
    patching_metric : callable
        ``metric(output) -> float``: output is what the corrupted run gives, the logits
        (B, n, vocab) of a causal model or the last hidden state (B, n, d_model) of an
        encoder, without the batch axis for one text or 1-D ids.
    patch_setter : callable
        ``(corrupted_activation, index, clean_activation) -> patched``; both activations
        batch first, as the cache holds them; it may edit the corrupted one in place.
    activation_name : str
        A short name (``"resid_pre"``, ``"z"``, ``"pattern"``, ... as :func:`get_act_name`
        takes it).
    index_axis_names : sequence of str, optional
        The axes to sweep over in full, from :data:`AXES`, ``"layer"`` first.
    index_df : array_like of int, shape (cells, axes), optional
        The cells to patch instead (a pandas DataFrame of indices works), layer first; the
        result then has one entry per row.
    return_index_df : bool, default False
        Also return the cells, an int array (cells, axes), in the order they were patched.
    progress : bool, default True
        A progress bar (tqdm) over the cells.

    Returns
    -------
    ndarray of float64
        The metric of each patched run: shape (range of each axis) with
        ``index_axis_names``, (cells,) with ``index_df``.

    Raises
    ------
    KeyError
        ``activation_name`` is no hook point of the model (the message names the nearest),
        or the clean cache does not hold it.
    ValueError
        An unknown axis, both or neither of ``index_axis_names`` and ``index_df``, a cell out
        of range, a clean cache of another shape than the corrupted run, or a metric that is
        not a scalar.

    Examples
    --------
    Each head's output at the last position only, on MiniLM (6 layers, 12 heads):

    >>> model = mha.models.load("minilm")
    >>> _, clean_cache = model.run_with_cache("The cat sat")
    >>> def last_head(corrupted, index, clean):
    ...     _, head = index
    ...     corrupted[:, -1, head] = clean[:, -1, head]
    >>> scores = generic_activation_patch(model, "The dog sat", clean_cache,
    ...     lambda hidden: hidden[-1, 0], last_head, "z", ("layer", "head"),
    ...     progress=False)
    >>> scores.shape
    (6, 12)
    """
    if (index_axis_names is None) == (index_df is None):
        raise ValueError("give either index_axis_names or index_df")
    run = _CorruptedRun(model, corrupted_tokens)
    cells, shape = _cells(model, run, activation_name, index_axis_names, index_df)
    results = np.empty(len(cells), dtype=np.float64)
    from tqdm.auto import tqdm

    with tqdm(total=len(cells), desc=f"patching {activation_name}", disable=not progress,
              leave=False) as bar:
        for layer in np.unique(cells[:, 0]):
            rows = np.flatnonzero(cells[:, 0] == layer)
            name = run.hook_name(activation_name, int(layer))
            clean = clean_cache[name]
            for start in range(0, len(rows), run.cells_per_forward):
                chunk = rows[start:start + run.cells_per_forward]
                indices = [tuple(int(i) for i in cells[r]) for r in chunk]
                results[chunk] = run.patched(int(layer), name, clean, indices, patch_setter,
                                             patching_metric)
                bar.update(len(chunk))
    out = results.reshape(shape)
    return (out, cells) if return_index_df else out


def _cells(model: Any, run: _CorruptedRun, activation_name: str,
           index_axis_names: Sequence[str] | None, index_df: ArrayLike | None
           ) -> tuple[np.ndarray, tuple[int, ...]]:
    """The cells of a sweep, an int array (cells, axes) layer first, and the result's shape."""
    head_count = model.n_heads
    point = run.hook_name(activation_name, 0).split(".", 2)[-1]
    if point in ("attn.hook_k", "attn.hook_v", "attn.hook_rot_k"):
        head_count = model.n_kv_heads
    ranges = {"layer": model.n_layers, "pos": run.n, "src_pos": run.n, "dest_pos": run.n,
              "head_index": head_count, "head": head_count}
    if index_axis_names is not None:
        unknown = [a for a in index_axis_names if a not in ranges]
        if unknown or not index_axis_names or index_axis_names[0] != "layer":
            raise ValueError(f"index_axis_names must start with 'layer' and name axes of "
                             f"{AXES}, got {tuple(index_axis_names)}")
        shape: tuple[int, ...] = tuple(ranges[a] for a in index_axis_names)
        cells = np.array(list(itertools.product(*map(range, shape))), dtype=np.int64)
        cells = cells.reshape(-1, len(shape))
    else:
        cells = np.asarray(index_df)
        if cells.ndim != 2 or cells.shape[0] == 0 or cells.dtype.kind not in "iu":
            raise ValueError(f"index_df must be a non-empty 2-D table of int indices (cells, "
                             f"axes), got {cells.dtype} {cells.shape}")
        if cells[:, 0].min() < 0 or cells[:, 0].max() >= model.n_layers:
            raise ValueError(f"index_df's first column is the layer, in [0, {model.n_layers}),"
                             f" got [{cells[:, 0].min()}, {cells[:, 0].max()}]")
        shape = (len(cells),)
    return cells, shape


class _CorruptedRun:
    """The corrupted input run once, keeping each layer's residual, and patched runs resumed
    from it."""

    def __init__(self, model: Any, tokens: str | Sequence[str] | ArrayLike) -> None:
        self.model = model
        self.valid: list[str] = model.hook_names()
        enc, cache = model.run_with_cache(
            tokens, logits=False,
            names=[f"blocks.{l}.hook_resid_pre" for l in range(model.n_layers)])
        self.single = enc.input_ids.ndim == 1
        self.ids = np.atleast_2d(enc.input_ids)
        self.mask = np.atleast_2d(enc.attention_mask)
        self.type_ids = np.atleast_2d(enc.token_type_ids)
        self.resid = [cache[f"blocks.{l}.hook_resid_pre"] for l in range(model.n_layers)]
        B, self.n = self.ids.shape
        width = model.config.vocab_size if model.has_lm_head else model.d_model
        bytes_per_cell = B * self.n * width * np.dtype(model.dtype).itemsize
        self.cells_per_forward = max(1, min(_ROWS_PER_FORWARD // (B * self.n),
                                            _OUTPUT_BYTES // bytes_per_cell))

    def hook_name(self, activation_name: str, layer: int) -> str:
        """The hook point of ``activation_name`` in ``layer``, checked against the model's."""
        from .models.hooks import get_act_name, unknown_name

        name = get_act_name(activation_name, layer)
        if name not in self.valid:
            raise unknown_name(name, self.valid)
        return name

    def patched(self, layer: int, name: str, clean: np.ndarray,
                indices: Sequence[tuple[int, ...]], patch_setter: PatchSetter,
                metric: Metric) -> np.ndarray:
        """The metric of one patched run per index: the corrupted batch repeated once per
        index, resumed at ``layer`` with copy j patched at ``name`` by index j."""
        from .models.hooks import HookPoints

        model, count = self.model, len(indices)
        B, n = self.ids.shape

        def patch(activation: np.ndarray, _: str) -> None:
            copies = activation.view()
            copies.shape = (count, B, *activation.shape[1:])         # a view, never a copy
            if clean.shape != copies.shape[1:]:
                raise ValueError(f"the clean cache's {name} has shape {clean.shape} but the "
                                 f"corrupted run's has {copies.shape[1:]}: the two inputs "
                                 f"must have the same batch size and length")
            for copy, index in zip(copies, indices):
                out = patch_setter(copy, index, clean)
                if out is not None and out is not copy:
                    copy[...] = out

        hooks = HookPoints(self.valid, None, [(name, patch)])
        x = np.tile(self.resid[layer].reshape(B * n, -1), (count, 1))
        hidden, _ = model._forward(np.tile(self.ids, (count, 1)), np.tile(self.mask, (count, 1)),
                                   np.tile(self.type_ids, (count, 1)), False, None, hooks,
                                   resume=(layer, x))
        last = hidden[:, -1]                                            # (count * B, n, d)
        if model.has_lm_head:
            last = model._logits(last.reshape(count * B * n, -1))
        output = last.reshape(count, B, n, -1)
        values = np.empty(count, dtype=np.float64)
        for j in range(count):
            value = np.asarray(metric(output[j, 0] if self.single else output[j]))
            if value.size != 1 or value.ndim > 1:
                raise ValueError(f"patching_metric must return a scalar, got an array of shape "
                                 f"{value.shape}")
            values[j] = float(value.reshape(()))
        return values


# --- patch setters: write the clean run's part of an activation into the corrupted one ------------

def layer_pos_patch_setter(corrupted_activation: np.ndarray, index: Sequence[int],
                           clean_activation: np.ndarray) -> np.ndarray:
    """Patch position ``pos`` of an activation (batch, pos, ...); index = (layer, pos).

    Parameters
    ----------
    corrupted_activation : ndarray, shape (batch, pos, ...)
        The corrupted run's activation.
    index : (int, int)
        (layer, pos).
    clean_activation : ndarray, shape (batch, pos, ...)
        The clean run's activation, same shape.

    Returns
    -------
    ndarray
        ``corrupted_activation``, patched in place.

    Examples
    --------
    >>> corrupted, clean = np.zeros((1, 3, 2)), np.ones((1, 3, 2))
    >>> layer_pos_patch_setter(corrupted, (0, 1), clean)[0, :, 0]
    array([0., 1., 0.])
    """
    _, pos = index
    corrupted_activation[:, pos] = clean_activation[:, pos]
    return corrupted_activation


def layer_pos_head_vector_patch_setter(corrupted_activation: np.ndarray, index: Sequence[int],
                                       clean_activation: np.ndarray) -> np.ndarray:
    """Patch one head at one position of (batch, pos, head, d_head); index = (layer, pos, head).

    Parameters
    ----------
    corrupted_activation : ndarray, shape (batch, pos, head, d_head)
        The corrupted run's activation: q, k, v, z or result.
    index : (int, int, int)
        (layer, pos, head).
    clean_activation : ndarray, shape (batch, pos, head, d_head)
        The clean run's activation, same shape.

    Returns
    -------
    ndarray
        ``corrupted_activation``, patched in place.

    Examples
    --------
    >>> corrupted, clean = np.zeros((1, 2, 3, 1)), np.ones((1, 2, 3, 1))
    >>> layer_pos_head_vector_patch_setter(corrupted, (0, 1, 2), clean)[0, :, :, 0]
    array([[0., 0., 0.],
           [0., 0., 1.]])
    """
    _, pos, head = index
    corrupted_activation[:, pos, head] = clean_activation[:, pos, head]
    return corrupted_activation


def layer_head_vector_patch_setter(corrupted_activation: np.ndarray, index: Sequence[int],
                                   clean_activation: np.ndarray) -> np.ndarray:
    """Patch one head at every position of (batch, pos, head, d_head); index = (layer, head).

    Parameters
    ----------
    corrupted_activation : ndarray, shape (batch, pos, head, d_head)
        The corrupted run's activation: q, k, v, z or result.
    index : (int, int)
        (layer, head).
    clean_activation : ndarray, shape (batch, pos, head, d_head)
        The clean run's activation, same shape.

    Returns
    -------
    ndarray
        ``corrupted_activation``, patched in place.

    Examples
    --------
    >>> corrupted, clean = np.zeros((1, 2, 3, 1)), np.ones((1, 2, 3, 1))
    >>> layer_head_vector_patch_setter(corrupted, (0, 2), clean)[0, :, :, 0]
    array([[0., 0., 1.],
           [0., 0., 1.]])
    """
    _, head = index
    corrupted_activation[:, :, head] = clean_activation[:, :, head]
    return corrupted_activation


def layer_head_pattern_patch_setter(corrupted_activation: np.ndarray, index: Sequence[int],
                                    clean_activation: np.ndarray) -> np.ndarray:
    """Patch one head's whole pattern (batch, head, dest, src); index = (layer, head).

    Parameters
    ----------
    corrupted_activation : ndarray, shape (batch, head, dest, src)
        The corrupted run's activation: patterns or scores.
    index : (int, int)
        (layer, head).
    clean_activation : ndarray, shape (batch, head, dest, src)
        The clean run's activation, same shape.

    Returns
    -------
    ndarray
        ``corrupted_activation``, patched in place.

    Examples
    --------
    >>> corrupted, clean = np.zeros((1, 2, 2, 2)), np.ones((1, 2, 2, 2))
    >>> layer_head_pattern_patch_setter(corrupted, (0, 1), clean).sum(axis=(2, 3))
    array([[0., 4.]])
    """
    _, head = index
    corrupted_activation[:, head] = clean_activation[:, head]
    return corrupted_activation


def layer_head_pos_pattern_patch_setter(corrupted_activation: np.ndarray, index: Sequence[int],
                                        clean_activation: np.ndarray) -> np.ndarray:
    """Patch one query row of one head's pattern; index = (layer, head, dest).

    Parameters
    ----------
    corrupted_activation : ndarray, shape (batch, head, dest, src)
        The corrupted run's activation: patterns or scores.
    index : (int, int, int)
        (layer, head, dest_pos).
    clean_activation : ndarray, shape (batch, head, dest, src)
        The clean run's activation, same shape.

    Returns
    -------
    ndarray
        ``corrupted_activation``, patched in place.

    Examples
    --------
    >>> corrupted, clean = np.zeros((1, 2, 2, 2)), np.ones((1, 2, 2, 2))
    >>> layer_head_pos_pattern_patch_setter(corrupted, (0, 1, 0), clean)[0, 1]
    array([[1., 1.],
           [0., 0.]])
    """
    _, head, dest = index
    corrupted_activation[:, head, dest] = clean_activation[:, head, dest]
    return corrupted_activation


def layer_head_dest_src_pos_pattern_patch_setter(corrupted_activation: np.ndarray,
                                                 index: Sequence[int],
                                                 clean_activation: np.ndarray) -> np.ndarray:
    """Patch one entry of one head's pattern; index = (layer, head, dest, src).

    Parameters
    ----------
    corrupted_activation : ndarray, shape (batch, head, dest, src)
        The corrupted run's activation: patterns or scores.
    index : (int, int, int, int)
        (layer, head, dest_pos, src_pos).
    clean_activation : ndarray, shape (batch, head, dest, src)
        The clean run's activation, same shape.

    Returns
    -------
    ndarray
        ``corrupted_activation``, patched in place.

    Examples
    --------
    >>> corrupted, clean = np.zeros((1, 2, 2, 2)), np.ones((1, 2, 2, 2))
    >>> layer_head_dest_src_pos_pattern_patch_setter(corrupted, (0, 1, 1, 0), clean)[0, 1]
    array([[0., 0.],
           [1., 0.]])
    """
    _, head, dest, src = index
    corrupted_activation[:, head, dest, src] = clean_activation[:, head, dest, src]
    return corrupted_activation


# --- one function per kind of activation ---------------------------------------------------------

def _example_shape(axes: tuple[str, ...]) -> tuple[int, ...]:
    """The result's shape for MiniLM (6 layers, 12 heads) on 5 tokens."""
    return tuple({"layer": 6, "head": 12, "head_index": 12}.get(a, 5) for a in axes)


def _sweep(function_name: str, activation_name: str, setter: PatchSetter,
           axes: tuple[str, ...], what: str, shape: str) -> Callable[..., np.ndarray]:
    """A named patching function: generic_activation_patch over ``axes`` of one activation."""
    def patch(model: Any, corrupted_tokens: str | Sequence[str] | ArrayLike,
              clean_cache: Mapping[Any, np.ndarray], patching_metric: Metric, *,
              progress: bool = True) -> np.ndarray:
        result = generic_activation_patch(model, corrupted_tokens, clean_cache,
                                          patching_metric, setter, activation_name, axes,
                                          progress=progress)
        assert isinstance(result, np.ndarray)               # no index table asked for
        return result
    patch.__doc__ = f"""Patch {what}, one cell at a time -> the metric of each, {shape}.

    See :func:`generic_activation_patch` (the hook point: ``{activation_name}``).

    Parameters
    ----------
    model : TransformerModel
        A model of :mod:`mha.models`.
    corrupted_tokens : str, list of str, or array_like of int, shape (n,) or (B, n)
        The corrupted input.
    clean_cache : ActivationCache
        The clean run's activations, same batch size and length.
    patching_metric : callable
        ``metric(output) -> float`` on the logits (causal models) or the last hidden state.
    progress : bool, default True
        A progress bar over the cells.

    Returns
    -------
    ndarray of float64, shape {shape}
        The metric of each patched run.

    Examples
    --------
    >>> model = mha.models.load("minilm")          # 6 layers of 12 heads; 5 tokens here
    >>> _, clean_cache = model.run_with_cache("The cat sat")
    >>> def metric(hidden):           # one text: hidden (n, d); [CLS]'s first feature
    ...     return hidden[0, 0]
    >>> {function_name}(model, "The dog sat", clean_cache, metric,
    ...     progress=False).shape
    {_example_shape(axes)}
    """
    patch.__name__ = patch.__qualname__ = function_name
    return patch


# the axes swept: (layer, pos), (layer, pos, head), (layer, head), and the patterns' own
_LP, _LPH, _LH = ("layer", "pos"), ("layer", "pos", "head"), ("layer", "head")
_LHI, _LHD = ("layer", "head_index"), ("layer", "head_index", "dest_pos")
_LHDS = ("layer", "head_index", "dest_pos", "src_pos")
get_act_patch_resid_pre = _sweep(
    "get_act_patch_resid_pre", "resid_pre", layer_pos_patch_setter, _LP,
    "the residual stream at the start of each block, by position", "(n_layers, pos)")
get_act_patch_resid_mid = _sweep(
    "get_act_patch_resid_mid", "resid_mid", layer_pos_patch_setter, _LP,
    "the residual stream between each block's attention and MLP, by position", "(n_layers, pos)")
get_act_patch_attn_out = _sweep(
    "get_act_patch_attn_out", "attn_out", layer_pos_patch_setter, _LP,
    "the output of each attention layer, by position", "(n_layers, pos)")
get_act_patch_mlp_out = _sweep(
    "get_act_patch_mlp_out", "mlp_out", layer_pos_patch_setter, _LP,
    "the output of each MLP, by position", "(n_layers, pos)")
get_act_patch_attn_head_out_by_pos = _sweep(
    "get_act_patch_attn_head_out_by_pos", "z", layer_pos_head_vector_patch_setter, _LPH,
    "the output (z) of each attention head at each position", "(n_layers, pos, n_heads)")
get_act_patch_attn_head_q_by_pos = _sweep(
    "get_act_patch_attn_head_q_by_pos", "q", layer_pos_head_vector_patch_setter, _LPH,
    "the queries of each head at each position", "(n_layers, pos, n_heads)")
get_act_patch_attn_head_k_by_pos = _sweep(
    "get_act_patch_attn_head_k_by_pos", "k", layer_pos_head_vector_patch_setter, _LPH,
    "the keys of each key/value head at each position", "(n_layers, pos, n_kv_heads)")
get_act_patch_attn_head_v_by_pos = _sweep(
    "get_act_patch_attn_head_v_by_pos", "v", layer_pos_head_vector_patch_setter, _LPH,
    "the values of each key/value head at each position", "(n_layers, pos, n_kv_heads)")
get_act_patch_attn_head_pattern_by_pos = _sweep(
    "get_act_patch_attn_head_pattern_by_pos", "pattern", layer_head_pos_pattern_patch_setter, _LHD,
    "each head's attention pattern, one query row at a time", "(n_layers, n_heads, dest_pos)")
get_act_patch_attn_head_pattern_dest_src_pos = _sweep(
    "get_act_patch_attn_head_pattern_dest_src_pos", "pattern",
    layer_head_dest_src_pos_pattern_patch_setter, _LHDS,
    "each entry of each head's attention pattern", "(n_layers, n_heads, dest_pos, src_pos)")
get_act_patch_attn_head_out_all_pos = _sweep(
    "get_act_patch_attn_head_out_all_pos", "z", layer_head_vector_patch_setter, _LH,
    "the output (z) of each attention head at every position", "(n_layers, n_heads)")
get_act_patch_attn_head_q_all_pos = _sweep(
    "get_act_patch_attn_head_q_all_pos", "q", layer_head_vector_patch_setter, _LH,
    "the queries of each head at every position", "(n_layers, n_heads)")
get_act_patch_attn_head_k_all_pos = _sweep(
    "get_act_patch_attn_head_k_all_pos", "k", layer_head_vector_patch_setter, _LH,
    "the keys of each key/value head at every position", "(n_layers, n_kv_heads)")
get_act_patch_attn_head_v_all_pos = _sweep(
    "get_act_patch_attn_head_v_all_pos", "v", layer_head_vector_patch_setter, _LH,
    "the values of each key/value head at every position", "(n_layers, n_kv_heads)")
get_act_patch_attn_head_pattern_all_pos = _sweep(
    "get_act_patch_attn_head_pattern_all_pos", "pattern", layer_head_pattern_patch_setter, _LHI,
    "each head's whole attention pattern", "(n_layers, n_heads)")


def _stack_heads(parts: list[np.ndarray], n_heads: int) -> np.ndarray:
    """Stack per-head sweeps, k and v (the 3rd and 4th) padded with 0 to n_heads heads."""
    padded = [np.concatenate([p, np.zeros((*p.shape[:-1], n_heads - p.shape[-1]))], axis=-1)
              for p in parts]
    return np.stack(padded)


def get_act_patch_attn_head_all_pos_every(model: Any,
                                          corrupted_tokens: str | Sequence[str] | ArrayLike,
                                          clean_cache: Mapping[Any, np.ndarray],
                                          metric: Metric, *, progress: bool = True
                                          ) -> np.ndarray:
    """Patch each head's output, queries, keys, values and pattern at every position.

    Parameters
    ----------
    model : TransformerModel
        A model of :mod:`mha.models`.
    corrupted_tokens : str, list of str, or array_like of int
        The corrupted input.
    clean_cache : ActivationCache
        The clean run's activations.
    metric : callable
        ``metric(output) -> float``.
    progress : bool, default True
        Progress bars.

    Returns
    -------
    ndarray of float64, shape (5, n_layers, n_heads)
        Out (z), q, k, v, pattern; with grouped-query attention the k and v rows hold the
        n_kv_heads key/value heads, then zeros.

    Examples
    --------
    >>> model = mha.models.load("minilm")
    >>> _, clean_cache = model.run_with_cache("The cat sat")
    >>> get_act_patch_attn_head_all_pos_every(model, "The dog sat", clean_cache,
    ...     lambda hidden: hidden[0, 0], progress=False).shape
    (5, 6, 12)
    """
    sweeps = (get_act_patch_attn_head_out_all_pos, get_act_patch_attn_head_q_all_pos,
              get_act_patch_attn_head_k_all_pos, get_act_patch_attn_head_v_all_pos,
              get_act_patch_attn_head_pattern_all_pos)
    return _stack_heads([f(model, corrupted_tokens, clean_cache, metric, progress=progress)
                         for f in sweeps], model.n_heads)


def get_act_patch_attn_head_by_pos_every(model: Any,
                                         corrupted_tokens: str | Sequence[str] | ArrayLike,
                                         clean_cache: Mapping[Any, np.ndarray],
                                         metric: Metric, *, progress: bool = True
                                         ) -> np.ndarray:
    """Patch each head's output, queries, keys, values and pattern at each position.

    Parameters
    ----------
    model : TransformerModel
        A model of :mod:`mha.models`.
    corrupted_tokens : str, list of str, or array_like of int
        The corrupted input.
    clean_cache : ActivationCache
        The clean run's activations.
    metric : callable
        ``metric(output) -> float``.
    progress : bool, default True
        Progress bars.

    Returns
    -------
    ndarray of float64, shape (5, n_layers, pos, n_heads)
        Out (z), q, k, v, pattern (its query rows as positions); k and v padded with zeros
        to n_heads with grouped-query attention.

    Examples
    --------
    >>> model = mha.models.load("minilm")
    >>> _, clean_cache = model.run_with_cache("The cat sat")
    >>> get_act_patch_attn_head_by_pos_every(model, "The dog sat", clean_cache,
    ...     lambda hidden: hidden[0, 0], progress=False).shape
    (5, 6, 5, 12)
    """
    sweeps = (get_act_patch_attn_head_out_by_pos, get_act_patch_attn_head_q_by_pos,
              get_act_patch_attn_head_k_by_pos, get_act_patch_attn_head_v_by_pos)
    parts = [f(model, corrupted_tokens, clean_cache, metric, progress=progress) for f in sweeps]
    pattern = get_act_patch_attn_head_pattern_by_pos(model, corrupted_tokens, clean_cache,
                                                     metric, progress=progress)
    return _stack_heads([*parts, pattern.transpose(0, 2, 1)], model.n_heads)


def get_act_patch_block_every(model: Any, corrupted_tokens: str | Sequence[str] | ArrayLike,
                              clean_cache: Mapping[Any, np.ndarray], metric: Metric, *,
                              progress: bool = True) -> np.ndarray:
    """Patch the residual stream at each block's start, each attention and each MLP output.

    Parameters
    ----------
    model : TransformerModel
        A model of :mod:`mha.models`.
    corrupted_tokens : str, list of str, or array_like of int
        The corrupted input.
    clean_cache : ActivationCache
        The clean run's activations.
    metric : callable
        ``metric(output) -> float``.
    progress : bool, default True
        Progress bars.

    Returns
    -------
    ndarray of float64, shape (3, n_layers, pos)
        The sweeps of resid_pre, attn_out and mlp_out, in that order.

    Examples
    --------
    >>> model = mha.models.load("minilm")
    >>> _, clean_cache = model.run_with_cache("The cat sat")
    >>> get_act_patch_block_every(model, "The dog sat", clean_cache,
    ...     lambda hidden: hidden[0, 0], progress=False).shape
    (3, 6, 5)
    """
    return np.stack([f(model, corrupted_tokens, clean_cache, metric, progress=progress)
                     for f in (get_act_patch_resid_pre, get_act_patch_attn_out,
                               get_act_patch_mlp_out)])
