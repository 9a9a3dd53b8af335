"""Fuzz target for mha's binding (mha._C) and the public functions above it (issue 3).

Every input (a byte string) decodes into one call: mha._C.attention_forward / attention_backward /
layer_forward / layer_backward / matmul / dropout_uniform, mha.attention / attention_backward, or
a MultiHeadAttention built, called (maybe with a KV cache) and differentiated. Most inputs start
as a coherent problem and then get 0-3 mutations: another dtype (float16/32/64, bool, int,
complex, object, byte-swapped), another rank or size (0, 1, huge-with-a-zero), a non-array, an
argument dropped or added, a strange scalar (NaN, -1, 2**63, a string), or another memory layout.

The oracle, beyond "the interpreter survives":
  - only TypeError / ValueError / MemoryError (+ OverflowError from _C's argument parsing,
    RuntimeError from a layer used out of order) may escape;
  - inputs are never modified;
  - a layout mutation (Fortran, strided, negative strides, read-only, byte-swapped, broadcast,
    unaligned) gives the same result as the contiguous call;
  - a public call on finite values matches mha.reference (coarse tolerance);
  - a failing KV-cache step leaves the cache as it was.
A violation raises FuzzFinding (a crash for atheris; a reported failure for the other engines).

Inputs that would only rediscover an open finding (the hardening report's numbers, listed in
OPEN_FINDINGS) are skipped, so a long run looks for new ones; --include-known runs them too.

Engines:
  python tests/fuzz/fuzz_binding.py --engine random --seconds 600     # no dependencies
  python tests/fuzz/fuzz_binding.py --engine atheris -max_total_time=600   # pip install atheris
  python tests/fuzz/fuzz_binding.py --replay FILE                      # rerun one input
tests/fuzz/run_fuzz.sh wraps these (nice, optional ASan build, crash collection).
"""
import argparse
import math
import operator
import os
import random
import resource
import signal
import sys
import time
import traceback

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from memory_layouts import LAYOUTS, relayout  # noqa: E402  (tests/memory_layouts.py)

if __name__ == "__main__" and "--engine" in sys.argv and "atheris" in sys.argv:
    import atheris  # noqa: F401  (instrument mha's Python layers for coverage feedback)
    with atheris.instrument_imports(include=["mha"]):
        import mha
        import mha.reference as ref
        from mha import _C
else:
    import mha
    import mha.reference as ref
    from mha import _C


class FuzzFinding(AssertionError):
    pass


INCLUDE_KNOWN = False
STATS = {"inputs": 0, "ok": 0, "raised": 0, "skipped_known": 0, "compared": 0}


class Known(Exception):
    """An input that would only rediscover an open finding."""


# Findings still open: inputs that would only rediscover them are skipped. Findings 1-11 and
# 13-16 were fixed in b2f09b5; their guards below stay as documentation and run again.
OPEN_FINDINGS = set()


def known(number, condition):
    if condition and number in OPEN_FINDINGS and not INCLUDE_KNOWN:
        raise Known(number)


# --- decoding bytes ---------------------------------------------------------------------------

class Source:
    """Deterministic choices from a byte string (zeros once it runs out)."""

    def __init__(self, data):
        self.data, self.pos = data, 0

    def byte(self):
        if self.pos >= len(self.data):
            return 0
        self.pos += 1
        return self.data[self.pos - 1]

    def int(self, lo, hi):
        n = hi - lo + 1
        if n <= 1:
            return lo
        value, span = 0, 1
        while span < n:
            value, span = (value << 8) | self.byte(), span << 8
        return lo + value % n

    def choice(self, seq):
        return seq[self.int(0, len(seq) - 1)]

    def chance(self, percent):
        return self.int(0, 99) < percent

    def seed(self):
        return self.int(0, 2**32 - 1)


