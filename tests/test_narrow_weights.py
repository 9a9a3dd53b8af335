"""Narrow packed weights (issue 37's kernel layer): the float32 GEMM reading bfloat16, float16
and ggml's Q8_0 packings (csrc/gemm_impl.h, mha.h's mha_weight_format), against their NumPy
twins (mha.reference.narrow): the packing bit for bit, the products within float32 rounding of
a float64 product on the dequantised weights, and bitwise the float32 GEMM on the widened
weights, except Q8_0 on few rows (widened in registers: up to 16 rows, 64 on AVX-512), which
sums each block's a * q before its scale.

Measured (AVX-512, AVX2 and baseline alike): relative error <= 3.3e-7 of the largest output over
M = 1 .. 300, K = 33 .. 2560; the tolerance is 3e-6. Q8_0 on few rows against the float32
GEMM: <= 4.1e-7 (C tests); the tolerance is 3e-6."""
import struct

import numpy as np
import pytest

from mha import _core
from mha import reference as R
from mha.reference import narrow as RN

TOL = 3e-6
FORMATS = ["bfloat16", "q8_0", "float16"]


def dequantised(b, fmt, trans_b):
    """op(b) (K, N) as the packing holds it, in float64."""
    wt = np.asarray(b if trans_b else b.T, np.float32)          # (N, K)
    if fmt == "bfloat16":
        w = R.from_bfloat16(R.to_bfloat16(wt))
    elif fmt == "float16":
        w = RN.from_float16(RN.to_float16(wt))
    else:
        q, d = R.quantize_q8_0(wt)
        w = R.dequantize_q8_0(q, d, wt.shape[1])
    return w.T.astype(np.float64)


# ---- the twins ----------------------------------------------------------------------------------

def test_to_bfloat16_is_torchs_rounding():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(1)
    x = np.concatenate([(rng.standard_normal(20000) * 10.0 ** rng.integers(-30, 30, 20000)).astype(np.float32),
                        np.array([0.0, -0.0, np.inf, -np.inf, 3.4e38, 1e-40, 1 + 2 ** -8, 1 + 3 * 2 ** -8],
                                 np.float32)])
    want = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    assert np.array_equal(R.to_bfloat16(x), want)
    assert R.to_bfloat16(np.float32(np.nan)) == 0x7FC0
    assert np.array_equal(R.from_bfloat16(want), torch.from_numpy(want.view(np.int16)).view(torch.bfloat16).float().numpy())


def test_to_float16_is_numpys_rounding():
    rng = np.random.default_rng(7)
    x = np.concatenate([(rng.standard_normal(20000) * 2.0 ** rng.integers(-30, 20, 20000)).astype(np.float32),
                        np.array([0.0, -0.0, np.inf, -np.inf, 65504, 65519.99, 65520, 1e-8, 2 ** -25,
                                  3 * 2 ** -26, 2 ** -24, 1 + 2 ** -11, 1 + 3 * 2 ** -11], np.float32)])
    with np.errstate(over="ignore"):
        want = x.astype(np.float16).view(np.uint16)
    assert np.array_equal(RN.to_float16(x), want)
    assert np.array_equal(RN.from_float16(want), want.view(np.float16).astype(np.float32))
    nan = RN.to_float16(np.array([np.nan, -np.nan], np.float32))
    assert nan[0] == 0x7E00 and nan[1] == 0xFE00
    # the C core's rounding: every packed value against NumPy's, float32 and float64 sources
    for src in (x, x.astype(np.float64) * (1 + 2.0 ** -30)):
        p = _core.pack_weight(src[None, :], format="float16")            # (P, 1, W): one row
        assert np.array_equal(p.transpose(1, 0, 2).ravel()[:src.size], RN.to_float16(src))


def test_pack_float16_from_bits_kept():
    rng = np.random.default_rng(8)
    b = rng.standard_normal((40, 33)).astype(np.float16)
    bits = b.view(np.uint16).copy()
    bits[0, 0] = 0x7D01                                      # a signalling NaN's bits: kept
    got = _core.pack_weight(bits, format="float16")
    want = RN.pack_weight(b, "float16", _core.pack_width())
    assert np.array_equal(got.ravel()[1:], want.ravel()[1:]) and got.ravel()[0] == 0x7D01
    assert np.array_equal(_core.pack_weight(b, trans_b=False, format="float16"), want)
    assert np.array_equal(_core.pack_weight(np.ascontiguousarray(b.T), trans_b=True, format="float16"), want)


