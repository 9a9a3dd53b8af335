"""Argument checks and the dtype policy of mha's public functions, written once.

Who checks what (one owner per check):

- The binding (csrc/module.c) checks everything that reaches the C core: each array's dtype,
  rank, layout and sizes against the others and against the parameters, and each scalar's type
  and range. The C-backed `mha.functional` and `mha.layer` do not check these again: the
  binding's messages are the ones users see.
- This module checks what the binding cannot see: the dtype policy (`float_array`,
  `compute_dtype`), broadcasting (`mask`), defaults, memory budgets (`fits`), a layer's
  configuration (`layer_dims`, `layer_dtype`, `dropout`, `generator`) and the layer's own
  batching and defaults (`layer_inputs`).
- The NumPy oracle (`mha.reference`) has no binding, so the checks that the binding makes for
  the C path are here too, for it alone: `qkv`, `scale`, `softcap`, `flag`, `dropout_seed`,
  `layer_sizes`, `key_padding_shape`, `head_mask_shape`, `d_out_shape`, `cache`. Their messages
  say what the binding's say.

Each check returns the argument in the form the caller computes with, or raises:

- TypeError for the wrong kind of object or dtype,
- ValueError for a wrong value or shape,
- MemoryError for a buffer that cannot fit in this machine's memory,

with a message that names the argument and says what was expected. No check modifies its
arguments. tests/test_checks.py holds every message to a table of bad inputs.

dtype policy: floating inputs (float16, float32, float64) of one call are promoted to a common
float32 or float64 (float16 computes in float32); integer, bool, complex, object and extended
precision arrays raise TypeError.
"""
from __future__ import annotations

import math
import operator
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
from numpy.typing import ArrayLike, DTypeLike

if TYPE_CHECKING:
    from .layer_base import KVCache

__all__ = [
    "float_array", "compute_dtype", "contiguous", "flag", "default_scale", "scale", "qkv",
    "mask", "dropout", "seed", "dropout_seed", "fits", "positive_int", "layer_dims",
    "layer_dtype", "generator", "layer_inputs", "layer_sizes", "key_padding_mask",
    "key_padding_shape", "head_mask", "head_mask_shape", "d_out", "d_out_shape", "cache_sizes",
    "cache",
]


# ---- arrays and dtypes -------------------------------------------------------------------------

def float_array(x: ArrayLike, name: str) -> np.ndarray:
    """`x` as an ndarray of a floating dtype.

    Parameters
    ----------
    x : array_like
        The argument.
    name : str
        Its name, for the error message.

    Returns
    -------
    ndarray
        ``np.asarray(x)``: float16, float32 or float64 (no copy when `x` is already one).

    Raises
    ------
    TypeError
        `x` is None, a string, or has a dtype other than float16, float32, float64.
    ValueError
        `x` is a ragged nested sequence.
    """
    if isinstance(x, (str, bytes)) or x is None:
        raise TypeError(f"{name} must be a float array, not {type(x).__name__}")
    try:
        a = np.asarray(x)
    except ValueError as e:
        raise ValueError(f"{name} is not a rectangular array: {e}") from None
    if a.dtype.kind != "f":
        raise TypeError(f"{name} must have a float dtype (float16, float32 or float64), not {a.dtype}")
    if a.dtype.itemsize > 8:
        raise TypeError(f"{name} has dtype {a.dtype}; mha computes in float32 or float64")
    return a


def compute_dtype(*arrays: np.ndarray) -> np.dtype:
    """The dtype a call computes in: float64 if any array is float64, else float32.

    Parameters
    ----------
    *arrays : ndarray
        Floating arrays (checked by `float_array`).

    Returns
    -------
    numpy.dtype
        float32 or float64.
    """
    dtype = np.result_type(*arrays)
    return np.dtype(np.float64) if dtype.itemsize > 4 else np.dtype(np.float32)


def contiguous(a: ArrayLike, dtype: DTypeLike | None = None) -> np.ndarray:
    """`a` as a C-contiguous, aligned array in native byte order, copied only when needed.

    Parameters
    ----------
    a : array_like
    dtype : dtype, optional
        Cast to this dtype (a copy when it differs).

    Returns
    -------
    ndarray
    """
    return np.require(a, dtype=dtype, requirements=("C", "A"))


# ---- scalars -----------------------------------------------------------------------------------