DIMS = [0, 1, 1, 2, 3, 3, 4, 5, 7, 8, 9, 16, 17, 33, 64, 65]
ODD_SCALARS = [None, 0, -1, 1, 2**31, 2**63 - 1, 2**63, 2**64, -2**63, 0.5, float("nan"),
               float("inf"), -0.0, "x", b"x", [], [1, 2], (), object(), True, np.float32(2.0),
               np.array(3), np.ones(2), 1j]
ODD_OBJECTS = [None, 0, 1.5, "q", [], [[1.0, 2.0], [3.0]], [[1.0, 2.0]], object(), np.float64(1.0),
               np.array(1.0), np.ones((2, 2), complex), np.ones((2, 2), object),
               np.ones((2, 2), "M8[s]"), np.ones((2, 2), np.int32), np.ones((2, 2), bool),
               np.ones((2, 2), np.float16), np.ones((2, 2), np.longdouble)]
def is_known_unaligned_error(e):
    return isinstance(e, ValueError) and "aligned" in str(e)


# --- coherent problems ------------------------------------------------------------------------

def attention_problem(src):
    rank = src.choice([2, 3, 4, 4])
    B, H_kv = src.choice([1, 1, 2, 3]), src.choice([1, 1, 2])
    H = H_kv * src.choice([1, 1, 2, 3])
    n_q, n_k = src.choice(DIMS[1:]), src.choice(DIMS[1:])
    d_k, d_v = src.choice(DIMS[1:12]), src.choice(DIMS[1:12])
    lead_q = {2: (), 3: (B,), 4: (B, H)}[rank]
    lead_kv = {2: (), 3: (B,), 4: (B, H_kv)}[rank]
    dtype = src.choice([np.float32, np.float64])
    r = np.random.default_rng(src.seed())
    q = r.standard_normal(lead_q + (n_q, d_k)).astype(dtype)
    k = r.standard_normal(lead_kv + (n_k, d_k)).astype(dtype)
    v = r.standard_normal(lead_kv + (n_k, d_v)).astype(dtype)
    d_out = r.standard_normal(lead_q + (n_q, d_v)).astype(dtype)
    special = src.chance(15)
    if special:                    # NaN / Inf somewhere: no reference comparison, no crash
        target = src.choice([q, k, v, d_out])
        if target.size:
            target.flat[src.int(0, target.size - 1)] = src.choice([np.nan, np.inf, -np.inf])
    mask = None
    kind = src.choice([None, None, "bool", "float", "int"])
    if kind:
        shape = lead_q + (n_q, n_k)
        shape = tuple(1 if src.chance(30) else s for s in shape[src.int(0, len(shape) - 1):])
        if kind == "float":
            mask = np.where(r.random(shape) < 0.2, -np.inf, r.standard_normal(shape)).astype(
                src.choice([dtype, np.float32, np.float64]))
        else:
            mask = r.random(shape) < src.choice([0.0, 0.5, 0.9, 1.0])
            if kind == "int":
                mask = mask.astype(np.int8)
    kw = dict(causal=src.chance(40), scale=src.choice([None, None, 0.5, 0.0, -1.0]),
              dropout=src.choice([0.0, 0.0, 0.0, 0.3, 0.9]))
    kw["seed"] = src.int(0, 2**64 - 1) if kw["dropout"] else None
    return dict(q=q, k=k, v=v, d_out=d_out, mask=mask, kw=kw, special=special,
                need_weights=src.chance(70))


