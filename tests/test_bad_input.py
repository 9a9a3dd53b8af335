"""Bad input, edge sizes, NaN/Inf, memory layouts and misuse (issue 3), beyond the basic error
table of test_errors.py.

- The binding (mha._C) under raw argument combinations: nothing a caller can pass may crash,
  hang or write outside an output. Crashes are reproduced in a child process, so that a
  regression shows as a failed test rather than a dead test run.
- Scalar arguments of every public function: TypeError/ValueError naming the argument.
- n_q = 0, n_k = 0, B = 0, d = 0: empty outputs, zeros, never an error or a crash.
- NaN/Inf propagate (at attended positions); fully masked rows stay exactly 0.
- Every memory layout gives the results of a contiguous array, and inputs are never modified.
- Using the layer wrongly raises a clear error and loses nothing (cache, params, last forward).

Comments "regression test, finding N" name the findings of the hardening review (issue 3's
closing note lists them) that each test keeps fixed. Finding 12, a NaN or Inf in v at a masked
key, is left unspecified by docs/semantics.md (whether it reaches a partly masked row depends on
the tiling); test_nan_in_v_at_a_masked_key_reaches_at_most_its_column holds the bounds that are
specified.
"""
import math
import os
import re
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import mha
import mha.reference as ref
from mha import _C
from conftest import assert_close

F32, F64 = np.float32, np.float64


def arr(*shape, dtype=F32, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


def run_isolated(body, timeout=60):
    """Runs `body` in a fresh interpreter (mha and numpy imported, address space capped at
    4 GiB unless under AddressSanitizer, one OpenMP thread); returns (returncode, stdout, stderr). A crash gives a negative
    return code (the signal) or 134 (abort), a hang the string 'TIMEOUT'."""
    cap = "" if "libasan" in os.environ.get("LD_PRELOAD", "") else \
        "import resource\nresource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))\n"
    script = cap + "import numpy as np, mha\nfrom mha import _C\n" + textwrap.dedent(body)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONFAULTHANDLER="1")
    try:
        proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                              timeout=timeout, env=env, cwd=os.path.dirname(__file__))
    except subprocess.TimeoutExpired:
        return "TIMEOUT", "", ""
    return proc.returncode, proc.stdout, proc.stderr


def assert_survives(body, expect=("ValueError", "TypeError", "MemoryError", "OverflowError", "OK"),
                    timeout=60):
    """The child must exit normally and print one of `expect` as its last line."""
    rc, out, err = run_isolated(body, timeout)
    assert rc == 0, f"the interpreter died (return code {rc}):\n{err[-3000:]}"
    last = out.strip().splitlines()[-1] if out.strip() else ""
    assert last.split(":")[0] in expect, f"unexpected outcome {last!r}\n{err[-2000:]}"
    return last


TRY = """
try:
{body}
    print("OK")
except (ValueError, TypeError, MemoryError, OverflowError) as e:
    print(type(e).__name__ + ": " + str(e)[:300])
"""


def guarded(body):
    return TRY.format(body=textwrap.indent(textwrap.dedent(body).strip(), "    "))


# ==================================================================================================
# 1. The binding under raw arguments
# ==================================================================================================

# regression test, finding 1: _C reads an uninitialised `scale` when it is not passed
def test_binding_scale_omitted_means_default_or_error():
    q, k, v = arr(1, 2, 6, 8), arr(1, 2, 9, 8, seed=1), arr(1, 2, 9, 4, seed=2)
    d_out = arr(1, 2, 6, 4, seed=3)
    expected = _C.attention_forward(q, k, v, None, None, False, 1 / math.sqrt(8))
    expected_grads = _C.attention_backward(d_out, q, k, v, None, None, False, 1 / math.sqrt(8))
    for call, want in ((lambda: _C.attention_forward(q, k, v), expected),
                       (lambda: _C.attention_backward(d_out, q, k, v), expected_grads)):
        try:
            got = call()
        except TypeError:
            continue                      # a required argument is a fine answer too
        for g, w in zip(got, want):
            assert_close(g, w, 1e-6, "scale omitted: must be 1/sqrt(d_k)")


# regression test, finding 2: k/v with 0 heads: the backward writes n_k x d zeros into empty dk/dv (heap overflow)
def test_binding_zero_kv_heads_does_not_corrupt_memory():
    assert_survives(guarded("""
        q = np.ones((1, 0, 3, 4), np.float32)
        k = np.ones((1, 0, 10000, 4), np.float32)
        v = np.ones((1, 0, 10000, 4), np.float32)
        d = np.ones((1, 0, 3, 4), np.float32)
        for _ in range(50):
            _C.attention_forward(q, k, v, None, None, False, 0.5)
            r = _C.attention_backward(d, q, k, v, None, None, False, 0.5)
        junk = [np.ones(1000) for _ in range(1000)]   # reuse the heap
    """))


# regression test, finding 3: heads * d_head overflows in _C.layer_forward (segfault)
@pytest.mark.parametrize("which", ["forward", "backward"])
def test_binding_layer_head_sizes_overflow(which):
    setup = """
        x = np.ones((1, 2, 8), np.float32)
        W0, Wo = np.ones((8, 0), np.float32), np.ones((0, 8), np.float32)
        params = dict(W_q=W0, W_k=W0, W_v=W0, W_o=Wo)
        H, D = 2**24, 2**40                         # H * D == 2**64 == 0 (mod 2**64)
        p = np.ones((1, 2, 0), np.float32)
        saved = dict(q_proj=p, k_proj=p, v_proj=p, attn=p)
    """
    call = {"forward": "r = _C.layer_forward(x, x, x, params, H, H, D, need_weights=False)\n",
            "backward": "r = _C.layer_backward(x, saved, x, x, x, params, H, H, D)\n"}[which]
    assert_survives(guarded(textwrap.dedent(setup) + call))


