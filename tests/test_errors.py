"""Bad input, as every public function treats it: TypeError for non-float dtypes and non-arrays,
ValueError naming the argument (and both shapes for a mismatch), MemoryError rather than a
crash or an integer overflow when a buffer would not fit, and nothing modified in place.

The messages come from the one place that owns each check: the binding (csrc/module.c) for
what reaches the C core, mha.checks for the dtype policy, broadcasting, defaults and a layer's
configuration."""
import os
import re
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import mha

Q, K, V = r"\bq\b|query", r"\bk\b|key", r"\bv\b|value"


def arr(*shape, dtype=np.float32):
    return np.random.default_rng(0).standard_normal(shape).astype(dtype)


def qkv(q=(2, 5, 8), k=(2, 7, 8), v=(2, 7, 4)):
    return arr(*q), arr(*k), arr(*v)


def layer(**kw):
    kw.setdefault("seed", 0)
    return mha.MultiHeadAttention(8, 2, **kw)


def run_backward_with(d_out, **kw):
    q, k, v = qkv()
    return mha.attention_backward(d_out, q, k, v, **kw)


def layer_forward_backward(d_out):
    m = layer()
    m(arr(2, 5, 8))
    return m.backward(d_out)


def layer_with_head_mask(hm):
    m = layer()
    m.head_mask = hm
    return m(arr(2, 5, 8))


def cache_mismatch():
    m = layer()
    cache = m.new_cache(1, 8)
    return m(arr(2, 3, 8), cache=cache, causal=True)


def cache_overflow():
    m = layer()
    cache = m.new_cache(1, 4)
    m(arr(1, 3, 8), cache=cache, causal=True)
    return m(arr(1, 2, 8), cache=cache, causal=True)


def err(id, thunk, exc, names, shapes=()):
    """exc must be raised; its message must match every regex in `names` (the arguments at
    fault) and contain every shape in `shapes` as Python prints it."""
    return pytest.param(thunk, exc, names, shapes, id=id)