def mutate_array(src, a):
    """A wrong version of array `a`: dtype, rank, size, or not an array at all."""
    if not isinstance(a, np.ndarray) or a.dtype == object:
        return src.choice(ODD_OBJECTS)
    how = src.choice(["dtype", "rank", "dim", "dim0", "object", "huge0"])
    if how == "dtype":
        return np.zeros(a.shape, src.choice([np.int32, np.int64, bool, np.complex64, object,
                                             np.float16, np.uint8, ">f4", ">f8"]))
    if how == "rank":
        return a[None] if src.chance(50) or a.ndim == 0 else a[0] if a.shape[0] else a.reshape(-1)
    if how in ("dim", "dim0"):
        if a.ndim == 0:
            return a
        axis = src.int(0, a.ndim - 1)
        shape = list(a.shape)
        shape[axis] = 0 if how == "dim0" else max(0, shape[axis] + src.choice([-1, 1, 2]))
        if math.prod(shape) > 2**20:              # keep the fuzzer's own arrays small
            shape[axis] = 0
        return np.zeros(shape, a.dtype)
    if how == "huge0":             # zero bytes, but huge axes (kept small enough not to hang)
        return np.zeros((2**10,) * max(0, a.ndim - 1) + (0,), a.dtype) if a.ndim else a
    return src.choice(ODD_OBJECTS)


def arrays_unchanged(snapshot):
    for a, copy in snapshot:
        try:
            same = np.array_equal(a, copy, equal_nan=a.dtype.kind in "fc")
        except TypeError:
            same = np.array_equal(a, copy)
        if not same:
            raise FuzzFinding(f"an input of shape {a.shape} and dtype {a.dtype} was modified")


def snapshot(values):
    return [(a, a.copy()) for a in values if isinstance(a, np.ndarray) and a.dtype != object]


def check_close(got, want, what):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if got.shape != want.shape:
        raise FuzzFinding(f"{what}: shape {got.shape} vs reference {want.shape}")
    finite = np.isfinite(want)
    if not np.array_equal(np.isnan(got), np.isnan(want)):
        raise FuzzFinding(f"{what}: NaN positions differ from the reference")
    if finite.any():
        err = np.abs(got[finite] - want[finite]).max()
        scale = max(np.abs(want[finite]).max(), 1.0)
        if err > 1e-3 * scale:
            raise FuzzFinding(f"{what}: max error {err:.3e} vs reference (scale {scale:.3e})")


def same_bits(a, b, what):
    for x, y in zip(a if isinstance(a, tuple) else (a,), b if isinstance(b, tuple) else (b,)):
        if (x is None) != (y is None):
            raise FuzzFinding(f"{what}: None vs array")
        if x is not None and not (x.shape == y.shape and x.dtype == y.dtype and
                                  np.array_equal(x, y, equal_nan=True)):
            raise FuzzFinding(f"{what}: results differ from the contiguous call")


# --- targets ----------------------------------------------------------------------------------

def target_public_attention(src):
    p = attention_problem(src)
    backward = src.chance(50)
    args = [p["q"], p["k"], p["v"]]
    if backward:
        args = [p["d_out"]] + args
    kw = dict(p["kw"])
    if not backward:
        kw["need_weights"] = p["need_weights"]
    mask = p["mask"]
    fn = mha.attention_backward if backward else mha.attention
    # the contiguous call first (the baseline of layout mutations)
    d_k = p["q"].shape[-1]
    mutations = src.int(0, 3) if src.chance(60) else 0
    layout_only = src.chance(40)
    call_args, call_mask, call_kw = list(args), mask, dict(kw)
    for _ in range(mutations):
        what = src.int(0, len(call_args) + 1)
        if layout_only:
            if what < len(call_args):
                call_args[what] = relayout(call_args[what], src.choice(LAYOUTS))
            elif call_mask is not None:
                call_mask = relayout(call_mask, src.choice(LAYOUTS))
        elif what < len(call_args):
            call_args[what] = mutate_array(src, call_args[what])
        elif what == len(call_args):
            call_mask = src.choice([mutate_array(src, mask if mask is not None else p["q"]),
                                    src.choice(ODD_OBJECTS)])
        else:
            name = src.choice(["causal", "scale", "dropout", "seed", "need_weights", "bogus"])
            call_kw[name] = src.choice(ODD_SCALARS)
    known(10, any(isinstance(a, np.ndarray) and a.ndim >= 2 and a.shape[-1] == 0
                  for a in call_args[-3:-1]) and call_kw.get("scale") is None)
    known(7, any(isinstance(a, np.ndarray) and a.size == 0 and
                 math.prod(s for s in a.shape if s) > 2**20 for a in call_args))
    before = snapshot(call_args + [call_mask])
    try:
        result = fn(*call_args, call_mask, **call_kw)
    except (TypeError, ValueError, MemoryError) as e:
        arrays_unchanged(before)
        if mutations and layout_only:
            known(8, is_known_unaligned_error(e))
        if mutations == 0 or layout_only:
            raise FuzzFinding(f"a valid call raised {type(e).__name__}: {e}") from e
        STATS["raised"] += 1
        return
    arrays_unchanged(before)
    STATS["ok"] += 1
    if mutations and layout_only:
        same_bits(result, fn(*args, mask, **kw), "layout mutation")
    if mutations and not layout_only:
        return
    if p["special"]:
        return
    # against the reference, in float64 on the same values
    r64 = [a.astype(np.float64) for a in args]
    m64 = mask
    if mask is not None and mask.dtype.kind == "f":
        m64 = mask.astype(p["q"].dtype).astype(np.float64)
    rkw = {k_: v_ for k_, v_ in kw.items() if k_ != "need_weights"}
    want = (ref.attention_backward if backward else ref.attention)(*r64, m64, **rkw)
    STATS["compared"] += 1
    for i, (g, w) in enumerate(zip(result, want)):
        if g is None:
            continue
        check_close(g, w, f"{fn.__name__} result {i}")