# regression test, finding 4: cache_length + n_new overflows in _C.layer_forward (heap corruption)
def test_binding_cache_length_overflow():
    out = assert_survives(guarded("""
        x = np.ones((1, 1, 8), np.float32)
        W = np.ones((8, 8), np.float32)
        params = dict(W_q=W, W_k=W, W_v=W, W_o=W)
        kc, vc = np.zeros((1, 4, 8), np.float32), np.zeros((1, 4, 8), np.float32)
        for length in (2**63 - 1, 2**63 - 2, 2**62):
            try:
                _C.layer_forward(x, x, x, params, 2, 2, 4, None, None, True, 0.0, 0, False,
                                 kc, vc, length)
                raise SystemExit(f"no error for cache_length={length}")
            except ValueError:
                pass
        junk = [np.ones(1000) for _ in range(1000)]
    """))
    assert out == "OK"


# regression test, finding 5: the KV cache buffers are written without checking that they are writeable
def test_binding_read_only_cache_is_refused():
    x = np.ones((1, 1, 8), F32)
    W = np.ones((8, 8), F32)
    params = dict(W_q=W, W_k=W, W_v=W, W_o=W)
    frozen = bytes(4 * 8 * 4)                        # an immutable Python object
    kc = np.frombuffer(frozen, F32).reshape(1, 4, 8)
    vc = np.zeros((1, 4, 8), F32)
    try:
        _C.layer_forward(x, x, x, params, 2, 2, 4, None, None, True, 0.0, 0, False, kc, vc, 0)
    except ValueError as e:
        assert "k_cache" in str(e)
    assert frozen == bytes(len(frozen)), "an immutable bytes object was modified"


# regression test, finding 5: a read-only KVCache was written to
def test_layer_read_only_cache_is_refused():
    layer = mha.MultiHeadAttention(8, 2, seed=0)
    cache = layer.new_cache(1, 4)
    cache.k_rows.flags.writeable = False
    cache.v_rows.flags.writeable = False
    with pytest.raises(ValueError, match="cache"):
        layer(arr(1, 2, 8), cache=cache, causal=True)
    assert not cache.k_rows.any() and cache.length == 0


# regression test, finding 6: _C accepts byte-swapped arrays and reads them as native (garbage)
def test_binding_byte_swapped_arrays():
    q = arr(1, 1, 3, 4)
    expected = _C.attention_forward(q, q, q, None, None, False, 0.5)
    qs = q.astype(q.dtype.newbyteorder())
    try:
        got = _C.attention_forward(qs, qs, qs, None, None, False, 0.5)
    except (TypeError, ValueError):
        return
    for g, e in zip(got, expected):
        assert_close(g, e, 1e-6, "byte-swapped input read as native")


# regression test, finding 7: empty inputs with huge leading axes loop over ~2**54 empty tasks with the GIL released (a hang)
@pytest.mark.parametrize("entry", ["public", "binding"])
def test_empty_inputs_with_huge_axes_return_at_once(entry):
    setup = """
        q = np.zeros((2**20, 2**20, 2**14, 0), np.float32)     # 0 bytes
        k = np.zeros((2**20, 2**20, 3, 0), np.float32)
        v = np.zeros((2**20, 2**20, 3, 0), np.float32)
        d = np.zeros((2**20, 2**20, 2**14, 0), np.float32)
    """
    calls = {"public": """
        mha.attention(q, k, v, scale=1.0, need_weights=False)
        mha.attention_backward(d, q, k, v, scale=1.0)
    """, "binding": """
        _C.attention_forward(q, k, v, None, None, False, 1.0, 0.0, 0, False)
        _C.attention_backward(d, q, k, v, None, None, False, 1.0)
    """}
    assert_survives(guarded(textwrap.dedent(setup) + textwrap.dedent(calls[entry])), timeout=8)