def _ggml_q8_0_block(xs):
    """ggml's quantize_row_q8_0_ref for one block, one scalar at a time (float32 arithmetic)."""
    f = np.float32
    amax = f(0)
    for v in xs:
        amax = max(amax, abs(f(v)))
    d = f(amax / f(127))
    inv = f(f(1) / d) if d else f(0)
    qs = []
    for v in xs:
        y = float(f(f(v) * inv))
        qs.append(int(np.floor(abs(y) + 0.5)) * (1 if y >= 0 else -1))    # roundf
    half = struct.unpack("<H", struct.pack("<e", float(d)))[0]            # round to nearest even
    return qs, half


def test_quantize_q8_0_is_ggmls():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((3, 70)).astype(np.float32)
    x[0, :32] = np.float32(2.5) * np.sign(rng.standard_normal(32))           # ties: d = 2.5 / 127 ...
    x[1, :32] = np.arange(32) - 15.5                                         # ... and amax 16.5
    x[2, 32:64] = 0                                                          # a block of zeros
    q, d = R.quantize_q8_0(x)
    assert q.shape == (3, 3, 32) and q.dtype == np.int8 and d.shape == (3, 3) and d.dtype == np.float16
    for r in range(3):
        for blk in range(3):
            xs = list(x[r, 32 * blk:32 * blk + 32])
            qs, half = _ggml_q8_0_block(xs + [0.0] * (32 - len(xs)))
            assert list(q[r, blk]) == qs and d[r, blk].view(np.uint16) == half
    assert np.all(q[2, 2, 6:] == 0) and np.all(d[2, 1] == 0)                 # padding and zeros
    # half away from zero where x * (1 / d) is an exact .5: amax 127 gives d = 1
    t = np.zeros(32, np.float32)
    t[:4] = [127, 2.5, -2.5, 0.5]
    assert list(R.quantize_q8_0(t)[0][0, :4]) == [127, 3, -3, 1]
    w = R.dequantize_q8_0(q, d, 70)
    assert w.shape == (3, 70) and np.max(np.abs(w - x)) <= 0.51 * np.max(np.abs(x)) / 127


# ---- the C packing against the twins, bit for bit ----------------------------------------------

@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("trans_b", [False, True])
@pytest.mark.parametrize("K,N", [(1, 1), (33, 17), (64, 130), (70, 45), (700, 200)])
def test_pack_weight_bitwise(fmt, trans_b, K, N):
    rng = np.random.default_rng(K * N)
    b = rng.standard_normal((N, K) if trans_b else (K, N)).astype(np.float32)
    got = _core.pack_weight(b, trans_b=trans_b, format=fmt)
    want = RN.pack_weight(b, fmt, _core.pack_width(), trans_b=trans_b)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert np.array_equal(got, want)
    assert np.array_equal(_core.pack_weight(b.astype(np.float64), trans_b=trans_b, format=fmt), got)


@pytest.mark.parametrize("trans_b", [False, True])
def test_pack_bfloat16_from_raw_bits(trans_b):
    rng = np.random.default_rng(3)
    b = rng.standard_normal((50, 37)).astype(np.float32)
    bits = R.to_bfloat16(b)
    bits[0, 0] = 0x7FA1                                       # a signalling NaN's bits: kept as they are
    got = _core.pack_weight(bits, trans_b=trans_b, format="bfloat16")
    want = RN.pack_weight(b, "bfloat16", _core.pack_width(), trans_b=trans_b)
    assert np.array_equal(got.ravel()[1:], want.ravel()[1:]) and got.ravel()[0] == 0x7FA1


def test_pack_q8_0_from_ggml_blocks():
    rng = np.random.default_rng(4)
    N, K = 45, 96
    w = rng.standard_normal((N, K)).astype(np.float32)        # a GGUF tensor's rows: (N, K)
    q, d = R.quantize_q8_0(w)                                  # (N, 3, 32), (N, 3)
    blocks = np.concatenate([d.view(np.uint8).reshape(N, 3, 2), q.view(np.uint8)], axis=2).reshape(N, 3 * 34)
    got = _core.pack_weight(np.ascontiguousarray(blocks), trans_b=True, format="q8_0")
    assert np.array_equal(got, _core.pack_weight(w, trans_b=True, format="q8_0"))


