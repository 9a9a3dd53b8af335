"""Row statistics streamed out of the attention kernel: `mha.attention(..., row_stats=...)`.

Each statistic is held to the same statistic computed from the materialised maps: the
weights the kernel returns for the same call (`need_weights=True`), taken to float64 and
reduced by `mha.reference.sdpa.row_statistics`, at 1,024 tokens, on both forward paths (with
and without weights), on every SIMD path (the others in a subprocess with MHA_SIMD set, as
tests/test_simd.py does), float32 and float64, with bool, float and broadcast (padding)
masks, GQA, causal with n_q = n_k and n_q < n_k. The float64 maps are held to the NumPy
oracle's (`mha.reference.attention`) too.

Tolerances: absolute on the probabilities (max, key_set_mass, self, prev, next): 1e-6 in
float32, 1e-12 in float64; the entropy relative to its scale log(n_k), the distance relative
to its scale n_k, with the same bounds. The argmax must name a key whose weight is the row's
largest within the same tolerance (a near tie may go either way). Against the exact maps of
the float32 inputs, float32 statistics also carry the float32 scores' rounding, as the
weights do (1.3e-6 on the largest weight of the sharpest case here).
"""
import functools
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import mha

ALL = ("entropy", "max", "argmax", "key_set_mass", "self", "prev", "next", "distance")
TOL = {"float32": 1e-6, "float64": 1e-12}

# Run here and in the subprocesses: the inputs of each case, and the kernels' statistics.
WORKLOAD = r'''
import numpy as np
import mha

ALL = ("entropy", "max", "argmax", "key_set_mass", "self", "prev", "next", "distance")


def cases(dtype):
    """(name, q, k, v, attention's keywords, key_set) at 1,024 tokens."""
    rng = np.random.default_rng(29)
    n, d = 1024, 64
    def x(*shape):
        return rng.standard_normal(shape).astype(dtype)
    # GQA (4 query heads on 2 key heads), causal, padding of batch 1's last 100 keys as a
    # broadcast bool mask, one key set per batch
    padding = np.ones((2, 1, 1, n), bool)
    padding[1, ..., -100:] = False
    key_sets = rng.random((2, n)) < 0.05
    key_sets[:, 0] = True
    yield ("gqa_causal_padding", x(2, 4, n, d), x(2, 2, n, d), x(2, 2, n, d),
           dict(mask=padding, causal=True), key_sets)
    # (B, n, d), a float mask, a fully masked row (a float mask of -inf), the first key's set
    mask = (rng.standard_normal((1, n, n)) * 2).astype(dtype)
    mask[0, 5, :] = -np.inf
    first = np.zeros(n, bool)
    first[0] = True
    yield ("float_mask", 3 * x(1, n, d), x(1, n, d), x(1, n, d), dict(mask=mask), first)
    # a KV-cache step shape: 300 queries after 724 cached keys, causal, a bool mask with a
    # fully masked row, dropout (the statistics are of the weights before dropout)
    bool_mask = rng.random((1, 2, 300, n)) < 0.9
    bool_mask[0, 1, 7, :] = False
    yield ("cache_step_bool_mask", x(1, 2, 300, d), x(1, 2, n, d), x(1, 2, n, d),
           dict(mask=bool_mask, causal=True, dropout=0.2, seed=3), first)


def workload():
    """{dtype/case/path/statistic: array}: path "fused" (need_weights=False), "weights", and
    "maps" (the statistics of the returned weights, in float64); "at_argmax": the weight (of
    the maps) at each path's argmax."""
    from mha.reference.sdpa import row_statistics
    res = {}
    for dtype in (np.float32, np.float64):
        t = np.dtype(dtype).name
        for name, q, k, v, kw, key_set in cases(dtype):
            for path in ("fused", "weights"):
                _, w, stats = mha.attention(q, k, v, need_weights=path == "weights",
                                            row_stats=ALL, key_set=key_set, **kw)
                for s, a in stats.items():
                    res[f"{t}/{name}/{path}/{s}"] = a
                if w is not None:
                    w = w.astype(np.float64)
                    for s, a in row_statistics(w, ALL, key_set=key_set).items():
                        res[f"{t}/{name}/maps/{s}"] = a
            for path in ("fused", "weights"):
                at = np.maximum(res[f"{t}/{name}/{path}/argmax"], 0)[..., None]
                res[f"{t}/{name}/{path}/at_argmax"] = np.take_along_axis(w, at, -1)[..., 0]
    return res
'''