CASES = [
    # --- dtypes and non-arrays: TypeError naming the argument -----------------------------
    err("q-int", lambda: mha.attention(np.ones((5, 8), np.int64), arr(7, 8), arr(7, 4)),
        TypeError, [Q]),
    err("q-bool", lambda: mha.attention(np.ones((5, 8), bool), arr(7, 8), arr(7, 4)),
        TypeError, [Q]),
    err("k-complex", lambda: mha.attention(arr(5, 8), arr(7, 8).astype(complex), arr(7, 4)),
        TypeError, [K]),
    err("v-object", lambda: mha.attention(arr(5, 8), arr(7, 8), arr(7, 4).astype(object)),
        TypeError, [V]),
    err("q-list-of-str", lambda: mha.attention([["a", "b"], ["c", "d"]], arr(7, 2), arr(7, 4)),
        TypeError, [Q]),
    err("q-None", lambda: mha.attention(None, arr(7, 8), arr(7, 4)), TypeError, [Q]),
    err("k-str", lambda: mha.attention(arr(5, 8), "key", arr(7, 4)), TypeError, [K]),
    err("mask-complex", lambda: mha.attention(*qkv(), np.ones((5, 7), complex)),
        TypeError, ["mask"]),
    err("mask-str", lambda: mha.attention(*qkv(), np.full((5, 7), "x")), TypeError, ["mask"]),
    err("d_out-int", lambda: run_backward_with(np.ones((2, 5, 4), np.int32)),
        TypeError, ["d_out"]),
    err("layer-query-int", lambda: layer()(np.ones((2, 5, 8), np.int64)), TypeError, ["query"]),
    err("layer-key-complex", lambda: layer()(arr(2, 5, 8), arr(2, 5, 8).astype(complex)),
        TypeError, ["key"]),
    err("layer-d_out-int", lambda: layer_forward_backward(np.ones((2, 5, 8), np.int64)),
        TypeError, ["d_out"]),
    err("layer-dtype-int", lambda: mha.MultiHeadAttention(8, 2, dtype=np.int32),
        TypeError, ["dtype"]),

    # --- shape mismatches: ValueError naming the arguments and both shapes -------------------
    err("d_k", lambda: mha.attention(*qkv(k=(2, 7, 6))), ValueError, [Q, K],
        [(2, 5, 8), (2, 7, 6)]),
    err("n_k", lambda: mha.attention(*qkv(v=(2, 9, 4))), ValueError, [K, V],
        [(2, 7, 8), (2, 9, 4)]),
    err("batch", lambda: mha.attention(*qkv(k=(3, 7, 8), v=(3, 7, 4))), ValueError, [Q, K],
        [(2, 5, 8), (3, 7, 8)]),
    err("heads-not-divisible", lambda: mha.attention(*qkv((2, 4, 5, 8), (2, 3, 7, 8),
                                                         (2, 3, 7, 4))),
        ValueError, [Q, K], [(2, 4, 5, 8), (2, 3, 7, 8)]),
    err("kv-heads-differ", lambda: mha.attention(*qkv((2, 4, 5, 8), (2, 2, 7, 8),
                                                     (2, 1, 7, 4))),
        ValueError, [K, V], [(2, 2, 7, 8), (2, 1, 7, 4)]),
    err("rank-mismatch", lambda: mha.attention(*qkv((5, 8), (1, 7, 8), (1, 7, 4))),
        ValueError, [Q, K], [(5, 8), (1, 7, 8)]),
    err("rank-1", lambda: mha.attention(arr(8), arr(8), arr(8)), ValueError, [Q], [(8,)]),
    err("rank-5", lambda: mha.attention(*qkv((1, 1, 1, 5, 8), (1, 1, 1, 7, 8),
                                            (1, 1, 1, 7, 4))),
        ValueError, [Q], [(1, 1, 1, 5, 8)]),
    err("mask-shape", lambda: mha.attention(*qkv(), np.ones((6, 7), bool)), ValueError,
        ["mask"], [(6, 7)]),
    err("mask-rank-5", lambda: mha.attention(*qkv(), np.ones((1, 1, 2, 5, 7), bool)),
        ValueError, ["mask"], [(1, 1, 2, 5, 7)]),
    err("mask-batch", lambda: mha.attention(*qkv(), np.ones((3, 5, 7), bool)), ValueError,
        ["mask"], [(3, 5, 7)]),
    err("d_out-shape", lambda: run_backward_with(arr(2, 5, 5)), ValueError, ["d_out"],
        [(2, 5, 5), (2, 5, 4)]),
    err("backward-mask-shape", lambda: mha.attention_backward(arr(2, 5, 4), *qkv(),
                                                              np.ones((5, 8), bool)),
        ValueError, ["mask"], [(5, 8)]),

    # --- other arguments ------------------------------------------------------------------------
    err("dropout-negative", lambda: mha.attention(*qkv(), dropout=-0.1, seed=1), ValueError,
        ["dropout"]),
    err("dropout-one", lambda: mha.attention(*qkv(), dropout=1.0, seed=1), ValueError,
        ["dropout"]),
    err("dropout-above-one", lambda: mha.attention(*qkv(), dropout=1.5, seed=1), ValueError,
        ["dropout"]),
    err("dropout-nan", lambda: mha.attention(*qkv(), dropout=float("nan"), seed=1), ValueError,
        ["dropout"]),
    err("seed-negative", lambda: mha.attention(*qkv(), dropout=0.1, seed=-1), ValueError,
        ["seed"]),
    err("seed-2**64", lambda: mha.attention(*qkv(), dropout=0.1, seed=2**64), ValueError,
        ["seed"]),
    err("backward-dropout-without-seed", lambda: run_backward_with(arr(2, 5, 4), dropout=0.2),
        ValueError, ["seed"]),

    # --- the layer ------------------------------------------------------------------------------
    err("layer-n_kv_heads", lambda: mha.MultiHeadAttention(8, 4, n_kv_heads=3), ValueError,
        ["n_kv_heads"]),
    err("layer-d_model-0", lambda: mha.MultiHeadAttention(0, 2), ValueError, ["d_model"]),
    err("layer-n_heads-0", lambda: mha.MultiHeadAttention(8, 0), ValueError, ["n_heads"]),
    err("layer-d_head-0", lambda: mha.MultiHeadAttention(8, 2, d_head=0), ValueError,
        ["d_head"]),
    err("layer-dropout-one", lambda: mha.MultiHeadAttention(8, 2, dropout=1.0), ValueError,
        ["dropout"]),
    err("layer-dropout-negative", lambda: mha.MultiHeadAttention(8, 2, dropout=-0.5),
        ValueError, ["dropout"]),
    err("layer-query-width", lambda: layer()(arr(2, 5, 7)), ValueError, ["query"], [(2, 5, 7)]),
    err("layer-query-rank-1", lambda: layer()(arr(8)), ValueError, ["query"], [(8,)]),
    err("layer-query-rank-4", lambda: layer()(arr(1, 2, 5, 8)), ValueError, ["query"],
        [(1, 2, 5, 8)]),
    err("layer-key-width", lambda: layer(kdim=5)(arr(2, 5, 8), arr(2, 6, 4), arr(2, 6, 8)), ValueError,
        ["key"], [(2, 6, 4)]),
    err("layer-value-width", lambda: layer(vdim=3)(arr(2, 5, 8), arr(2, 6, 8), arr(2, 6, 4)),
        ValueError, ["value"], [(2, 6, 4)]),
    err("layer-key-value-n_k", lambda: layer()(arr(2, 5, 8), arr(2, 6, 8), arr(2, 4, 8)),
        ValueError, ["value"], [(2, 6, 8), (2, 4, 8)]),
    err("layer-batch", lambda: layer()(arr(2, 5, 8), arr(3, 6, 8)), ValueError, ["key"],
        [(2, 5, 8), (3, 6, 8)]),
    err("layer-key_padding_mask", lambda: layer()(arr(2, 5, 8),
                                                  key_padding_mask=np.ones((2, 4), bool)),
        ValueError, ["key_padding_mask"], [(2, 4)]),
    err("layer-key_padding_mask-batch", lambda: layer()(arr(2, 5, 8),
                                                        key_padding_mask=np.ones((3, 5), bool)),
        ValueError, ["key_padding_mask"], [(3, 5)]),
    err("layer-mask", lambda: layer()(arr(2, 5, 8), mask=np.ones((6, 6), bool)), ValueError,
        ["mask"], [(6, 6)]),
    err("layer-d_out-shape", lambda: layer_forward_backward(arr(2, 5, 7)), ValueError,
        ["d_out"], [(2, 5, 7), (2, 5, 8)]),
    err("layer-head_mask-shape", lambda: layer_with_head_mask(np.ones(3, np.float32)),
        ValueError, ["head_mask"], [(3,)]),
    err("layer-backward-before-forward", lambda: layer().backward(arr(2, 5, 8)),
        (RuntimeError, ValueError), ["forward"]),
    err("layer-cache-batch", cache_mismatch, ValueError, ["cache"]),
    err("layer-cache-overflow", cache_overflow, ValueError, ["cache"]),
    err("layer-prune-grouped", lambda: mha.MultiHeadAttention(8, 4, n_kv_heads=2).prune_heads([0]),
        ValueError, [r"n_kv_heads|grouped"]),
    err("layer-prune-out-of-range", lambda: layer().prune_heads([5]), ValueError,
        [r"\b5\b"]),
]