def test_binding_rejects_what_the_core_cannot_take():
    """The binding's own checks (the safety net under the Python layer)."""
    q, k, v = arr(1, 2, 5, 8), arr(1, 2, 7, 8), arr(1, 2, 7, 4)
    W, x = arr(8, 8), arr(1, 5, 8)
    params = dict(W_q=W, W_k=W, W_v=W, W_o=W)
    no_W_o = {name: a for name, a in params.items() if name != "W_o"}
    cases = [
        (TypeError, r"\bq\b", lambda: _C.attention_forward(q.astype(int), k, v, None, None, False, 1.0)),
        (TypeError, r"\bk\b", lambda: _C.attention_forward(q, k.astype(F64), v, None, None, False, 1.0)),
        (TypeError, r"\bq\b", lambda: _C.attention_forward([[1.0]], k, v, None, None, False, 1.0)),
        (ValueError, r"\bq\b", lambda: _C.attention_forward(q[0], k, v, None, None, False, 1.0)),
        (ValueError, r"\bq\b", lambda: _C.attention_forward(q[..., ::2], k[..., ::2], v, None, None,
                                                            False, 1.0)),
        (ValueError, r"\bv\b", lambda: _C.attention_forward(q, k, v[:, :, :3], None, None, False, 1.0)),
        (ValueError, "heads", lambda: _C.attention_forward(arr(1, 3, 5, 8), k, v, None, None, False, 1.0)),
        (ValueError, "mask", lambda: _C.attention_forward(q, k, v, np.ones((5, 7), bool), None, False, 1.0)),
        (ValueError, "mask", lambda: _C.attention_forward(q, k, v, np.ones((1, 2, 5, 6), bool), None,
                                                          False, 1.0)),
        (TypeError, "mask", lambda: _C.attention_forward(q, k, v, np.ones((1, 2, 5, 7)), None, False, 1.0)),
        (TypeError, "mask", lambda: _C.attention_forward(q, k, v, [[1]], None, False, 1.0)),
        (ValueError, "key_padding_mask", lambda: _C.attention_forward(q, k, v, None, np.ones((1, 6), bool),
                                                                      False, 1.0)),
        (TypeError, "key_padding_mask", lambda: _C.attention_forward(q, k, v, None, np.ones((1, 7)),
                                                                     False, 1.0)),
        (ValueError, "dropout", lambda: _C.attention_forward(q, k, v, None, None, False, 1.0, 1.0)),
        (ValueError, "dropout", lambda: _C.attention_forward(q, k, v, None, None, False, 1.0, float("nan"))),
        (ValueError, "dropout", lambda: _C.attention_forward(q, k, v, None, None, False, 1.0, -0.5)),
        (ValueError, "d_out", lambda: _C.attention_backward(arr(1, 2, 5, 3), q, k, v, None, None, False, 1.0)),
        (ValueError, "heads", lambda: _C.layer_forward(x, x, x, params, 0, 1, 4)),
        (ValueError, "heads", lambda: _C.layer_forward(x, x, x, params, 2, 3, 4)),
        (ValueError, "heads", lambda: _C.layer_forward(x, x, x, params, -2, -2, -4)),
        (TypeError, "params", lambda: _C.layer_forward(x, x, x, no_W_o, 2, 2, 4)),
        (TypeError, "params", lambda: _C.layer_forward(x, x, x, list(params.values()), 2, 2, 4)),
        (TypeError, "params", lambda: _C.layer_forward(x, x, x, dict(params, W_x=W), 2, 2, 4)),
        (ValueError, "W_o", lambda: _C.layer_forward(x, x, x, dict(params, W_o=W[:4]), 2, 2, 4)),
        (ValueError, "b_q", lambda: _C.layer_forward(x, x, x, dict(params, b_q=W[0, :3]), 2, 2, 4)),
        (ValueError, "head_mask", lambda: _C.layer_forward(x, x, x, dict(params, head_mask=np.ones(3, F32)), 2, 2, 4)),
        (TypeError, "head_mask", lambda: _C.layer_forward(x, x, x, dict(params, head_mask=np.ones(2)), 2, 2, 4)),
        (ValueError, "cache", lambda: _C.layer_forward(x, x, x, params, 2, 2, 4, None, None, True, 0.0, 0,
                                                       False, np.zeros((1, 4, 8), F32),
                                                       np.zeros((1, 4, 8), F32), 0)),
        (ValueError, "cache", lambda: _C.layer_forward(x, x, x, params, 2, 2, 4, None, None, True, 0.0, 0,
                                                       False, np.zeros((1, 8, 8), F32),
                                                       np.zeros((1, 8, 8), F32), -1)),
        (ValueError, "v_cache", lambda: _C.layer_forward(x, x, x, params, 2, 2, 4, None, None, True, 0.0, 0,
                                                         False, np.zeros((1, 8, 8), F32),
                                                         np.zeros((1, 7, 8), F32), 0)),
        (ValueError, "\\ba\\b|\\bb\\b|columns", lambda: _C.matmul(W, arr(7, 3))),
        (ValueError, "\\bn\\b", lambda: _C.set_num_threads(0)),
        (ValueError, "\\bn\\b", lambda: _C.set_num_threads(10**6)),
        (TypeError, "int|str", lambda: _C.set_num_threads("2")),
    ]
    for exc, pattern, call in cases:
        with pytest.raises(exc, match=pattern):
            call()


# ==================================================================================================
# 2. Scalar arguments and constructor arguments
# ==================================================================================================

Q, K_, V_ = arr(2, 5, 8), arr(2, 7, 8, seed=1), arr(2, 7, 4, seed=2)
DO = arr(2, 5, 4, seed=3)

NAMING = [
    # (id, call, exception, the argument the message must name)
    ("scale-str", lambda: mha.attention(Q, K_, V_, scale="abc"), (TypeError, ValueError), "scale"),
    ("scale-list", lambda: mha.attention(Q, K_, V_, scale=[1, 2]), (TypeError, ValueError), "scale"),
    ("scale-array", lambda: mha.attention(Q, K_, V_, scale=np.ones(2)), (TypeError, ValueError), "scale"),
    ("scale-complex", lambda: mha.attention(Q, K_, V_, scale=1j), (TypeError, ValueError), "scale"),
    ("backward-scale-str", lambda: mha.attention_backward(DO, Q, K_, V_, scale="x"),
     (TypeError, ValueError), "scale"),
    ("causal-array", lambda: mha.attention(Q, K_, V_, causal=np.ones(3)), (TypeError, ValueError),
     "causal"),
    ("need_weights-array", lambda: mha.attention(Q, K_, V_, need_weights=np.ones(3)),
     (TypeError, ValueError), "need_weights"),
    ("q-ragged", lambda: mha.attention([[1.0, 2.0], [1.0]], K_, V_), (TypeError, ValueError), r"\bq\b"),
    ("layer-d_model-float", lambda: mha.MultiHeadAttention(8.0, 2), (TypeError, ValueError), "d_model"),
    ("layer-d_model-str", lambda: mha.MultiHeadAttention("8", 2), (TypeError, ValueError), "d_model"),
    ("layer-n_heads-float", lambda: mha.MultiHeadAttention(8, 2.5), (TypeError, ValueError), "n_heads"),
    ("layer-dropout-str", lambda: mha.MultiHeadAttention(8, 2, dropout="x"), (TypeError, ValueError),
     "dropout"),
    ("layer-seed-negative", lambda: mha.MultiHeadAttention(8, 2, seed=-1), (TypeError, ValueError), "seed"),
    ("layer-seed-str", lambda: mha.MultiHeadAttention(8, 2, seed="abc"), (TypeError, ValueError), "seed"),
    ("layer-dtype-bogus", lambda: mha.MultiHeadAttention(8, 2, dtype="bogus"), (TypeError, ValueError),
     "dtype"),
]