def flag(value: object, name: str) -> bool:
    """A Python bool from a bool or integer scalar.

    Raises
    ------
    TypeError
        `value` is anything else (an array, a float, None, ...).
    """
    if isinstance(value, (bool, np.bool_, int, np.integer)):
        return bool(value)
    raise TypeError(f"{name} must be a bool, not {type(value).__name__}")


def default_scale(d_k: int) -> float:
    """The softmax temperature 1 / sqrt(d_k); 1 for keys of width 0 (every score is 0 then)."""
    return 1.0 / math.sqrt(d_k) if d_k > 0 else 1.0


def scale(value: float | None, d_k: int) -> float:
    """The softmax temperature: `value` as a float, or `default_scale(d_k)` when None.

    Raises
    ------
    TypeError
        `value` is not a real number (a bool, complex, string or array).
    """
    if value is None:
        return default_scale(d_k)
    if isinstance(value, (bool, np.bool_, complex, np.complexfloating, str, bytes)) or np.ndim(value) != 0:
        raise TypeError(f"scale must be a real number, not {type(value).__name__} {value!r}")
    try:
        return float(value)
    except (TypeError, ValueError):
        raise TypeError(f"scale must be a real number, not {type(value).__name__}") from None


def dropout(p: Any) -> float:
    """A dropout probability: a float in [0, 1).

    Raises
    ------
    TypeError
        `p` is not a number.
    ValueError
        `p` is outside [0, 1) or NaN (p = 1 would divide by 1 - p = 0).
    """
    try:
        value = float(p)
    except (TypeError, ValueError):
        raise TypeError(f"dropout must be a number in [0, 1), not {type(p).__name__} {p!r}") from None
    if not 0.0 <= value < 1.0:
        raise ValueError(f"dropout must be in [0, 1), got {p!r}")
    return value


def softcap(value: Any) -> float:
    """An attention logit soft-cap c (scores s become c * tanh(s / c)): a positive finite
    real number, or None or 0 for none (returned as 0.0, what the core reads as off).

    Raises
    ------
    TypeError
        `value` is not a real number (a bool, complex, string or array).
    ValueError
        `value` is negative, NaN or infinite.
    """
    if value is None:
        return 0.0
    if isinstance(value, (bool, np.bool_, complex, np.complexfloating, str, bytes)) or np.ndim(value) != 0:
        raise TypeError(f"softcap must be a positive real number (or None), not {type(value).__name__} "
                        f"{value!r}")
    try:
        c = float(value)
    except (TypeError, ValueError):
        raise TypeError(f"softcap must be a positive real number (or None), not "
                        f"{type(value).__name__}") from None
    if not (c >= 0.0 and math.isfinite(c)):
        raise ValueError(f"softcap must be a positive finite number (the cap c of c * tanh(s / c)), "
                         f"or None or 0 for no cap; got {value!r}")
    return c


def seed(value: object) -> int:
    """A dropout seed: a Python int in [0, 2**64).

    Raises
    ------
    TypeError
        `value` is not an integer (bools and floats are refused).
    ValueError
        `value` is outside [0, 2**64).
    """
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"seed must be an int, not {type(value).__name__}")
    if not 0 <= int(value) < 2**64:
        raise ValueError(f"seed must be in [0, 2**64), got {value}")
    return int(value)


def dropout_seed(p: float, seed_value: int | None, *, backward: bool = False) -> tuple[float, int]:
    """The dropout probability and seed of an attention call.

    Parameters
    ----------
    p : float
        Dropout probability, checked by `dropout`.
    seed_value : int or None
        Checked by `seed` when given. None draws a fresh seed in [0, 2**63) when p > 0.
    backward : bool
        A backward call: with p > 0 the seed must be given (the forward's).

    Returns
    -------
    (float, int)
        p, and the seed (0 when p == 0 and no seed was given).

    Raises
    ------
    TypeError, ValueError
        As `dropout` and `seed`; ValueError for a backward with p > 0 and no seed.
    """
    p = dropout(p)
    if seed_value is not None:
        return p, seed(seed_value)
    if p == 0.0:
        return p, 0
    if backward:
        raise ValueError("attention_backward with dropout > 0 needs the seed the forward used (seed=None)")
    return p, int(np.random.default_rng().integers(0, 2**63))


# ---- attention's arguments ---------------------------------------------------------------------