@pytest.mark.parametrize("thunk, exc, names, shapes", CASES)
def test_bad_input(thunk, exc, names, shapes):
    with pytest.raises(exc, match=names[0]) as info:
        thunk()
    msg = str(info.value)
    for pattern in names[1:]:
        assert re.search(pattern, msg), f"message {msg!r} does not name {pattern!r}"
    for shape in shapes:
        assert str(tuple(shape)) in msg, f"message {msg!r} does not give the shape {shape}"


def test_bad_input_leaves_arguments_untouched():
    q, k, v = qkv()
    d_out = arr(2, 5, 5)
    mask = np.ones((6, 7), bool)
    args = (q, k, v, d_out, mask)
    copies = [a.copy() for a in args]
    with pytest.raises(ValueError):
        mha.attention(q, k, v, mask)
    with pytest.raises(ValueError):
        mha.attention_backward(d_out, q, k, v)
    with pytest.raises(ValueError):
        mha.attention(q, k[:, :, :6], v)
    for a, c in zip(args, copies):
        np.testing.assert_array_equal(a, c)


def test_error_leaves_layer_usable():
    m = layer(dtype=np.float64)
    x = arr(2, 5, 8, dtype=np.float64)
    out, _ = m(x)
    params = {n: p.copy() for n, p in m.params.items()}
    with pytest.raises(ValueError):
        m(arr(2, 5, 7))
    out2, _ = m(x)
    np.testing.assert_array_equal(out, out2)
    for n in params:
        np.testing.assert_array_equal(m.params[n], params[n])
    m.backward(np.ones((2, 5, 8)))