# regression test, finding 13: these messages come from float()/bool()/operator.index()/NumPy and do not name the argument
@pytest.mark.parametrize("case", NAMING, ids=[c[0] for c in NAMING])
def test_scalar_arguments_are_named(case):
    _, call, exc, name = case
    with pytest.raises(exc) as info:
        call()
    assert re.search(name, str(info.value)), f"{info.value!r} does not name {name!r}"


def test_scalar_arguments_already_named():
    """The scalar checks that work today (guard against regressions)."""
    for call, exc, name in [
        (lambda: mha.attention(Q, K_, V_, dropout=[0.1], seed=1), TypeError, "dropout"),
        (lambda: mha.attention(Q, K_, V_, dropout=None), TypeError, "dropout"),
        (lambda: mha.attention(Q, K_, V_, dropout=0.1, seed=1.5), TypeError, "seed"),
        (lambda: mha.attention(Q, K_, V_, dropout=0.1, seed=True), TypeError, "seed"),
        (lambda: mha.attention_backward(DO, Q, K_, V_, dropout=1.0, seed=1), ValueError, "dropout"),
        (lambda: mha.attention_backward(None, Q, K_, V_), TypeError, "d_out"),
        (lambda: mha.attention(Q.astype(np.longdouble), K_, V_), TypeError, r"\bq\b"),
        (lambda: mha.attention(np.float32(1.0), K_, V_), ValueError, r"\bq\b"),
        (lambda: mha.attention(Q, K_, V_, np.zeros((5, 7), "M8[s]")), TypeError, "mask"),
        (lambda: mha.MultiHeadAttention(8, 2, dropout=float("nan")), ValueError, "dropout"),
        (lambda: mha.MultiHeadAttention(-8, 2), ValueError, "d_model"),
        (lambda: mha.MultiHeadAttention(7, 2), ValueError, "d_model"),
        (lambda: mha.MultiHeadAttention(8, 2, kdim=0), ValueError, "kdim"),
        (lambda: mha.MultiHeadAttention(8, 2, dtype=np.float16), TypeError, "dtype"),
    ]:
        with pytest.raises(exc, match=name):
            call()


# regression test, finding 10: d_k = 0 raises ZeroDivisionError (1/sqrt(0)) instead of working (the core takes scale 1) or ValueError
@pytest.mark.parametrize("fn", ["attention", "attention_backward"])
def test_zero_width_keys(fn):
    q, k, v = np.ones((3, 0), F32), np.ones((4, 0), F32), arr(4, 2)
    try:
        if fn == "attention":
            out, w = mha.attention(q, k, v)
            assert_close(w, np.full((3, 4), 0.25), 1e-7, "d_k = 0: scores 0, uniform weights")
        else:
            mha.attention_backward(np.ones((3, 2), F32), q, k, v)
    except ValueError as e:
        assert re.search(r"\bq\b|d_k", str(e))


# regression test, finding 14: a layer too big to build raises NumPy's ValueError('array is too big') instead of MemoryError
def test_layer_too_big_to_build_raises_memory_error():
    with pytest.raises(MemoryError, match="W_q|d_model|param"):
        mha.MultiHeadAttention(2**40, 1)


# ==================================================================================================
# 3. Empty sizes
# ==================================================================================================

@pytest.mark.parametrize("dtype", [F32, F64])
@pytest.mark.parametrize("causal", [False, True])
def test_empty_queries_keys_batches_and_widths(dtype, causal):
    """n_q = 0: empty output, zero dk/dv; n_k = 0: zero output and dq; B = 0 and d_v = 0 empty;
    with every mask kind."""
    for qs, ks, vs in [((2, 0, 8), (2, 7, 8), (2, 7, 4)),          # n_q = 0
                       ((2, 5, 8), (2, 0, 8), (2, 0, 4)),          # n_k = 0
                       ((2, 0, 8), (2, 0, 8), (2, 0, 4)),          # both
                       ((0, 5, 8), (0, 7, 8), (0, 7, 4)),          # B = 0
                       ((2, 5, 8), (2, 7, 8), (2, 7, 0)),          # d_v = 0
                       ((2, 3, 5, 8), (2, 1, 0, 8), (2, 1, 0, 4)),  # GQA, n_k = 0
                       ((5, 8), (0, 8), (0, 3))]:                  # rank 2
        q, k, v = arr(*qs, dtype=dtype), arr(*ks, dtype=dtype), arr(*vs, dtype=dtype)
        n_q, n_k = qs[-2], ks[-2]
        d_out = arr(*(qs[:-1] + (vs[-1],)), dtype=dtype)
        for mask in (None, np.ones((n_q, n_k), bool), np.zeros((n_q, n_k), dtype)):
            for kw in (dict(), dict(dropout=0.5, seed=1)):
                out, w = mha.attention(q, k, v, mask, causal=causal, **kw)
                assert out.shape == qs[:-1] + (vs[-1],) and out.dtype == dtype
                assert w.shape == qs[:-1] + (n_k,)
                assert not out.any(), "no keys, rows, batches or columns: zeros or empty"
                dq, dk, dv = mha.attention_backward(d_out, q, k, v, mask, causal=causal, **kw)
                assert dq.shape == qs and dk.shape == ks and dv.shape == vs
                if n_k == 0:
                    assert not dq.any()
                if n_q == 0:
                    assert not dk.any() and not dv.any()
                assert np.isfinite(out).all() and np.isfinite(dq).all()