def raw_array(src, shape, dtype):
    return np.random.default_rng(src.seed()).standard_normal(shape).astype(dtype)


def target_binding_attention(src):
    dtype = src.choice([np.float32, np.float64])
    B, H_kv = src.choice([0, 1, 2]), src.choice([0, 1, 1, 2])
    H = H_kv * src.choice([0, 1, 2]) if H_kv else src.choice([0, 0, 1])
    n_q, n_k, d_k, d_v = (src.choice(DIMS) for _ in range(4))
    q = raw_array(src, (B, H, n_q, d_k), dtype)
    k = raw_array(src, (B, H_kv, n_k, d_k), dtype)
    v = raw_array(src, (B, H_kv, n_k, d_v), dtype)
    d_out = raw_array(src, (B, H, n_q, d_v), dtype)
    mask = None
    if src.chance(40):
        base = np.random.default_rng(src.seed()).random((1,) * 4) < 0.5 if src.chance(50) else \
            np.zeros((1, 1, 1, 1), dtype)
        mask = np.broadcast_to(base, (B, H, n_q, n_k)) if src.chance(70) else \
            np.ascontiguousarray(np.broadcast_to(base, (B, H, n_q, n_k)))
    kpm = np.ones((B, n_k), bool) if src.chance(20) else None
    args = [q, k, v, mask, kpm, src.chance(40), src.choice([0.5, 1.0, float("nan"), 0.0]),
            src.choice([0.0, 0.0, 0.5, 0.99]), src.int(0, 2**64 - 1)]
    backward = src.chance(50)
    if backward:
        args = [d_out] + args
    else:
        args.append(src.chance(60))
    n_fixed = 4 if backward else 3
    for _ in range(src.int(0, 3)):
        i = src.int(0, len(args) - 1)
        if i < n_fixed + 2:
            args[i] = mutate_array(src, args[i]) if isinstance(args[i], np.ndarray) else \
                src.choice(ODD_OBJECTS)
        else:
            args[i] = src.choice(ODD_SCALARS)
    if src.chance(10):
        args = args[:src.int(0, len(args))]
    arrays = [a for a in args[:n_fixed] if isinstance(a, np.ndarray)]
    known(1, len(args) < n_fixed + 4)                           # scale omitted
    known(2, backward and any(isinstance(a, np.ndarray) and a.ndim == 4 and a.shape[1] == 0
                              for a in args[n_fixed - 2:n_fixed]))  # k or v with 0 heads
    known(7, any(a.size == 0 and math.prod(s for s in a.shape if s) > 2**20 for a in arrays))
    call(_C.attention_backward if backward else _C.attention_forward, args)