# ---- the products ------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("M", [1, 2, 4, 7, 16, 17, 19, 64, 65, 300])
@pytest.mark.parametrize("K,N", [(70, 45), (700, 130), (960, 2560 // 8)])
def test_linear_against_float64_on_dequantised(fmt, M, K, N):
    rng = np.random.default_rng(M + K + N)
    b = (rng.standard_normal((N, K)) / np.sqrt(K)).astype(np.float32)
    a = rng.standard_normal((M, K)).astype(np.float32)
    bias = rng.standard_normal(N).astype(np.float32)
    p = _core.pack_weight(b, trans_b=True, format=fmt)
    w = dequantised(b, fmt, True)
    want = a.astype(np.float64) @ w + bias
    got = _core.linear(a, p, columns=N, format=fmt, bias=bias)
    assert got.dtype == np.float32 and got.shape == (M, N)
    assert np.max(np.abs(got - want)) <= TOL * np.max(np.abs(want))
    # bitwise the float32 GEMM on the widened weights (the widenings are exact), except Q8_0
    # on few rows (each block's sum of a * q, then times its scale)
    same = _core.linear(a, _core.pack_weight(np.ascontiguousarray(w, np.float32)), columns=N, bias=bias)
    if fmt == "q8_0" and M <= 64:
        assert np.max(np.abs(got - same)) <= TOL * np.max(np.abs(want))
    else:
        assert np.array_equal(got, same)


@pytest.mark.parametrize("fmt", FORMATS)
def test_linear_epilogues(fmt):
    rng = np.random.default_rng(5)
    M, K, N = 9, 100, 40
    a = rng.standard_normal((M, K)).astype(np.float32)
    b = (rng.standard_normal((K, 2 * N)) / 10).astype(np.float32)
    bias = rng.standard_normal(2 * N).astype(np.float32)
    p = _core.pack_weight(b, format=fmt)
    z = a.astype(np.float64) @ dequantised(b, fmt, False) + bias
    silu = lambda x: x / (1 + np.exp(-x))                                          # noqa: E731
    got = _core.linear(a, p, columns=2 * N, format=fmt, bias=bias, act=3 | 16)   # SwiGLU
    want = silu(z[:, :N]) * z[:, N:]
    assert np.max(np.abs(got - want)) <= TOL * np.max(np.abs(want))
    got = _core.linear(a, p, columns=2 * N, format=fmt, act=5)                   # ReLU, no bias
    want = np.maximum(z - bias, 0)
    assert np.max(np.abs(got - want)) <= TOL * np.max(np.abs(want))
    out = rng.standard_normal((M, 2 * N)).astype(np.float32)                     # residual, in place
    want = out + z
    res = _core.linear(a, p, columns=2 * N, format=fmt, bias=bias, out=out)
    assert res is out and np.max(np.abs(out - want)) <= TOL * np.max(np.abs(want))


# ---- bad input ---------------------------------------------------------------------------------

def test_bad_input_raises_and_writes_nothing():
    rng = np.random.default_rng(6)
    a = rng.standard_normal((3, 64)).astype(np.float32)
    b = rng.standard_normal((64, 20)).astype(np.float32)
    p = _core.pack_weight(b, format="q8_0")
    out = np.full((3, 20), 7.0, np.float32)
    bad_calls = [
        dict(b=p, columns=20, format="q4_0"),                  # unknown format
        dict(b=p, columns=20, format="bfloat16"),              # another format's packing
        dict(b=p, columns=200, format="q8_0"),                 # columns beyond the panels
        dict(b=p[:, :1], columns=20, format="q8_0"),           # a K the packing lacks
        dict(b=p, columns=20, format="q8_0", bias=np.zeros(3, np.float32)),
        dict(b=p, columns=20, format="q8_0", trans_b=True),
        dict(b=p, columns=20, format="q8_0", act=3 | 16),      # gated: 10 columns out, not 20
    ]
    for kw in bad_calls:
        with pytest.raises((ValueError, TypeError)):
            _core.linear(a, out=out, accumulate=False, **kw)
        assert np.all(out == 7.0)
    with pytest.raises(ValueError):
        _core.linear(a, p, columns=20, format="q8_0", out=out, act=1)   # act with accumulate
    assert np.all(out == 7.0)
    with pytest.raises(ValueError):
        _core.pack_weight(b, format="int4")
    with pytest.raises(TypeError):
        _core.pack_weight(b.view(np.uint32), format="q8_0")
    with pytest.raises(ValueError):
        _core.pack_weight(np.zeros((3, 33), np.uint8), trans_b=True, format="q8_0")  # not whole blocks
    with pytest.raises(ValueError):
        R.dequantize_q8_0(np.zeros((2, 32), np.int8), np.zeros(3, np.float16))
    with pytest.raises(ValueError):
        RN.pack_weight(b, "int4", 16)


# ---- the product with the packing's transpose (input gradients) --------------------------------

@pytest.mark.parametrize("fmt", [None, "float64"] + FORMATS)
@pytest.mark.parametrize("M,K,N", [(1, 70, 45), (5, 960, 320), (40, 3000, 130), (3, 33, 1)])
def test_linear_transposed_against_float64(fmt, M, K, N):
    """a @ op(b)^T from the packing, against the twin's float64 product on the widened weights
    (measured: float32 <= 5.4e-7, float64 <= 1.3e-15 of the largest output, C tests)."""
    rng = np.random.default_rng(M * K + N)
    dtype = np.float64 if fmt == "float64" else np.float32
    f = None if fmt in (None, "float64") else fmt
    b = (rng.standard_normal((N, K)) / np.sqrt(N)).astype(dtype)
    a = rng.standard_normal((M, N)).astype(dtype)
    p = _core.pack_weight(b, trans_b=True, format=f)
    width = p.shape[2] if f != "q8_0" else p.shape[2] // 34
    want = RN.linear_transposed(a, p, f, N, rows=K)
    got = _core.linear_transposed(a, p, columns=N, format=f, rows=K)
    assert got.dtype == dtype and got.shape == (M, K)
    tol = 1e-14 if dtype == np.float64 else 5e-6
    assert np.max(np.abs(got - want)) <= tol * np.max(np.abs(want))
    # the twin's unpacking is the weights the forward product reads
    w = RN.unpack_weight(p, f, N, rows=K)
    assert w.shape == (K, N) and width == _core.pack_width(dtype)
    x = rng.standard_normal((2, K)).astype(dtype)
    fwd = _core.linear(x, p, columns=N, format=f)
    assert np.max(np.abs(fwd - x.astype(np.float64) @ w)) <= tol * np.max(np.abs(fwd)) * 10
    # accumulate into out, or overwrite it
    out = rng.standard_normal((M, K)).astype(dtype)
    res = _core.linear_transposed(a, p, columns=N, format=f, rows=K, out=out.copy())
    assert np.max(np.abs(res - (want + out))) <= tol * np.max(np.abs(want + out))
    res = _core.linear_transposed(a, p, columns=N, format=f, rows=K, out=out.copy(), accumulate=False)
    assert np.max(np.abs(res - want)) <= tol * np.max(np.abs(want))


def test_linear_transposed_q8_0_padded_rows_and_bad_input():
    rng = np.random.default_rng(9)
    b = rng.standard_normal((20, 40)).astype(np.float32)          # op(b): K = 20 rows, N = 40
    p = _core.pack_weight(b, format="q8_0")
    a = rng.standard_normal((2, 40)).astype(np.float32)
    full = _core.linear_transposed(a, p, columns=40, format="q8_0")  # K padded to 32: zeros after 20
    assert full.shape == (2, 32) and np.all(full[:, 20:] == 0)
    assert np.array_equal(_core.linear_transposed(a, p, columns=40, format="q8_0", rows=20), full[:, :20])
    with pytest.raises(ValueError):
        _core.linear_transposed(a, p, columns=41, format="q8_0")     # columns must be a's
    with pytest.raises(TypeError, match="uint16 was expected"):
        _core.linear_transposed(a, p, columns=40, format="bfloat16")  # another format's packing
    with pytest.raises(ValueError):
        _core.linear_transposed(a, p, columns=40, format="q8_0", rows=40)  # more rows than blocks
    with pytest.raises(ValueError):
        _core.linear_transposed(a, _core.pack_weight(b), columns=40, rows=21)   # native: K is 20


def test_packings_start_on_a_cache_line():
    """Every packing starts on a 64-byte line (a 32-byte load across two lines slows the AVX2
    micro-kernel), also one restored from a pickle at NumPy's 16-byte alignment."""
    from mha.models.weights import CACHE_LINE, Packed, aligned_copy
    rng = np.random.default_rng(0)
    b = rng.standard_normal((70, 45)).astype(np.float32)
    packings = [_core.pack_weight(b), _core.pack_weight(b.astype(np.float64), trans_b=True)]
    packings += [_core.pack_weight(b, format=f) for f in ("bfloat16", "float16", "q8_0")]
    for p in packings:
        assert p.ctypes.data % CACHE_LINE == 0 and p.flags.c_contiguous
    # a packing handed to __setstate__ 16 bytes past a line comes back on one, same values
    packed = Packed(b, keep=False)
    raw = np.empty(packed.data.nbytes + 2 * CACHE_LINE, np.uint8)
    start = -raw.ctypes.data % CACHE_LINE + 16
    off = raw[start:start + packed.data.nbytes].view(np.float32).reshape(packed.data.shape)
    off[...] = packed.data
    assert off.ctypes.data % CACHE_LINE == 16
    state = packed.__getstate__()
    state["data"] = off
    again = Packed.__new__(Packed)
    again.__setstate__(state)
    assert again.data.ctypes.data % CACHE_LINE == 0 and not again.data.flags.writeable
    np.testing.assert_array_equal(again.unpack(), b)
    copy = aligned_copy(off)
    assert copy.ctypes.data % CACHE_LINE == 0 and np.array_equal(copy, off)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("K,N", [(1, 1), (65, 130), (100, 33), (768, 300)])
def test_pack_weight_transposed_from_the_packing(dtype, K, N):
    """The packing of op(b)^T made from op(b)'s packing alone is bitwise pack_weight's of
    op(b)^T: new, or written into a workspace's first elements (the rest untouched); and the
    input gradient dx = dy @ op(b)^T of a packed weight (models.backward.linear_backward,
    more than 16 rows) equals NumPy's float64 product to float rounding."""
    from mha.models.backward import linear_backward
    from mha.models.weights import Packed
    rng = np.random.default_rng(1)
    b = rng.standard_normal((K, N)).astype(dtype)
    packed = _core.pack_weight(b)
    want = _core.pack_weight(b, trans_b=True)
    got = _core.pack_weight_transposed(packed, columns=N)
    assert got.shape == want.shape and np.array_equal(got, want)
    assert got.ctypes.data % 64 == 0
    ws = np.full(want.size + 7, -1.0, dtype)
    into = _core.pack_weight_transposed(packed, columns=N, out=ws)
    assert np.shares_memory(into, ws) and np.array_equal(into, want)
    assert np.all(ws[want.size:] == -1)
    dy = rng.standard_normal((40, N)).astype(dtype)
    exact = dy.astype(np.float64) @ b.T.astype(np.float64)
    for workspace in (None, np.empty(want.size, dtype)):
        dx = linear_backward(dy, None, Packed(b, keep=False), None, None, None,
                             workspace=workspace)
        tol = 5e-6 if dtype == np.float32 else 4e-15      # measured 6.6e-7 and 3.9e-16
        assert np.max(np.abs(dx - exact)) <= tol * np.max(np.abs(exact))


def test_pack_weight_transposed_bad_input():
    b = np.ones((20, 40), np.float32)
    p = _core.pack_weight(b)
    with pytest.raises(ValueError, match="columns=N"):
        _core.pack_weight_transposed(p, columns=40 + _core.pack_width())   # one panel too many
    with pytest.raises(ValueError, match="elements but the packing needs"):
        _core.pack_weight_transposed(p, columns=40, out=np.empty(10, np.float32))
    buffer = np.zeros(5000, np.float32)             # the packing inside the workspace
    inside = buffer[:p.size].reshape(p.shape)
    inside[...] = p
    with pytest.raises(ValueError, match="overlaps"):
        _core.pack_weight_transposed(inside, columns=40, out=buffer[p.size // 2:])
    assert np.array_equal(inside, p)
    with pytest.raises(TypeError, match="dtype"):
        _core.pack_weight_transposed(p, columns=40, out=np.empty(p.size, np.float64))
    with pytest.raises(ValueError, match="dimensions"):
        _core.pack_weight_transposed(b, columns=40)