@pytest.mark.parametrize("dtype", [F32, F64])
def test_layer_empty_sequences(dtype):
    layer = mha.MultiHeadAttention(8, 2, seed=0, dtype=dtype)
    for name in ("b_q", "b_k", "b_v", "b_o"):
        layer.params[name][...] = arr(*layer.params[name].shape, dtype=dtype)
    x = arr(2, 3, 8, dtype=dtype)
    # no queries
    out, w = layer(x[:, :0])
    assert out.shape == (2, 0, 8) and w.shape == (2, 2, 0, 0)
    d_query, _, _ = layer.backward(np.zeros((2, 0, 8), dtype))
    assert d_query.shape == (2, 0, 8) and not layer.grads["W_q"].any()
    # no keys: every row is fully masked, attention gives 0, the output is the bias b_o
    out, w = layer(x, x[:, :0])
    assert w.shape == (2, 2, 3, 0)
    assert_close(out, np.broadcast_to(layer.params["b_o"], out.shape), 1e-6, "n_k = 0: out = b_o")
    d_query, d_key, _ = layer.backward(np.ones_like(out))
    assert not d_query.any() and d_key.shape == (2, 0, 8)
    assert not layer.grads["W_q"].any() and layer.grads["b_o"].any()
    # empty batch
    out, w = layer(x[:0])
    assert out.shape == (0, 3, 8)
    assert layer.backward(np.zeros((0, 3, 8), dtype))[0].shape == (0, 3, 8)
    # a KV cache step of no new tokens
    cache = layer.new_cache(2, 4)
    out, w = layer(x[:, :0], cache=cache, causal=True)
    assert out.shape == (2, 0, 8) and cache.length == 0


# ==================================================================================================
# 4. NaN and Inf
# ==================================================================================================

@pytest.mark.parametrize("dtype", [F32, F64])
def test_nan_and_inf_propagate_through_attended_positions(dtype):
    """No mask, no causal: every key is attended by every query."""
    r = np.random.default_rng(0)
    q, k, v = (r.standard_normal((2, 6, 5)).astype(dtype) for _ in range(3))
    d_out = r.standard_normal((2, 6, 5)).astype(dtype)
    clean_out, _ = mha.attention(q, k, v)
    clean_grads = mha.attention_backward(d_out, q, k, v)
    for bad in (np.nan, np.inf, -np.inf):
        # q row 2 of batch 0: that row only
        q2 = q.copy(); q2[0, 2, 1] = bad
        out, w = mha.attention(q2, k, v)
        assert np.isnan(out[0, 2]).all() and np.isnan(w[0, 2]).any()
        keep = np.ones((2, 6), bool); keep[0, 2] = False
        np.testing.assert_array_equal(out[keep], clean_out[keep])
        # k row 3 of batch 1: every query of batch 1 sees it
        k2 = k.copy(); k2[1, 3, 0] = np.nan
        out, w = mha.attention(q, k2, v)
        assert np.isnan(out[1]).all() and np.isnan(w[1]).all()
        np.testing.assert_array_equal(out[0], clean_out[0])
        # v[0, 4, 2]: column 2 of every output row of batch 0
        v2 = v.copy(); v2[0, 4, 2] = bad
        out, _ = mha.attention(q, k, v2)
        assert not np.isfinite(out[0, :, 2]).any()
        assert np.isfinite(np.delete(out[0], 2, axis=-1)).all()
        dq, dk, dv = mha.attention_backward(d_out, q, k, v2)
        assert not np.isfinite(dq[0]).all() and np.isfinite(dq[1]).all()
        # d_out row 1 of batch 0: dq row 1, all of dk and dv of batch 0
        do2 = d_out.copy(); do2[0, 1, 3] = bad
        dq, dk, dv = mha.attention_backward(do2, q, k, v)
        assert not np.isfinite(dq[0, 1]).all() and np.isfinite(np.delete(dq[0], 1, axis=0)).all()
        assert not np.isfinite(dv[0]).all()
        for g, c in zip((dq[1], dk[1], dv[1]), (x[1] for x in clean_grads)):
            np.testing.assert_array_equal(g, c)
    # NaN scale: everything NaN (nothing silently zeroed)
    out, w = mha.attention(q, k, v, scale=float("nan"))
    assert np.isnan(out).all() and np.isnan(w).all()
    # a float mask with NaN or +inf at (i, j) poisons row i
    for bad in (np.nan, np.inf):
        m = np.zeros((6, 6), dtype); m[4, 1] = bad
        out, w = mha.attention(q, k, v, m)
        assert np.isnan(out[:, 4]).all() and np.isfinite(np.delete(out, 4, axis=1)).all()


def test_nan_propagates_through_the_layer():
    layer = mha.MultiHeadAttention(8, 2, seed=0, dtype=F64)
    x = arr(2, 5, 8, dtype=F64)
    out, _ = layer(x)
    assert np.isfinite(out).all()
    x2 = x.copy(); x2[0, 3, 0] = np.nan                   # self-attention: its key reaches all rows
    out, _ = layer(x2)
    assert np.isnan(out[0]).all() and np.isfinite(out[1]).all()
    d = layer.backward(np.ones_like(out))[0]
    assert np.isnan(d[0]).any() and np.isfinite(d[1]).all()
    assert np.isnan(layer.grads["W_q"]).any()
    for name in ("W_v", "b_o"):
        saved = layer.params[name].copy()
        layer.params[name].flat[0] = np.nan
        out, _ = layer(x)
        assert np.isnan(out).any(), f"NaN in {name} must reach the output"
        layer.params[name][...] = saved
    layer.head_mask = np.array([np.nan, 1.0])
    out, _ = layer(x)
    assert np.isnan(out).all()


@pytest.mark.parametrize("dtype", [F32, F64])
@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_fully_masked_rows_stay_zero_whatever_v_and_k_hold(dtype, bad):
    """docs/semantics.md, Conventions: a fully masked row gives output 0, weights 0, gradient 0, never NaN."""
    r = np.random.default_rng(1)
    q, k, v = (r.standard_normal((2, 6, 4)).astype(dtype) for _ in range(3))
    d_out = r.standard_normal((2, 6, 4)).astype(dtype)
    mask = r.random((2, 6, 6)) < 0.7
    mask[:, :, 2] = True                                  # every other row sees the bad key
    mask[:, 1] = False                                    # row 1 sees nothing
    k[:, 2, 0] = bad
    v[:, 2, 1] = bad
    out, w = mha.attention(q, k, v, mask)
    assert not out[:, 1].any() and not w[:, 1].any()
    dq, dk, dv = mha.attention_backward(d_out, q, k, v, mask)
    assert not dq[:, 1].any()