def as_index(value):
    """The integer PyArg_ParseTuple's "n" would read from `value`, or None."""
    try:
        return operator.index(value)
    except TypeError:
        return None


def target_binding_layer(src):
    dtype = src.choice([np.float32, np.float64])
    heads, kv_heads = src.choice([1, 2, 4]), src.choice([1, 2])
    if heads % kv_heads:
        kv_heads = 1
    d_head, d_model, kdim, vdim = (src.choice([1, 2, 3, 4, 8]) for _ in range(4))
    B, n_q, n_new = src.choice([0, 1, 2]), src.choice(DIMS), src.choice(DIMS)
    E_q, E_kv = heads * d_head, kv_heads * d_head
    r = np.random.default_rng(src.seed())

    def a(*shape):
        return r.standard_normal(shape).astype(dtype)

    params = dict(W_q=a(d_model, E_q), W_k=a(kdim, E_kv), W_v=a(vdim, E_kv), W_o=a(E_q, d_model),
                  b_q=a(E_q) if src.chance(50) else None, b_k=a(E_kv), b_v=a(E_kv), b_o=a(d_model),
                  head_mask=a(heads) if src.chance(30) else None)
    xq, xk, xv = a(B, n_q, d_model), a(B, n_new, kdim), a(B, n_new, vdim)
    backward = src.chance(40)
    sizes = [heads, kv_heads, d_head]
    if src.chance(20):
        sizes[src.int(0, 2)] = src.choice([0, -1, 3, 2**31, 2**40, 2**62, 2**63 - 1])
    if backward:
        # the backward replays a forward's context: a well-formed forward first, then the
        # fuzzed gradient (the context is opaque, so d_out is all the backward reads from Python)
        try:
            _, _, context = _C.layer_forward(xq, xk, xv, params, heads, kv_heads, d_head,
                                             causal=src.chance(40), dropout=src.choice([0.0, 0.3]),
                                             seed=src.int(0, 2**64 - 1))
        except (TypeError, ValueError, MemoryError, OverflowError):
            return
        d_out = a(B, n_q, d_model)
        if src.chance(60):
            d_out = mutate_array(src, d_out) if src.chance(80) else src.choice(ODD_SCALARS)
        call(_C.layer_backward, [d_out, context])
        return
    cache = src.chance(40)
    max_len = n_new + src.choice([0, 1, 5])
    length = src.choice([0, 0, max_len - n_new, max_len - n_new + 1, -1, 2**62, 2**63 - 1])
    kc = np.zeros((B, max_len, E_kv), dtype) if cache else None
    vc = np.zeros((B, max_len, E_kv), dtype) if cache else None
    args = [xq, xk, xv, params] + sizes + [None, None, src.chance(40), src.choice([0.0, 0.3]),
                                           src.int(0, 2**64 - 1), src.chance(50), kc, vc, length]
    n_arrays = 3
    for _ in range(src.int(0, 3)):
        i = src.int(0, len(args) - 1)
        if isinstance(args[i], dict):                            # params: one entry
            entries = dict(args[i])
            name = src.choice(sorted(entries))
            value = entries[name]
            entries[name] = mutate_array(src, value) if isinstance(value, np.ndarray) else src.choice(ODD_OBJECTS)
            args[i] = entries if src.chance(90) else list(entries.values())
        elif i < n_arrays:
            args[i] = mutate_array(src, args[i])
        else:
            args[i] = src.choice(ODD_SCALARS + [relayout(xq, "readonly")])
    h, kvh, dh = (as_index(s) for s in args[n_arrays + 1:n_arrays + 4])
    if None not in (h, kvh, dh):                                  # the products overflow int64
        known(3, h * dh >= 2**63 or kvh * dh >= 2**63)
    length_arg, new_rows = args[-1], getattr(args[1], "shape", (0, 0))
    known(4, as_index(length_arg) is not None and len(new_rows) > 1 and
          as_index(length_arg) + new_rows[1] >= 2**63)
    known(5, any(isinstance(c, np.ndarray) and not c.flags.writeable for c in args[-3:-1]))
    call(_C.layer_forward, args)