def run_path(path, tmp_path):
    """The workload's results in a process with MHA_SIMD=path."""
    out = tmp_path / f"stats_{path}.npz"
    code = WORKLOAD + "\nimport sys\nnp.savez(sys.argv[1], **workload())\n"
    res = subprocess.run([sys.executable, "-c", code, str(out)], capture_output=True, text=True,
                         env={**os.environ, "MHA_SIMD": path}, cwd=tmp_path, timeout=600)
    assert res.returncode == 0, res.stderr
    with np.load(out) as data:
        return {k: data[k] for k in data.files}


def _scope():
    scope = {}
    exec(WORKLOAD, scope)
    return scope


@functools.lru_cache(maxsize=1)
def here():
    return _scope()["workload"]()


def check_against_maps(results, where):
    n_k = 1024
    scale = {"entropy": np.log(n_k), "distance": n_k}
    checked = set()
    for key, got in results.items():
        t, name, path, stat = key.split("/")
        if path == "maps" or stat == "at_argmax":
            continue
        want = {s: results[f"{t}/{name}/maps/{s}"] for s in ALL}
        tol = TOL[t]
        what = f"{stat} ({t}, {name}, {path} path, {where})"
        assert got.shape == want[stat].shape, what
        if stat == "argmax":
            dead = want["max"] == 0
            assert dead.any() == (name != "gqa_causal_padding"), "the fully masked rows"
            assert (got[dead] == -1).all(), f"{what}: a fully masked row's argmax is -1"
            assert ((got >= 0) & (got < n_k))[~dead].all(), what
            err = np.max(want["max"] - results[f"{t}/{name}/{path}/at_argmax"])
            assert err <= tol, f"{what}: the weight at the argmax is {err:.2e} below the max"
            continue
        assert got.dtype == np.dtype(t), what
        err = np.max(np.abs(got.astype(np.float64) - want[stat])) / scale.get(stat, 1)
        assert err <= tol, f"{what}: error {err:.3e} > {tol:.0e}"
        checked.add((t, name, path, stat))
    assert len(checked) == 2 * 3 * 2 * (len(ALL) - 1)


def test_row_stats_equal_the_maps_statistics():
    check_against_maps(here(), mha.build_info()["simd"])


def test_float64_maps_statistics_equal_the_oracles():
    """The float64 maps' statistics above are those of `mha.reference.attention`'s weights."""
    for name, q, k, v, kw, key_set in _scope()["cases"](np.float64):
        _, _, want = mha.reference.attention(q, k, v, row_stats=ALL, key_set=key_set, **kw)
        for s in ALL:
            got = here()[f"float64/{name}/maps/{s}"]
            if s == "argmax":
                np.testing.assert_array_equal(got, want[s], err_msg=f"{name} {s}")
            else:
                np.testing.assert_allclose(got, want[s], rtol=0, atol=1e-12 * max(1, np.max(want[s])),
                                           err_msg=f"{name} {s}")


@pytest.mark.parametrize("path", ["baseline"])
def test_row_stats_on_another_simd_path(path, tmp_path):
    if path not in mha.build_info()["simd_paths"] or path == mha.build_info()["simd"]:
        pytest.skip(f"{path} is this process's path, or this build has no {path} path")
    check_against_maps(run_path(path, tmp_path), path)


@pytest.mark.parametrize("shape_q, shape_k, per_batch", [
    ((7, 4), (9, 4), True), ((3, 7, 4), (3, 7, 4), True), ((2, 4, 9, 4), (2, 2, 7, 4), False)])