# finding 12: left unspecified (docs/semantics.md); the bounds around it hold
@pytest.mark.parametrize("need_weights", [True, False])
@pytest.mark.parametrize("dtype", [F32, F64])
def test_nan_in_v_at_a_masked_key_reaches_at_most_its_column(dtype, need_weights):
    """A NaN in v at key j, column c, under a causal and a bool mask, with several query blocks
    and key tiles: the rows that attend key j are NaN in column c; every other entry of every
    row equals the clean result, except that column c of a row that masks key j may be NaN
    (unspecified: it depends on the tiling); a fully masked row stays 0; the weights (from q
    and k) do not change."""
    B, H, n_q, n_k, d, j, c = 2, 2, 150, 300, 8, 200, 3
    r = np.random.default_rng(4)
    q, k, v = (r.standard_normal((B, H, n, d)).astype(dtype) for n in (n_q, n_k, n_k))
    mask = r.random((B, 1, n_q, n_k)) < 0.8
    mask[:, :, 5] = False                                   # row 5 sees no key
    clean_out, clean_w = mha.attention(q, k, v, mask, causal=True)
    v[:, :, j, c] = np.nan
    out, w = mha.attention(q, k, v, mask, causal=True, need_weights=need_weights)
    rows = np.arange(n_q)
    attends = np.broadcast_to(mask[..., j] & (j <= rows + (n_k - n_q)), (B, H, n_q))
    assert attends.any() and (~attends[..., 50:]).any()    # both kinds among rows that can see j
    assert np.isnan(out[..., c][attends]).all()
    tol = 1e-5 if dtype == F32 else 1e-12
    others = np.delete(out, c, axis=-1)
    assert_close(others, np.delete(clean_out, c, axis=-1), tol, "columns other than the NaN's")
    masked_c, clean_c = out[..., c][~attends], clean_out[..., c][~attends]
    nan = np.isnan(masked_c)
    assert_close(masked_c[~nan], clean_c[~nan], tol, "column c where key j is masked")
    assert not out[:, :, 5].any()
    if need_weights:
        np.testing.assert_array_equal(w, clean_w)


# regression test, finding 11: NaN/Inf in d_out at a fully masked row reaches dk and dv
@pytest.mark.parametrize("dtype", [F32, F64])
def test_fully_masked_rows_ignore_their_d_out(dtype):
    r = np.random.default_rng(2)
    q, k, v = (r.standard_normal((6, 4)).astype(dtype) for _ in range(3))
    mask = np.ones((6, 6), bool)
    mask[1] = False
    d_out = r.standard_normal((6, 4)).astype(dtype)
    clean = mha.attention_backward(d_out, q, k, v, mask)
    d_out[1] = np.nan
    got = mha.attention_backward(d_out, q, k, v, mask)
    for name, g, c in zip(("dq", "dk", "dv"), got, clean):
        assert_close(g, c, 1e-6, f"{name} with NaN in a fully masked row of d_out")


# ==================================================================================================
# 5. Memory layouts
# ==================================================================================================

def unaligned(a):
    """The same values in a C-contiguous array whose data pointer is not aligned to its items."""
    buf = np.zeros(a.nbytes + 1, np.uint8)
    u = buf[1:].view(a.dtype).reshape(a.shape)
    u[...] = a
    assert not u.flags.aligned
    return u


def layouts(a):
    fortran = np.asfortranarray(a)
    big = np.zeros(a.shape[:-1] + (3 * a.shape[-1],), a.dtype)
    strided = big[..., 1::3]
    strided[...] = a
    flip = tuple(slice(None, None, -1) for _ in a.shape)
    negative = np.ascontiguousarray(a[flip])[flip]
    readonly = a.copy()
    readonly.flags.writeable = False
    swapped = a.astype(a.dtype.newbyteorder()) if a.dtype != bool else a.copy()
    return {"fortran": fortran, "strided": strided, "negative-stride": negative,
            "read-only": readonly, "byte-swapped": swapped}


@pytest.mark.parametrize("dtype", [F32, F64])
@pytest.mark.parametrize("layout", ["fortran", "strided", "negative-stride", "read-only", "byte-swapped"])
def test_layer_layouts_give_contiguous_results(dtype, layout):
    """Every array the layer reads (inputs, masks, d_out, parameters, head_mask) in another
    memory layout: bitwise the contiguous results, nothing modified."""
    r = np.random.default_rng(4)
    layer = mha.MultiHeadAttention(12, 3, kdim=5, vdim=7, seed=0, dtype=dtype)
    for name in layer.params:
        layer.params[name] = r.standard_normal(layer.params[name].shape).astype(dtype)
    layer.head_mask = np.array([1.0, 0.5, 0.0], dtype)
    query, key, value = arr(2, 4, 12, dtype=dtype), arr(2, 6, 5, dtype=dtype, seed=1), \
        arr(2, 6, 7, dtype=dtype, seed=2)
    mask = r.random((4, 6)) < 0.8
    fmask = np.where(r.random((2, 1, 4, 6)) < 0.8, r.standard_normal((2, 1, 4, 6)), -np.inf)
    kpm = np.ones((2, 6), bool); kpm[1, 4:] = False
    d_out = arr(2, 4, 12, dtype=dtype, seed=3)

    def run(L, q, k, v, m, fm, kp, d):
        out1, w1 = L(q, k, v, mask=m, key_padding_mask=kp, causal=True)
        g1 = L.backward(d)
        grads1 = {n: g.copy() for n, g in L.grads.items()}
        out2, w2 = L(q, k, v, mask=fm)
        g2 = L.backward(d)
        return [out1, w1, *g1, out2, w2, *g2] + [grads1[n] for n in sorted(grads1)]

    expected = run(layer, query, key, value, mask, fmask, kpm, d_out)
    moved = [layouts(a)[layout] for a in (query, key, value, mask, fmask, kpm, d_out)]
    layer.params = {n: layouts(p)[layout] for n, p in layer.params.items()}
    layer.head_mask = layouts(layer.head_mask)[layout]
    snap = [(a, a.copy()) for a in moved + list(layer.params.values()) + [layer.head_mask]]
    got = run(layer, *moved)
    for i, (g, e) in enumerate(zip(got, expected)):
        assert g.dtype == e.dtype and g.shape == e.shape, i
        np.testing.assert_array_equal(g, e, err_msg=f"result {i} differs with {layout} inputs")
    for a, copy in snap:
        np.testing.assert_array_equal(a, copy)