def target_binding_small(src):
    which = src.choice(["matmul", "dropout_uniform", "threads"])
    if which == "matmul":
        dtype = src.choice([np.float32, np.float64])
        M, K, N = src.choice(DIMS), src.choice(DIMS), src.choice(DIMS)
        a = raw_array(src, (M, K), dtype)
        b = raw_array(src, (K, N), dtype)
        ta, tb = src.chance(50), src.chance(50)
        if ta:
            a = np.ascontiguousarray(a.T)
        if tb:
            b = np.ascontiguousarray(b.T)
        args = [a, b, ta, tb]
        mutated = src.chance(50)
        if mutated:
            i = src.int(0, 3)
            args[i] = mutate_array(src, args[i]) if i < 2 else src.choice(ODD_SCALARS)
        result = call(_C.matmul, args)
        if result is not None and not mutated:
            want = (a.T if ta else a).astype(np.float64) @ (b.T if tb else b).astype(np.float64)
            check_close(result, want, "matmul")
    elif which == "dropout_uniform":
        args = [src.choice([0, 1, 2**64 - 1, -1, 2**64, 1.5, "x"]) for _ in range(5)]
        u = call(_C.dropout_uniform, args)
        if u is not None and not 0.0 <= u < 1.0:
            raise FuzzFinding(f"dropout_uniform returned {u}")
    else:
        n = src.choice([1, 2, 3, 0, -1, 4097, "2", 2.0, None])
        old = _C.get_num_threads()
        try:
            call(_C.set_num_threads, [n], allowed=(TypeError, ValueError, OverflowError))
        finally:
            _C.set_num_threads(old)


def call(fn, args, allowed=(TypeError, ValueError, MemoryError, OverflowError)):
    # the arrays of the arguments, and those inside the layer's params and saved dicts
    arrays = [a for arg in args for a in (arg.values() if isinstance(arg, dict) else [arg])
              if isinstance(a, np.ndarray)]
    before = snapshot([a for a in arrays if a.flags.writeable] + [a for a in arrays if not a.flags.writeable])
    cache_arrays = [id(a) for a in args[-3:-1]] if fn is _C.layer_forward else []
    before = [(a, c) for a, c in before if id(a) not in cache_arrays]
    try:
        result = fn(*args)
    except allowed:
        STATS["raised"] += 1
        arrays_unchanged(before)
        return None
    arrays_unchanged(before)
    STATS["ok"] += 1
    return result