def test_kernel_equals_the_numpy_twin_on_every_rank(rng, shape_q, shape_k, per_batch):
    """mha.attention's statistics equal mha.reference.attention's (float64, within 1e-12),
    a key set per batch ((1, n_k) for 2-D inputs) or one for all, causal."""
    q, k = rng.standard_normal(shape_q), rng.standard_normal(shape_k)
    n_k = shape_k[-2]
    key_set = rng.random(((shape_q[0] if len(shape_q) > 2 else 1, n_k) if per_batch else n_k)) < 0.4
    got = mha.attention(q, k, k, causal=True, row_stats=ALL, key_set=key_set)[2]
    want = mha.reference.attention(q, k, k, causal=True, row_stats=ALL, key_set=key_set)[2]
    for name in ALL:
        np.testing.assert_allclose(got[name], want[name], rtol=0, atol=1e-12 * (n_k if name == "distance" else 1),
                                   err_msg=name)


def test_fully_masked_rows_give_zeros_and_argmax_minus_one(rng):
    q, k, v = (rng.standard_normal((2, 6, 5)) for _ in range(3))
    mask = np.ones((2, 6, 6), bool)
    mask[1, 3] = False
    for need_weights in (False, True):
        _, _, stats = mha.attention(q, k, v, mask, need_weights=need_weights, row_stats=ALL,
                                    key_set=np.ones(6, bool))
        for name, a in stats.items():
            assert a[1, 3] == (-1 if name == "argmax" else 0), name
            assert (a[0] != (-1 if name == "argmax" else -7)).all()
        assert stats["key_set_mass"][0] == pytest.approx(1, abs=1e-12)  # every key in the set


def test_outputs_and_shapes(rng):
    """out (and weights, lse) are what attention gives without statistics; stats are
    (..., n_q) for every rank, argmax int64, the rest in the call's dtype."""
    for shape_q, shape_k in [((7, 4), (9, 4)), ((2, 7, 4), (2, 9, 4)), ((2, 4, 7, 4), (2, 2, 9, 4))]:
        for dtype in (np.float32, np.float64):
            q, k = rng.standard_normal(shape_q).astype(dtype), rng.standard_normal(shape_k).astype(dtype)
            out, w, lse = mha.attention(q, k, k, causal=True, return_lse=True)
            out2, w2, lse2, stats = mha.attention(q, k, k, causal=True, return_lse=True,
                                                  row_stats=["max", "argmax"])
            np.testing.assert_array_equal(out2, out)
            np.testing.assert_array_equal(w2, w)
            np.testing.assert_array_equal(lse2, lse)
            assert set(stats) == {"max", "argmax"}
            assert stats["max"].shape == shape_q[:-1] and stats["max"].dtype == dtype
            assert stats["argmax"].dtype == np.int64
            np.testing.assert_array_equal(stats["argmax"], w.argmax(-1))
            np.testing.assert_allclose(stats["max"], w.max(-1), rtol=1e-6)


def test_known_values():
    """One query over four keys with scores log(1), log(2), log(3), log(4) (weights 0.1 to
    0.4), aligned at key 3 (n_q = 1, n_k = 4): entropy, self = P_3, prev = P_2, next = 0,
    distance sum P_j (3 - j) = 0.3 + 0.4 + 0.3 = 1.0, the key set {0, 3} carries 0.5."""
    k = np.log(np.arange(1.0, 5.0))[:, None]
    p = np.arange(1.0, 5.0) / 10
    _, _, stats = mha.attention(np.ones((1, 1)), k, np.zeros((4, 1)), scale=1.0,
                                row_stats=ALL, key_set=[True, False, False, True],
                                need_weights=False)
    want = {"entropy": -np.sum(p * np.log(p)), "max": 0.4, "argmax": 3, "key_set_mass": 0.5,
            "self": 0.4, "prev": 0.3, "next": 0.0, "distance": 1.0}
    for name, value in want.items():
        assert stats[name][0] == pytest.approx(value, abs=1e-14), name