def test_broadcast_views_as_inputs():
    """Zero-stride views (np.broadcast_to) are valid inputs everywhere."""
    row = arr(1, 8)
    q = np.broadcast_to(row, (2, 5, 8))
    k = np.broadcast_to(arr(7, 8, seed=1), (2, 7, 8))
    v = np.broadcast_to(arr(1, 7, 4, seed=2), (2, 7, 4))
    d_out = np.broadcast_to(arr(4, seed=3), (2, 5, 4))
    out, w = mha.attention(q, k, v, causal=True)
    ref_out, ref_w = ref.attention(*(np.array(a, F64) for a in (q, k, v)), causal=True)
    assert_close(out, ref_out, 1e-5, "out")
    grads = mha.attention_backward(d_out, q, k, v, causal=True)
    ref_grads = ref.attention_backward(*(np.array(a, F64) for a in (d_out, q, k, v)), causal=True)
    for g, rg in zip(grads, ref_grads):
        assert_close(g, rg, 1e-5, "gradient")
    layer = mha.MultiHeadAttention(8, 2, seed=0)
    out, _ = layer(q)
    assert layer.backward(np.broadcast_to(np.ones(8, F32), out.shape))[0].shape == q.shape


UNALIGNED_CALLS = {
    "q": lambda u: mha.attention(u(Q), K_, V_),
    "k": lambda u: mha.attention(Q, u(K_), V_),
    "float mask": lambda u: mha.attention(Q, K_, V_, u(np.zeros((5, 7), F32))),
    "d_out": lambda u: mha.attention_backward(u(DO), Q, K_, V_),
    "layer query": lambda u: mha.MultiHeadAttention(8, 2, seed=0)(u(Q)),
    "layer d_out": lambda u: (lambda L: (L(Q), L.backward(u(np.ones_like(Q)))))(
        mha.MultiHeadAttention(8, 2, seed=0)),
    "layer W_q": lambda u: (lambda L: (L.params.__setitem__("W_q", u(L.params["W_q"])), L(Q)))(
        mha.MultiHeadAttention(8, 2, seed=0)),
    "layer head_mask": lambda u: (lambda L: (setattr(L, "head_mask", u(np.array([1.0, 0.5], F32))),
                                             L(Q)))(mha.MultiHeadAttention(8, 2, seed=0)),
}


# regression test, finding 8: unaligned arrays reach the binding, which refuses them ('must be C-contiguous and aligned')
@pytest.mark.parametrize("which", sorted(UNALIGNED_CALLS))
def test_unaligned_inputs_are_accepted(which):
    call = UNALIGNED_CALLS[which]
    expected = call(lambda a: a.copy())
    got = call(unaligned)
    assert repr(got) == repr(expected)


# regression test, finding 9: a float64 d_out makes the backward compute in float64 with the float mask already rounded to float32
def test_backward_promoted_by_d_out_uses_the_full_precision_mask():
    r = np.random.default_rng(5)
    q, k, v = (r.standard_normal((4, 3)).astype(F32) for _ in range(3))
    d_out = r.standard_normal((4, 3))                      # float64: the backward is float64
    mask = r.standard_normal((4, 4))                       # float64 mask, not representable in f32
    grads = mha.attention_backward(d_out, q, k, v, mask)
    assert grads[0].dtype == F64
    expected = ref.attention_backward(d_out, *(a.astype(F64) for a in (q, k, v)), mask)
    for name, g, e in zip(("dq", "dk", "dv"), grads, expected):
        assert_close(g, e, 1e-12, name)


# ==================================================================================================
# 6. Using the layer wrongly: clear errors, nothing lost
# ==================================================================================================

def test_layer_misuse_raises_clearly():
    layer = mha.MultiHeadAttention(8, 2, seed=0)
    x = arr(2, 3, 8)
    with pytest.raises(RuntimeError, match="forward"):
        layer.backward(np.ones((2, 3, 8)))
    layer(x)
    for d_out, exc, pattern in [(np.ones(8), ValueError, r"d_out.*\(8,\).*\(2, 3, 8\)"),
                                (np.ones((3, 8)), ValueError, r"d_out.*\(3, 8\)"),
                                (np.ones((2, 3, 8), complex), TypeError, "d_out"),
                                ("abc", TypeError, "d_out"), (None, TypeError, "d_out")]:
        with pytest.raises(exc, match=pattern):
            layer.backward(d_out)
    layer.prune_heads([1])
    with pytest.raises(RuntimeError, match="forward"):
        layer.backward(np.ones((2, 3, 8)))        # the pruned layer has no forward to go back through
    with pytest.raises(TypeError, match="cache"):
        layer(x, cache={"k": 0})
    cache = layer.new_cache(2, 4)
    layer(x, cache=cache, causal=True)
    with pytest.raises(RuntimeError, match="cache"):
        layer.backward(np.ones((2, 3, 8)))
    with pytest.raises(ValueError, match="cache"):
        layer(x, cache=cache, causal=True)        # 3 cached + 3 new > 4
    with pytest.raises(ValueError, match="cache"):
        mha.MultiHeadAttention(8, 2, seed=0, dtype=F64)(x, cache=cache)
    with pytest.raises(ValueError, match="batch_size|max_len"):
        layer.new_cache(0, 4)
    with pytest.raises(ValueError, match="batch_size|max_len"):
        layer.new_cache(2, -1)