def target_layer(src):
    ctor = dict(d_model=src.choice([1, 4, 6, 8]), n_heads=src.choice([1, 2]))
    if src.chance(30):
        ctor["n_kv_heads"] = src.choice([1, 2])
    if src.chance(30):
        ctor["d_head"] = src.choice([1, 3])
    for name in ("kdim", "vdim"):
        if src.chance(20):
            ctor[name] = src.choice([1, 5])
    ctor["bias"] = src.chance(70)
    ctor["dropout"] = src.choice([0.0, 0.0, 0.3])
    ctor["dtype"] = src.choice([np.float32, np.float64])
    ctor["seed"] = src.seed()
    if src.chance(15):
        ctor[src.choice(list(ctor) + ["bogus"])] = src.choice(ODD_SCALARS)
    try:
        layer = mha.MultiHeadAttention(**ctor)
        twin = mha.reference.MultiHeadAttention(**ctor)
    except (TypeError, ValueError, MemoryError):
        STATS["raised"] += 1
        return
    # the same parameters and dropout stream even when the seed argument was mutated away
    twin.params = {name: p.copy() for name, p in layer.params.items()}
    twin._rng.bit_generator.state = layer._rng.bit_generator.state
    if src.chance(50):
        layer.eval()
        twin.eval()
    r = np.random.default_rng(src.seed())
    B, n_q, n_k = src.choice([1, 2]), src.choice(DIMS[1:]), src.choice(DIMS[1:])
    dt = layer.dtype
    query = r.standard_normal((B, n_q, layer.d_model)).astype(dt)
    key = r.standard_normal((B, n_k, layer.kdim)).astype(dt) if src.chance(40) else None
    value = r.standard_normal((B, n_k, layer.vdim)).astype(dt) if key is not None and \
        src.chance(50) else None
    if key is None and (layer.kdim != layer.d_model or layer.vdim != layer.d_model):
        key = r.standard_normal((B, n_k, layer.kdim)).astype(dt)     # (finding 16 otherwise)
    if key is not None and value is None and layer.kdim != layer.vdim:
        value = r.standard_normal((B, n_k, layer.vdim)).astype(dt)
    kw = dict(causal=src.chance(40), need_weights=src.chance(70))
    if src.chance(30):
        kpm = r.random((B, key.shape[1] if key is not None else n_q)) < 0.8
        kw["key_padding_mask"] = kpm
    inputs = [query, key, value]
    mutated = src.chance(40)
    if mutated:
        i = src.int(0, 3)
        if i < 3 and inputs[i] is not None:
            inputs[i] = mutate_array(src, inputs[i]) if src.chance(60) else \
                relayout(inputs[i], src.choice(LAYOUTS))
        else:
            kw[src.choice(["mask", "key_padding_mask", "causal", "average_weights", "cache"])] = \
                src.choice(ODD_OBJECTS + ODD_SCALARS)
    before = snapshot(inputs + list(kw.values()))
    try:
        out, w = layer(*inputs, **kw)
    except (TypeError, ValueError, MemoryError) as e:
        if not mutated:
            raise FuzzFinding(f"a valid layer call raised {type(e).__name__}: {e}") from e
        known(8, is_known_unaligned_error(e))
        STATS["raised"] += 1
        arrays_unchanged(before)
        return
    arrays_unchanged(before)
    STATS["ok"] += 1
    d_out = r.standard_normal(out.shape).astype(dt)
    if src.chance(20):
        d_out = mutate_array(src, d_out)
    try:
        grads = layer.backward(d_out)
    except (TypeError, ValueError, MemoryError, RuntimeError):
        STATS["raised"] += 1
        return
    if mutated:
        return
    twin_out, twin_w = twin(*inputs, **kw)
    check_close(out, twin_out, "layer out")
    if w is not None:
        check_close(w, twin_w, "layer weights")
    twin_grads = twin.backward(d_out)
    STATS["compared"] += 1
    for name, g, t in zip(("d_query", "d_key", "d_value"), grads, twin_grads):
        if (g is None) != (t is None):
            raise FuzzFinding(f"{name}: None vs array")
        if g is not None:
            check_close(g, t, name)
    # a KV cache: chunks, some overflowing; a failed step leaves the cache as it was
    if layer.training or layer.kdim != layer.d_model or layer.vdim != layer.d_model or src.chance(50):
        return
    cache = layer.new_cache(B, src.choice([1, 3, 8, 20]))
    for _ in range(src.int(1, 4)):
        n = src.choice([0, 1, 2, 5, 9])
        x = r.standard_normal((B, n, layer.d_model)).astype(dt)
        k_rows, v_rows, length = cache.k_rows.copy(), cache.v_rows.copy(), cache.length
        try:
            layer(x, cache=cache, causal=True)
        except ValueError:
            if length + n <= cache.max_len:
                raise FuzzFinding("a cache step that fits raised")
            if cache.length != length or not (np.array_equal(cache.k_rows, k_rows) and
                                              np.array_equal(cache.v_rows, v_rows)):
                raise FuzzFinding("a failed cache step changed the cache")
            continue
        if cache.length != length + n:
            raise FuzzFinding("the cache length did not advance by the step")