def test_dropout_is_ignored(rng):
    """The statistics are of the softmax probabilities, as the returned weights are."""
    q, k, v = (rng.standard_normal((3, 40, 8)) for _ in range(3))
    _, _, plain = mha.attention(q, k, v, row_stats=ALL, key_set=np.arange(40) < 3)
    _, _, dropped = mha.attention(q, k, v, dropout=0.5, seed=1, row_stats=ALL,
                                  key_set=np.arange(40) < 3)
    for name in ALL:
        np.testing.assert_array_equal(dropped[name], plain[name], err_msg=name)


@pytest.mark.parametrize("impl", [mha.attention, mha.reference.attention], ids=["C", "reference"])
@pytest.mark.parametrize("kwargs, error, message", [
    (dict(row_stats=["entropy", "sink"]), ValueError, "row_stats: unknown statistic 'sink'"),
    (dict(row_stats=["key_set_mass"], key_set=np.ones(6, bool)), ValueError,
     r"key_set has shape \(6,\) but \(n_k,\) = \(5,\) or \(batch, n_k\) = \(1, 5\)"),
    (dict(row_stats=["key_set_mass"]), ValueError, "asks for 'key_set_mass' but key_set is None"),
    (dict(row_stats=["max"], key_set=np.ones(5, bool)), ValueError,
     "key_set is given but row_stats does not ask for 'key_set_mass'"),
    (dict(key_set=np.ones(5, bool)), ValueError, "key_set is given but row_stats does not ask"),
    (dict(row_stats=["key_set_mass"], key_set=np.ones(5)), TypeError,
     "key_set must be a bool array"),
])
def test_bad_arguments_name_the_argument(impl, kwargs, error, message):
    q = np.ones((5, 3))
    with pytest.raises(error, match=message):
        impl(q, q, q, **kwargs)


def test_one_name_alone_and_integer_key_sets(rng):
    q, k = rng.standard_normal((6, 4)), rng.standard_normal((6, 4))
    _, w, one = mha.attention(q, k, k, row_stats="entropy")
    assert set(one) == {"entropy"}
    _, _, by_int = mha.attention(q, k, k, row_stats=["key_set_mass"], key_set=[0, 2, 0, 0, 1, 0])
    np.testing.assert_allclose(by_int["key_set_mass"], w[:, 1] + w[:, 4], rtol=1e-12)


def test_need_weights_false_with_stats_allocates_no_n_by_n_buffer():
    """Every statistic at 8,192 tokens without weights, in 96 MiB of headroom: the (n_q, n_k)
    buffer alone would be 256 MiB in float32."""
    script = textwrap.dedent("""
        import resource
        import numpy as np
        import mha
        names = ("entropy", "max", "argmax", "key_set_mass", "self", "prev", "next", "distance")
        q = np.random.default_rng(0).standard_normal((8192, 1)).astype(np.float32)
        first = np.zeros(8192, bool)
        first[0] = True
        mha.attention(q[:64], q[:64], q[:64], need_weights=False)   # start the threads
        with open("/proc/self/status") as f:
            vm = next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmSize"))
        limit = vm + (96 << 20)
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        out, w, stats = mha.attention(q, q, q, need_weights=False, causal=True, row_stats=names,
                                      key_set=first)
        assert w is None and out.shape == (8192, 1) and np.isfinite(out).all()
        assert all(a.shape == (8192,) for a in stats.values())
        assert stats["key_set_mass"][0] == 1 and stats["argmax"][0] == 0
        print("OK")
    """)
    here_dir = os.path.dirname(os.path.abspath(__file__))
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120, cwd=here_dir)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("OK"), (
        f"row statistics without weights ran out of a 96 MiB budget (return code "
        f"{proc.returncode}): {proc.stdout[-500:]} {proc.stderr[-1500:]}")