def test_failed_calls_lose_nothing():
    """A call that raises leaves the cache, the parameters, the gradients and the last forward
    exactly as they were: the next backward is the one of the last successful forward."""
    layer = mha.MultiHeadAttention(8, 2, seed=0, dtype=F64)
    x = arr(2, 3, 8, dtype=F64)
    d_out = arr(2, 3, 8, dtype=F64, seed=1)
    out, _ = layer(x, causal=True)
    expected = layer.backward(d_out)
    expected_grads = {n: g.copy() for n, g in layer.grads.items()}
    params = {n: p.copy() for n, p in layer.params.items()}
    cache = layer.new_cache(2, 4)
    layer(x[:, :2], cache=cache, causal=True)
    cache_k, cache_v, length = cache.k_rows.copy(), cache.v_rows.copy(), cache.length
    layer(x, causal=True)                         # the forward that backward must use

    failures = [
        lambda: layer(x[..., :5]),
        lambda: layer(x, arr(3, 3, 8, dtype=F64)),
        lambda: layer(x, mask=np.ones((4, 4), bool)),
        lambda: layer(x, key_padding_mask=np.ones((2, 5), bool)),
        lambda: layer(x.astype(int)),
        lambda: layer(x, cache=cache, causal=True),                  # overflow: 2 + 3 > 4
        lambda: layer(x[:1, :1], cache=cache, causal=True),          # wrong batch
        lambda: layer.backward(d_out[:, :2]),
        lambda: layer.backward(d_out.astype(int)),
    ]
    for fail in failures:
        with pytest.raises((ValueError, TypeError)):
            fail()
        assert cache.length == length
        np.testing.assert_array_equal(cache.k_rows, cache_k)
        np.testing.assert_array_equal(cache.v_rows, cache_v)
        for n in params:
            np.testing.assert_array_equal(layer.params[n], params[n])
    got = layer.backward(d_out)
    for g, e in zip(got, expected):
        np.testing.assert_array_equal(g, e)
    for n in expected_grads:
        np.testing.assert_array_equal(layer.grads[n], expected_grads[n])
    # and the cache still decodes: the next token attends over the 2 cached ones
    step, _ = layer(x[:, 2:3], cache=cache, causal=True)
    full, _ = layer(x, causal=True)
    assert_close(step, full[:, 2:3], 1e-12, "decoding after the failures")


def test_inputs_never_modified_even_on_error_paths():
    r = np.random.default_rng(6)
    q, k, v = (r.standard_normal((2, 2, 5, 4)) for _ in range(3))
    d_out = r.standard_normal((2, 2, 5, 4))
    fmask = np.where(r.random((5, 5)) < 0.7, 0.0, -np.inf)
    kpm = np.ones((2, 5), bool)
    arrays = (q, k, v, d_out, fmask, kpm)
    copies = [a.copy() for a in arrays]
    mha.attention(q, k, v, fmask, causal=True, dropout=0.3, seed=1)
    mha.attention_backward(d_out, q, k, v, fmask, causal=True, dropout=0.3, seed=1)
    for bad in (lambda: mha.attention(q, k[..., :3], v, fmask),
                lambda: mha.attention(q, k, v, fmask[:4]),
                lambda: mha.attention_backward(d_out[..., :3], q, k, v, fmask),
                lambda: mha.attention(q, k, v, fmask, dropout=2.0)):
        with pytest.raises(ValueError):
            bad()
    layer = mha.MultiHeadAttention(4, 2, seed=0, dtype=F64)
    x = q[:, 0]
    layer(x, mask=fmask, key_padding_mask=kpm)
    layer.backward(d_out[:, 0])
    for a, c in zip(arrays, copies):
        np.testing.assert_array_equal(a, c)


# regression test, finding 15: a forward that fails after drawing its dropout seed advances the layer's generator
def test_failed_training_call_does_not_advance_the_dropout_stream():
    x = arr(2, 4, 8)
    failed = mha.MultiHeadAttention(8, 2, seed=0, dropout=0.5)
    clean = mha.MultiHeadAttention(8, 2, seed=0, dropout=0.5)
    failed.head_mask = np.ones(3, F32)                    # wrong shape: the call raises
    with pytest.raises(ValueError, match="head_mask"):
        failed(x)
    failed.head_mask = np.ones(2, F32)
    np.testing.assert_array_equal(failed(x)[0], clean(x)[0])


# regression test, finding 16: an omitted key/value that cannot default (kdim or vdim differ) is reported as a W_k/W_v shape error
@pytest.mark.parametrize("ctor, given", [(dict(kdim=3), 1), (dict(vdim=5), 1),
                                         (dict(kdim=3, vdim=5), 2)])
def test_omitted_key_or_value_that_cannot_default(ctor, given):
    layer = mha.MultiHeadAttention(8, 2, seed=0, **ctor)
    args = [arr(1, 4, 8), arr(1, 6, ctor.get("kdim", 8))][:given]
    with pytest.raises(ValueError) as info:
        layer(*args)
    missing = "key" if given == 1 and "kdim" in ctor else "value"
    assert re.search(rf"\b{missing}\b", str(info.value)) and "W_" not in str(info.value), \
        f"{info.value!r} should say that `{missing}` must be passed"