def qkv(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> tuple[int, int, int, int, int, int, int]:
    """Check that q, k, v have shapes attention can take.

    Parameters
    ----------
    q : ndarray
        (n_q, d_k), (B, n_q, d_k) or (B, H, n_q, d_k).
    k : ndarray
        (..., n_k, d_k), q's rank; in 4-D, H_kv heads with H_kv dividing H.
    v : ndarray
        (..., n_k, d_v), k's leading shape.

    Returns
    -------
    tuple of int
        (B, H, H_kv, n_q, n_k, d_k, d_v), with 1 for the axes a lower rank lacks.

    Raises
    ------
    ValueError
        Naming the arrays at fault and both of their shapes.
    """
    if q.ndim not in (2, 3, 4):
        raise ValueError(f"q must have 2, 3 or 4 dimensions (..., n_q, d_k), got shape {q.shape}")
    for name, a in (("k", k), ("v", v)):
        if a.ndim != q.ndim:
            raise ValueError(f"q has shape {q.shape} but {name} has shape {a.shape}: they must have the same rank")
    if k.shape[-1] != q.shape[-1]:
        raise ValueError(f"q has shape {q.shape} but k has shape {k.shape}: d_k must match")
    if k.shape[-2] != v.shape[-2]:
        raise ValueError(f"k has shape {k.shape} but v has shape {v.shape}: n_k must match")
    if q.ndim >= 3:
        for name, a in (("k", k), ("v", v)):
            if a.shape[0] != q.shape[0]:
                raise ValueError(f"q has shape {q.shape} but {name} has shape {a.shape}: the batch size must match")
    if q.ndim == 4:
        if k.shape[1] != v.shape[1]:
            raise ValueError(f"k has shape {k.shape} but v has shape {v.shape}: the number of heads must match")
        if k.shape[1] == 0 or q.shape[1] % k.shape[1]:
            raise ValueError(
                f"q has shape {q.shape} but k has shape {k.shape}: k's {k.shape[1]} heads must divide "
                f"q's {q.shape[1]} heads (grouped-query attention)"
            )
    lead = q.shape[:-2]
    B = lead[0] if len(lead) >= 1 else 1
    H = lead[1] if len(lead) == 2 else 1
    H_kv = k.shape[1] if q.ndim == 4 else 1
    return B, H, H_kv, q.shape[-2], k.shape[-2], q.shape[-1], v.shape[-1]


def mask(m: ArrayLike | None, scores_shape: Sequence[int], dtype: DTypeLike,
         name: str = "mask") -> np.ndarray | None:
    """An attention mask as a read-only view with the scores' shape.

    Parameters
    ----------
    m : array_like or None
        bool or integer (nonzero = may attend) or float (added to the scores), broadcastable
        to `scores_shape`.
    scores_shape : tuple of int
        The scores' shape (..., n_q, n_k).
    dtype : dtype
        The call's float dtype: a float mask is cast to it.
    name : str
        The argument's name, for the error message.

    Returns
    -------
    ndarray or None
        None for None; else ``np.broadcast_to`` of a bool array, or of a float array of
        `dtype`, aligned and in native byte order (the small original is copied when it is not).

    Raises
    ------
    TypeError
        Any other dtype (complex, strings, datetimes, objects).
    ValueError
        A shape that does not broadcast to `scores_shape`.
    """
    if m is None:
        return None
    a = np.asarray(m)
    if a.dtype.kind in "iu":
        a = a != 0
    elif a.dtype.kind == "f":
        a = a.astype(dtype, copy=False)
    elif a.dtype.kind != "b":
        raise TypeError(f"{name} must be bool, integer (nonzero = may attend) or float (added), not {a.dtype}")
    if not (a.flags.aligned and a.dtype.isnative):
        a = contiguous(a, a.dtype.newbyteorder("="))
    try:
        return np.broadcast_to(a, scores_shape)
    except ValueError:
        raise ValueError(
            f"{name} has shape {a.shape}, which does not broadcast to the scores' shape "
            f"{tuple(scores_shape)} (..., n_q, n_k)"
        ) from None


def _physical_memory() -> int:
    """Memory a new buffer can get: MemAvailable where Linux reports it, else physical RAM."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 1 << 62


def fits(what: str, shape: Sequence[int], dtype: DTypeLike) -> None:
    """Raise MemoryError, before any work, when an array cannot fit in this machine's memory.

    Parameters
    ----------
    what : str
        The array's name in the message ("weights" adds the advice need_weights=False).
    shape : tuple of int
    dtype : dtype

    Raises
    ------
    MemoryError
        The array needs more bytes than the memory available (sizes in Python ints: no overflow).
    """
    n = 1
    for s in shape:
        n *= int(s)
    nbytes = n * np.dtype(dtype).itemsize
    if nbytes > _physical_memory():
        raise MemoryError(
            f"{what} of shape {tuple(int(s) for s in shape)} would need {nbytes / 2**30:.1f} GiB, "
            f"more than the {_physical_memory() / 2**30:.1f} GiB this machine has available"
            + (" (pass need_weights=False to avoid the n_q x n_k weights)" if what == "weights" else "")
        )


# ---- the layer's configuration -----------------------------------------------------------------

def positive_int(name: str, value: Any) -> int:
    """`value` as a positive Python int.

    The one positive-integer check of the package (sizes, counts, limits).

    Raises
    ------
    TypeError
        `value` is not an integer (bools, floats and strings are refused).
    ValueError
        `value` <= 0.
    """
    try:
        if isinstance(value, (bool, np.bool_)):
            raise TypeError
        value = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be a positive int, not {type(value).__name__} {value!r}") from None
    if value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value}")
    return value


def layer_dims(d_model: int, n_heads: int, n_kv_heads: int | None = None, d_head: int | None = None,
               kdim: int | None = None, vdim: int | None = None,
               ) -> tuple[int, int, int, int, int, int]:
    """A layer's sizes with their defaults filled in.

    Parameters
    ----------
    d_model, n_heads : int
        Positive.
    n_kv_heads : int, optional
        Defaults to n_heads; must divide it.
    d_head : int, optional
        Defaults to d_model // n_heads (then n_heads must divide d_model).
    kdim, vdim : int, optional
        Default to d_model.

    Returns
    -------
    tuple of int
        (d_model, n_heads, n_kv_heads, d_head, kdim, vdim).

    Raises
    ------
    TypeError, ValueError
        Naming the size at fault.
    """
    d_model = positive_int("d_model", d_model)
    n_heads = positive_int("n_heads", n_heads)
    n_kv_heads = n_heads if n_kv_heads is None else positive_int("n_kv_heads", n_kv_heads)
    if n_heads % n_kv_heads != 0:
        raise ValueError(f"n_kv_heads={n_kv_heads} must divide n_heads={n_heads}")
    if d_head is None:
        if d_model % n_heads != 0:
            raise ValueError(f"d_model={d_model} is not divisible by n_heads={n_heads}; "
                             "pass d_head explicitly")
        d_head = d_model // n_heads
    d_head = positive_int("d_head", d_head)
    kdim = d_model if kdim is None else positive_int("kdim", kdim)
    vdim = d_model if vdim is None else positive_int("vdim", vdim)
    return d_model, n_heads, n_kv_heads, d_head, kdim, vdim


def layer_dtype(dtype: DTypeLike) -> np.dtype:
    """A layer's dtype: float32 or float64.

    Raises
    ------
    TypeError
        Anything else, float16 included.
    """
    try:
        dtype = np.dtype(dtype)
    except TypeError:
        raise TypeError(f"dtype must be float32 or float64, got {dtype!r}") from None
    if dtype not in (np.float32, np.float64):
        raise TypeError(f"dtype must be float32 or float64, got {dtype}")
    return dtype


def generator(seed_value: Any) -> np.random.Generator:
    """A layer's random generator, ``np.random.default_rng(seed_value)``.

    Raises
    ------
    TypeError, ValueError
        `seed_value` is not None, a non-negative int or a Generator (the message names seed).
    """
    try:
        return np.random.default_rng(seed_value)
    except (TypeError, ValueError) as e:
        raise type(e)(f"seed must be None or a non-negative int, got {seed_value!r}") from None


# ---- the layer's call --------------------------------------------------------------------------
#
# What the layer itself decides: the dtype policy, batching (2-D input gets a batch axis) and the
# defaults (key = query, value = key). The sizes of its arrays against the parameters are checked
# by the binding for the C layer (csrc/module.c); `layer_sizes`, `key_padding_shape`,
# `head_mask_shape`, `d_out_shape` and `cache` check them for the NumPy oracle, which has none.

def _layer_input(x: ArrayLike, name: str, width: int, dtype: DTypeLike) -> np.ndarray:
    try:
        x = np.asarray(x)
    except ValueError as e:
        raise ValueError(f"{name} is not a rectangular array: {e}") from None
    if not np.issubdtype(x.dtype, np.floating):
        raise TypeError(f"{name} must be a floating-point array, got dtype {x.dtype}")
    if x.ndim not in (2, 3):
        raise ValueError(f"{name} has shape {x.shape} but expected (B, n, {width}) or (n, {width})")
    return x.astype(dtype, copy=False)


def layer_inputs(query: ArrayLike, key: ArrayLike | None, value: ArrayLike | None, *, d_model: int,
                 kdim: int, vdim: int, dtype: DTypeLike,
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray, bool]:
    """A layer call's query, key and value, batched, C-contiguous and of the layer's dtype.

    Their sizes are not checked here (see `layer_sizes`).

    Parameters
    ----------
    query : array_like
        (B, n_q, d_model) or unbatched (n_q, d_model).
    key : array_like or None
        (B, n_k, kdim); None: the query (then kdim must equal d_model).
    value : array_like or None
        (B, n_k, vdim); None: the key (then vdim must equal the key's width).
    d_model, kdim, vdim : int
        The layer's widths.
    dtype : dtype
        The layer's dtype: inputs of another float dtype are cast to it.

    Returns
    -------
    (query, key, value, unbatched)
        (B, n, width) arrays. An omitted key is the query array itself and an omitted value the
        key array itself (the same objects: the backward adds their gradients there), and a
        given one never is; unbatched is True for 2-D input.

    Raises
    ------
    TypeError
        A non-floating input.
    ValueError
        A rank other than 2 or 3, an omitted argument whose default has the wrong width, or
        inputs not all batched or all unbatched.
    """
    key_given, value_given = key is not None, value is not None
    q = _layer_input(query, "query", d_model, dtype)
    unbatched = q.ndim == 2
    k = _layer_input(key, "key", kdim, dtype) if key is not None else q
    v = _layer_input(value, "value", vdim, dtype) if value is not None else k
    if not key_given and kdim != d_model:
        raise ValueError(f"key must be given: it defaults to query (width d_model="
                         f"{d_model}) but this layer has kdim={kdim}")
    if not value_given and vdim != kdim:
        raise ValueError(f"value must be given: it defaults to key (width {kdim}) "
                         f"but this layer has vdim={vdim}")
    if k.ndim != q.ndim or v.ndim != q.ndim:
        raise ValueError(f"query, key, value must all be batched or all unbatched, got "
                         f"shapes {q.shape}, {k.shape}, {v.shape}")
    q = contiguous(q[None] if unbatched else q)
    k = contiguous(k[None] if unbatched else k) if key_given else q
    v = contiguous(v[None] if unbatched else v) if value_given else k
    # a given key (value) is never the query (key) object itself, even when the caller passed
    # that array twice: its gradient is then returned apart
    if key_given and k is q:
        k = k[...]
    if value_given and v is k:
        v = v[...]
    return q, k, v, unbatched


def layer_sizes(query: np.ndarray, key: np.ndarray, value: np.ndarray, *, d_model: int, kdim: int,
                vdim: int) -> None:
    """Check the widths, batch sizes and key/value lengths of a layer call's batched inputs.

    Parameters
    ----------
    query, key, value : ndarray
        (B, n_q, d_model), (B, n_k, kdim), (B, n_k, vdim), from `layer_inputs`.
    d_model, kdim, vdim : int
        The layer's widths.

    Raises
    ------
    ValueError
        A wrong width, or batch sizes and key/value lengths that differ.
    """
    for x, name, width in ((query, "query", d_model), (key, "key", kdim), (value, "value", vdim)):
        if x.shape[-1] != width:
            raise ValueError(f"{name} has shape {x.shape} but expected (B, n, {width}) or (n, {width})")
    if key.shape[-2] != value.shape[-2] or key.shape[0] != query.shape[0] \
            or key.shape[0] != value.shape[0]:
        raise ValueError(f"query {query.shape}, key {key.shape}, value {value.shape}: "
                         "batch sizes and key/value lengths must match")


def key_padding_mask(m: ArrayLike, unbatched: bool) -> np.ndarray:
    """A layer's key_padding_mask as a C-contiguous bool array, batched.

    Parameters
    ----------
    m : array_like
        bool or integer, (batch, n_k), True (nonzero) = real token; (n_k,) for unbatched input.
    unbatched : bool
        The call's query was 2-D.

    Raises
    ------
    TypeError
        A dtype other than bool or integer.
    """
    m = np.asarray(m)
    if m.dtype.kind not in "biu":
        raise TypeError(f"key_padding_mask must be bool (True = real token), got dtype {m.dtype}")
    if unbatched and m.ndim == 1:
        m = m[None]
    return np.ascontiguousarray(m != 0)


def key_padding_shape(m: np.ndarray, batch: int, n_k: int) -> None:
    """Check that a key_padding_mask (from `key_padding_mask`) is (batch, n_k).

    Raises
    ------
    ValueError
        Another shape.
    """
    if m.shape != (batch, n_k):
        raise ValueError(f"key_padding_mask has shape {m.shape} but expected (batch, n_k) = {(batch, n_k)}")


def head_mask(m: ArrayLike, dtype: DTypeLike) -> np.ndarray:
    """A layer's head_mask as an array of the layer's dtype."""
    return np.asarray(m, dtype=dtype)


def head_mask_shape(m: np.ndarray, n_heads: int) -> None:
    """Check that a head_mask is (n_heads,).

    Raises
    ------
    ValueError
        Another shape.
    """
    if m.shape != (n_heads,):
        raise ValueError(f"head_mask has shape {m.shape} but expected ({n_heads},)")


def d_out(g: ArrayLike, unbatched: bool, dtype: DTypeLike) -> np.ndarray:
    """The gradient a layer's backward receives, of the layer's dtype, batched when it is 2-D
    and the forward's input was unbatched.

    Raises
    ------
    TypeError
        A non-floating array.
    """
    g = float_array(g, "d_out")
    if unbatched and g.ndim == 2:
        g = g[None]
    return g.astype(dtype, copy=False)


def d_out_shape(g: np.ndarray, out_shape: Sequence[int], unbatched: bool) -> None:
    """Check that a layer's d_out (from `d_out`) has the output's batched shape.

    Parameters
    ----------
    g : ndarray
        The gradient as `d_out` returns it.
    out_shape : tuple of int
        The batched output shape (B, n_q, d_model).
    unbatched : bool
        The forward's input was 2-D (the message then gives the unbatched shapes).

    Raises
    ------
    ValueError
        Another shape (the message gives both).
    """
    if g.shape != tuple(out_shape):
        given = g.shape[1:] if unbatched and g.ndim == 3 and g.shape[0] == 1 else g.shape
        shape = tuple(out_shape[1:]) if unbatched else tuple(out_shape)
        raise ValueError(f"d_out has shape {given} but the output has shape {shape}")


def cache_sizes(batch_size: int, max_len: int) -> tuple[int, int]:
    """A KV cache's batch size and length: positive Python ints.

    Raises
    ------
    TypeError, ValueError
        As `positive_int`.
    """
    return positive_int("batch_size", batch_size), positive_int("max_len", max_len)


def cache(c: KVCache, batch: int, n_kv_heads: int, d_head: int, dtype: DTypeLike,
          n_new: int) -> None:
    """Check that a KV cache can take this call's keys and values.

    Parameters
    ----------
    c : KVCache
        Its k_rows and v_rows (batch_size, max_len, n_kv_heads * d_head) and length.
    batch, n_kv_heads, d_head : int
        The call's batch size and the layer's key/value heads and their width.
    dtype : dtype
        The layer's dtype.
    n_new : int
        Positions this call appends.

    Raises
    ------
    ValueError
        Read-only buffers, another shape or dtype, or more positions than max_len.
    """
    if not (c.k_rows.flags.writeable and c.v_rows.flags.writeable):
        raise ValueError("the KV cache's buffers are read-only")
    if c.k_rows.shape[0] != batch or c.k_rows.shape[2] != n_kv_heads * d_head or c.k_rows.dtype != dtype:
        raise ValueError(f"cache holds {c.k.shape} (batch, n_kv_heads, max_len, d_head) of "
                         f"{c.k_rows.dtype} but this call has batch {batch}, {n_kv_heads} kv heads of "
                         f"width {d_head}, {np.dtype(dtype)}")
    if c.length + n_new > c.max_len:
        raise ValueError(f"cache overflow: {c.length} cached + {n_new} new "
                         f"positions > max_len={c.max_len}")
