"""Narrow weight formats in NumPy: the twins of the C core's packing (csrc/narrow.h,
csrc/gemm_impl.h; the layouts are mha.h's ``mha_weight_format``), bit for bit.

- bfloat16: the top 16 bits of a float32. `to_bfloat16` rounds to nearest even (NaN becomes
  0x7FC0), as torch's ``.to(torch.bfloat16)``; `from_bfloat16` widens exactly.
- float16 (IEEE half, GGUF's F16): `to_float16` rounds to nearest even as NumPy's
  ``astype(np.float16)`` (a NaN becomes the quiet NaN 0x7E00 with its sign, as the C core);
  `from_float16` widens exactly.
- Q8_0 (ggml's layout): blocks of 32 consecutive values along the last axis, each with one
  float16 scale d and 32 int8 q, value = d * q. `quantize_q8_0` is ggml's
  ``quantize_row_q8_0_ref`` (ggml/src/ggml-quants.c): amax = max |x| of the block,
  d = amax / 127 in float32, q = roundf(x * (1 / d)) (float32 product with the reciprocal,
  rounded half away from zero), d stored as float16 (round to nearest even). A last axis that
  is not a multiple of 32 is padded with zeros to whole blocks.
- `pack_weight`: op(b) (K, N) packed as the C core packs it for `mha._core.linear(...,
  format=...)`, for a panel width W (``mha._core.pack_width()``).
"""
from __future__ import annotations

import numpy as np

__all__ = ["to_bfloat16", "from_bfloat16", "to_float16", "from_float16", "quantize_q8_0",
           "dequantize_q8_0", "pack_weight", "unpack_weight", "linear_transposed", "Q8_0_BLOCK"]

Q8_0_BLOCK = 32