# --- MemoryError, never a crash or an overflow ---------------------------------------------

HUGE = {
    # a (2**22, 4) broadcast view: the inputs are small, the (2**22, 2**22) weights are 64 TiB
    "weights-too-big": """
        q = np.broadcast_to(np.ones((1, 4), np.float32), (2**22, 4))
        mha.attention(q, q, q, need_weights=True)
    """,
    # B*H*n_q*n_k = 2**64 elements: the size computation itself overflows int64
    "size-overflows-int64": """
        q = np.broadcast_to(np.ones((1, 1, 1, 1), np.float32), (2**16, 2**16, 2**16, 1))
        mha.attention(q, q, q, need_weights=True)
    """,
    "layer-weights-too-big": """
        layer = mha.MultiHeadAttention(8, 2, seed=0)
        x = np.broadcast_to(np.ones((1, 1, 8), np.float32), (1, 2**22, 8))
        layer(x, need_weights=True)
    """,
    "cache-too-big": """
        layer = mha.MultiHeadAttention(8, 2, seed=0)
        layer.new_cache(2**31, 2**31)
    """,
}


@pytest.mark.parametrize("name", sorted(HUGE))
def test_huge_sizes_raise_memory_error(name):
    """Run in a child process with its address space capped at 4 GiB, so that neither a crash
    nor a real giant allocation can take the test run (or the machine) down."""
    script = textwrap.dedent("""
        import resource, time
        resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))
        import numpy as np
        import mha
        t0 = time.perf_counter()
        try:
        {body}
        except MemoryError as e:
            print("MemoryError", round(time.perf_counter() - t0, 3), str(e)[:200])
        except BaseException as e:
            print("OTHER", type(e).__name__, str(e)[:300])
        else:
            print("NO ERROR")
    """).format(body=textwrap.indent(textwrap.dedent(HUGE[name]).strip(), "    "))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    here = os.path.dirname(os.path.abspath(__file__))  # not the checkout: import the installed mha
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120, cwd=here, env=env)
    assert proc.returncode == 0, (
        f"child crashed (return code {proc.returncode}): {proc.stderr[-2000:]}")
    line = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    assert line.startswith("MemoryError"), f"expected MemoryError, got: {line!r} {proc.stderr[-500:]}"
    assert float(line.split()[1]) < 10.0, f"MemoryError came slowly: {line}"