TARGETS = [target_public_attention, target_public_attention, target_binding_attention,
           target_binding_layer, target_binding_small, target_layer]


def one_input(data):
    src = Source(data)
    STATS["inputs"] += 1
    target = TARGETS[src.int(0, len(TARGETS) - 1)]
    try:
        target(src)
    except Known as k:
        STATS["skipped_known"] += 1
        STATS[f"known_{k.args[0]}"] = STATS.get(f"known_{k.args[0]}", 0) + 1


# --- engines ----------------------------------------------------------------------------------

def limit_memory(gib):
    """Caps the address space (0: no cap; a sanitizer build reserves terabytes of shadow
    memory, so there the allocator's own limit, max_allocation_size_mb, is used instead)."""
    if gib > 0:
        resource.setrlimit(resource.RLIMIT_AS, (gib << 30, gib << 30))


def run_random(seconds, seed, out_dir, max_len=512):
    """Random byte strings; each input is written to out_dir/current.bin before it runs, so a
    crash (the process dies) leaves its reproduction behind."""
    os.makedirs(out_dir, exist_ok=True)
    rng = random.Random(seed)
    current = os.path.join(out_dir, "current.bin")
    t0, last = time.monotonic(), time.monotonic()
    n = 0
    while time.monotonic() - t0 < seconds:
        data = bytes(rng.getrandbits(8) for _ in range(rng.randint(0, max_len)))
        with open(current, "wb") as f:
            f.write(data)
        signal.alarm(30)                       # a hang kills the process (SIGALRM)
        try:
            one_input(data)
        except Exception:                      # FuzzFinding, or an unexpected exception type
            path = os.path.join(out_dir, f"finding-{seed}-{n}.bin")
            with open(path, "wb") as f:
                f.write(data)
            print(f"FINDING after {n} inputs (input saved to {path}; rerun with --replay):",
                  file=sys.stderr)
            raise
        finally:
            signal.alarm(0)
        n += 1
        if time.monotonic() - last > 60:
            last = time.monotonic()
            print(f"[{time.monotonic() - t0:6.0f} s] {n} inputs {STATS}", flush=True)
    os.remove(current)
    print(f"done: {n} inputs in {time.monotonic() - t0:.0f} s, seed {seed}: {STATS}", flush=True)


def main():
    global INCLUDE_KNOWN
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--engine", choices=["random", "atheris"], default="random")
    parser.add_argument("--seconds", type=float, default=60)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--out", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "mha-fuzz"))
    parser.add_argument("--memory-gib", type=int, default=None,
                        help="address-space cap in GiB (default 4; none under ASan)")
    parser.add_argument("--include-known", action="store_true")
    parser.add_argument("--replay", nargs="*", default=None, help="rerun saved inputs")
    args, rest = parser.parse_known_args()
    INCLUDE_KNOWN = args.include_known
    under_asan = "libasan" in os.environ.get("LD_PRELOAD", "")
    limit_memory(args.memory_gib if args.memory_gib is not None else 0 if under_asan else 4)
    np.seterr(all="ignore")
    if args.replay is not None:
        for path in args.replay:
            with open(path, "rb") as f:
                data = f.read()
            print(f"replaying {path} ({len(data)} bytes)")
            try:
                one_input(data)
                print("no finding", STATS)
            except FuzzFinding:
                traceback.print_exc()
                return 1
        return 0
    if args.engine == "atheris":
        import atheris

        def test_one(data):
            try:
                one_input(data)
            except FuzzFinding:
                raise
        atheris.Setup([sys.argv[0]] + rest, test_one)
        atheris.Fuzz()
        return 0
    seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(4), "little")
    print(f"mha fuzz: engine random, {args.seconds:.0f} s, seed {seed}, known findings "
          f"{'included' if INCLUDE_KNOWN else 'skipped'}, mha._C from {_C.__file__}", flush=True)
    run_random(args.seconds, seed, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