def to_bfloat16(x) -> np.ndarray:
    """Round float32 values to bfloat16, as uint16 bits.

    Anything else is cast to float32 first; rounding is to nearest even, as torch's
    ``.to(torch.bfloat16)``; NaN becomes 0x7FC0.

    Parameters
    ----------
    x : array_like
        The values.

    Returns
    -------
    ndarray of uint16
        The bfloat16 bits, x's shape.

    Examples
    --------
    >>> [hex(h) for h in to_bfloat16(np.array([1 + 2 ** -8, 1 + 3 * 2 ** -8]))]   # ties: to even
    ['0x3f80', '0x3f82']
    """
    x = np.asarray(x, dtype=np.float32)
    u = np.ascontiguousarray(x).reshape(x.shape).view(np.uint32)
    rounded = (u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
    nan = (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    return np.asarray(np.where(nan, np.uint32(0x7FC0), rounded).astype(np.uint16))


def from_bfloat16(bits) -> np.ndarray:
    """Widen bfloat16 bits to float32 (exact).

    Parameters
    ----------
    bits : array_like of uint16
        The bfloat16 bits.

    Returns
    -------
    ndarray of float32
        The values, the bits' shape.

    Raises
    ------
    ValueError
        Bits that are not uint16.

    Examples
    --------
    >>> from_bfloat16(np.array([0x3F80, 0xC040], np.uint16))
    array([ 1., -3.], dtype=float32)
    """
    bits = np.asarray(bits)
    if bits.dtype != np.uint16:
        raise ValueError(f"bfloat16 bits are uint16, got {bits.dtype}")
    return (bits.astype(np.uint32) << np.uint32(16)).view(np.float32)


def to_float16(x) -> np.ndarray:
    """Round values to IEEE float16, as uint16 bits.

    Rounding is to nearest even, straight from x's own dtype (float64 is rounded once, not
    through float32), as NumPy's ``astype(np.float16)``; magnitudes from 65520 up become
    infinity, a NaN the quiet NaN 0x7E00 with its sign. float16 input is kept as it is.

    Parameters
    ----------
    x : array_like
        The values (floating; anything else is cast to float32).

    Returns
    -------
    ndarray of uint16
        The float16 bits, x's shape.

    Examples
    --------
    >>> [hex(h) for h in to_float16(np.array([1.0, 1 + 2 ** -11, 1 + 3 * 2 ** -11, 65520.0]))]
    ['0x3c00', '0x3c00', '0x3c02', '0x7c00']
    """
    x = np.asarray(x)
    if x.dtype not in (np.float16, np.float32, np.float64):
        x = x.astype(np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        bits = np.ascontiguousarray(x.astype(np.float16)).view(np.uint16)
    if x.dtype == np.float16:
        return bits.copy()
    nan = np.isnan(x)
    return np.where(nan, (bits & np.uint16(0x8000)) | np.uint16(0x7E00), bits).astype(np.uint16)


def from_float16(bits) -> np.ndarray:
    """Widen float16 bits to float32 (exact).

    Parameters
    ----------
    bits : array_like of uint16
        The float16 bits.

    Returns
    -------
    ndarray of float32
        The values, the bits' shape.

    Raises
    ------
    ValueError
        Bits that are not uint16.

    Examples
    --------
    >>> from_float16(np.array([0x3C00, 0xC200, 0x7C00], np.uint16))
    array([ 1., -3., inf], dtype=float32)
    """
    bits = np.asarray(bits)
    if bits.dtype != np.uint16:
        raise ValueError(f"float16 bits are uint16, got {bits.dtype}")
    return bits.view(np.float16).astype(np.float32)


def quantize_q8_0(x) -> tuple[np.ndarray, np.ndarray]:
    """Quantise to ggml's Q8_0: blocks of 32 int8 along the last axis, one float16 scale each.

    As ggml's ``quantize_row_q8_0_ref``: d = max|x| / 127 per block (float32, stored as
    float16), q = round(x / d) (half away from zero); the last block is zero-padded.

    Parameters
    ----------
    x : array_like, shape (..., K)
        The values (cast to float32).

    Returns
    -------
    q : ndarray of int8, shape (..., ceil(K / 32), 32)
        The quantised values.
    d : ndarray of float16, shape (..., ceil(K / 32))
        The scales.

    Raises
    ------
    ValueError
        A 0-d x.

    Examples
    --------
    >>> q, d = quantize_q8_0(np.array([127.0, 2.5, -2.5, 0.25]))   # d = 127 / 127 = 1
    >>> q[0, :5], d
    (array([127,   3,  -3,   0,   0], dtype=int8), array([1.], dtype=float16))
    """
    x = np.asarray(x, dtype=np.float32)
    if x.ndim < 1:
        raise ValueError("quantize_q8_0 needs at least one axis (the blocks run along the last)")
    k = x.shape[-1]
    blocks = -(-k // Q8_0_BLOCK)
    padded = np.zeros(x.shape[:-1] + (blocks * Q8_0_BLOCK,), np.float32)
    padded[..., :k] = x
    xb = padded.reshape(x.shape[:-1] + (blocks, Q8_0_BLOCK))
    amax = np.max(np.abs(xb), axis=-1, initial=np.float32(0))   # (..., blocks) float32
    d = amax / np.float32(127)                                   # float32, as ggml
    inv = np.zeros_like(d)
    np.divide(np.float32(1), d, out=inv, where=d != 0)           # id = d ? 1 / d : 0
    v = xb * inv[..., None]                                      # float32 products
    q = np.sign(v) * np.floor(np.abs(v).astype(np.float64) + 0.5)  # roundf: half away from 0
    return q.astype(np.int8), d.astype(np.float16)


def dequantize_q8_0(q, d, k: int | None = None) -> np.ndarray:
    """Dequantise Q8_0 blocks to float32 (exact: d * q is an 11-bit by 8-bit product).

    Parameters
    ----------
    q : ndarray of int8, shape (..., blocks, 32)
        The quantised values.
    d : ndarray of float16, shape (..., blocks)
        The scales.
    k : int, optional
        The length before padding (default blocks * 32).

    Returns
    -------
    ndarray of float32, shape (..., k)
        The values.

    Raises
    ------
    ValueError
        q and d of other types or shapes.

    Examples
    --------
    >>> q, d = quantize_q8_0(np.linspace(-1, 1, 40))
    >>> x = dequantize_q8_0(q, d, 40)
    >>> x.shape, float(np.max(np.abs(x - np.linspace(-1, 1, 40)))) < 1 / 254 * 1.01
    ((40,), True)
    """
    q, d = np.asarray(q), np.asarray(d)
    if q.dtype != np.int8 or d.dtype != np.float16 or q.shape != d.shape + (Q8_0_BLOCK,):
        raise ValueError(f"dequantize_q8_0 needs q (..., blocks, 32) int8 and d (..., blocks) float16, got "
                         f"q {q.shape} {q.dtype}, d {d.shape} {d.dtype}")
    x = (d.astype(np.float32)[..., None] * q.astype(np.float32)).reshape(d.shape[:-1] + (-1,))
    return x if k is None else x[..., :k]


def pack_weight(b, format: str, width: int, *, trans_b: bool = False) -> np.ndarray:
    """op(b) (K, N) packed in format "bfloat16" or "float16" ((P, K, W) uint16) or "q8_0"
    ((P, ceil(K / 32), 34 W) uint8: per block W float16 scales, then 32 x W int8),
    P = ceil(N / W), the last panel's columns past N zero: the bytes the C core writes for
    panel width W. b: float32 (float64 too for "float16", rounded once)."""
    if format == "float16":
        b = np.asarray(b)
        if b.ndim != 2 or width < 1:
            raise ValueError(f"pack_weight needs a 2-D b and width >= 1, got {b.shape} and {width}")
        wt = to_float16(b if trans_b else b.T)                  # (N, K) bits
        n, k = wt.shape
        panels = -(-n // width)
        bits = np.zeros((panels * width, k), np.uint16)
        bits[:n] = wt
        return np.ascontiguousarray(bits.reshape(panels, width, k).transpose(0, 2, 1))
    b = np.asarray(b, dtype=np.float32)
    if b.ndim != 2 or width < 1:
        raise ValueError(f"pack_weight needs a 2-D b and width >= 1, got {b.shape} and {width}")
    wt = b if trans_b else b.T                                   # (N, K): rows along the shared axis
    n, k = wt.shape
    panels = -(-n // width)
    cols = np.zeros((panels * width, k), np.float32)
    cols[:n] = wt
    if format == "bfloat16":
        bits = to_bfloat16(cols)                                 # (P W, K)
        bits[n:] = 0
        return np.ascontiguousarray(bits.reshape(panels, width, k).transpose(0, 2, 1))
    if format == "q8_0":
        q, d = quantize_q8_0(cols)                               # (P W, blocks, 32), (P W, blocks)
        blocks = q.shape[1]
        q = q.reshape(panels, width, blocks, Q8_0_BLOCK).transpose(0, 2, 3, 1)   # (P, blocks, 32, W)
        d = d.reshape(panels, width, blocks).transpose(0, 2, 1)                   # (P, blocks, W)
        out = np.empty((panels, blocks, (2 + Q8_0_BLOCK) * width), np.uint8)
        out[..., :2 * width] = np.ascontiguousarray(d).view(np.uint8).reshape(panels, blocks, 2 * width)
        out[..., 2 * width:] = np.ascontiguousarray(q).view(np.uint8).reshape(panels, blocks, Q8_0_BLOCK * width)
        return out
    raise ValueError(f'format must be "bfloat16", "float16" or "q8_0", got {format!r}')


def unpack_weight(packed, format: str | None, columns: int, rows: int | None = None) -> np.ndarray:
    """op(b) (K, N) from its packing: the weights the C core's products read, widened.

    Parameters
    ----------
    packed : ndarray
        `pack_weight`'s bytes: (P, K, W) uint16 for "bfloat16" and "float16", (P, ceil(K / 32),
        34 W) uint8 for "q8_0", or (P, K, W) float32/float64 for None (the native packing,
        ``mha._core.pack_weight(b)``).
    format : {"bfloat16", "float16", "q8_0", None}
        The packing's format.
    columns : int
        N, op(b)'s columns.
    rows : int, optional
        K (default: the packing's; for "q8_0" the padded ceil(K / 32) * 32).

    Returns
    -------
    ndarray, shape (K, N)
        float32 (float64 for a native float64 packing).

    Raises
    ------
    ValueError
        An unknown format, or a packing of another shape.

    Examples
    --------
    >>> b = np.arange(6, dtype=np.float32).reshape(2, 3)
    >>> unpack_weight(pack_weight(b, "bfloat16", 4), "bfloat16", 3)
    array([[0., 1., 2.],
           [3., 4., 5.]], dtype=float32)
    """
    packed = np.asarray(packed)
    if packed.ndim != 3:
        raise ValueError(f"a packing is 3-D, got shape {packed.shape}")
    panels = packed.shape[0]
    if format is None or format in ("bfloat16", "float16"):
        width = packed.shape[2]
        if format == "bfloat16":
            w = from_bfloat16(packed)
        elif format == "float16":
            w = from_float16(packed)
        else:
            w = packed
        w = w.transpose(1, 0, 2).reshape(packed.shape[1], panels * width)     # (K, P W)
    elif format == "q8_0":
        width = packed.shape[2] // (2 + Q8_0_BLOCK)
        blocks = packed.shape[1]
        d = np.ascontiguousarray(packed[..., :2 * width]).view(np.float16)      # (P, blocks, W)
        q = np.ascontiguousarray(packed[..., 2 * width:]).view(np.int8).reshape(panels, blocks, Q8_0_BLOCK, width)
        w = d.astype(np.float32)[:, :, None, :] * q.astype(np.float32)          # (P, blocks, 32, W)
        w = w.reshape(panels, blocks * Q8_0_BLOCK, width).transpose(1, 0, 2).reshape(blocks * Q8_0_BLOCK, panels * width)
    else:
        raise ValueError(f'format must be "bfloat16", "float16", "q8_0" or None, got {format!r}')
    if not 0 <= columns <= panels * width or panels != -(-columns // max(width, 1)):
        raise ValueError(f"{panels} panels of {width} columns do not hold {columns} columns")
    k = w.shape[0] if rows is None else rows
    if k > w.shape[0]:
        raise ValueError(f"the packing holds {w.shape[0]} rows, not {k}")
    return np.ascontiguousarray(w[:k, :columns])


def linear_transposed(a, packed, format: str | None, columns: int, rows: int | None = None) -> np.ndarray:
    """a @ op(b)^T from op(b)'s packing, in float64: the twin of ``mha._core.linear_transposed``.

    Parameters
    ----------
    a : array_like, shape (M, N)
        The left factor (the output gradient of a product with op(b)).
    packed : ndarray
        op(b) (K, N) packed (see `unpack_weight`).
    format : {"bfloat16", "float16", "q8_0", None}
        The packing's format.
    columns : int
        N.
    rows : int, optional
        K (see `unpack_weight`).

    Returns
    -------
    ndarray of float64, shape (M, K)
        The product on the widened weights.

    Examples
    --------
    >>> b = np.arange(6, dtype=np.float32).reshape(2, 3)          # op(b): K = 2, N = 3
    >>> linear_transposed(np.ones((1, 3)), pack_weight(b, "float16", 4), "float16", 3)
    array([[ 3., 12.]])
    """
    w = unpack_weight(packed, format, columns, rows).astype(np.float64)
    return np.asarray(a, np.float64) @ w.T
