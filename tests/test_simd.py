"""The C core's SIMD paths (docs/semantics.md, "SIMD paths").

The kernels are compiled once per instruction set and the first call of the core picks one:
the best this CPU runs, or the one MHA_SIMD names. A process keeps its path, so every other
path is exercised in a subprocess started with MHA_SIMD set, and its results are held to this
process's: equal within rounding (float32 1e-5, float64 1e-12 of the array's largest
magnitude), and bitwise where docs/semantics.md promises it: exact zeros of masked rows and
dropped weights, NaN positions, dropout masks.
"""
import functools
import json
import os
import subprocess
import sys

import numpy as np
import pytest

import mha
from conftest import assert_close

PATH_TOL = {np.float32: 1e-5, np.float64: 1e-12}

# Run here and in the subprocesses: the kernels' results on fixed inputs, by name.
WORKLOAD = r'''
import numpy as np
import mha

def workload():
    rng = np.random.default_rng(16)
    res = {}
    for dtype in (np.float32, np.float64):
        t = np.dtype(dtype).name
        # attention with a bool mask (row 0 fully masked), causal, odd sizes (vector tails),
        # a second key tile (n_k > 256) and a NaN key seen by some rows only
        q = rng.standard_normal((2, 3, 37, 24)).astype(dtype)
        k = rng.standard_normal((2, 3, 301, 24)).astype(dtype)
        v = rng.standard_normal((2, 3, 301, 20)).astype(dtype)
        mask = rng.random((2, 3, 37, 301)) > 0.3
        mask[:, :, 0, :] = False
        out, w = mha.attention(q, k, v, mask=mask)
        res[f"attn_out_{t}"], res[f"attn_w_{t}"] = out, w
        res[f"attn_fused_{t}"], _ = mha.attention(q, k, v, mask=mask, need_weights=False)
        d_out = rng.standard_normal(out.shape).astype(dtype)
        for name, g in zip(("dq", "dk", "dv"), mha.attention_backward(d_out, q, k, v, mask=mask)):
            res[f"attn_{name}_{t}"] = g
        out, _ = mha.attention(q, k, v, causal=True, dropout=0.3, seed=5)
        res[f"attn_dropout_{t}"] = out
        # logit soft-capping (the float32 tanh is each path's vectors): both forward paths,
        # the backward, and the layer
        out, w = mha.attention(q, k, v, mask=mask, softcap=2.0)
        res[f"softcap_out_{t}"], res[f"softcap_w_{t}"] = out, w
        res[f"softcap_fused_{t}"], _ = mha.attention(q, k, v, mask=mask, need_weights=False, softcap=2.0)
        grads = mha.attention_backward(d_out, q, k, v, mask=mask, causal=True, softcap=0.7)
        for name, g in zip(("dq", "dk", "dv"), grads):
            res[f"softcap_{name}_{t}"] = g
        k_nan = k.copy()
        k_nan[0, 0, 290, 3] = np.nan
        res[f"attn_nan_{t}"], _ = mha.attention(q, k_nan, v, causal=True, need_weights=False)
        # the layer, forward and backward
        layer = mha.MultiHeadAttention(64, 8, dtype=dtype, seed=3)
        x = rng.standard_normal((3, 29, 64)).astype(dtype)
        out, w = layer(x, causal=True)
        res[f"layer_out_{t}"], res[f"layer_w_{t}"] = out, w
        res[f"layer_dx_{t}"] = layer.backward(rng.standard_normal(out.shape).astype(dtype))[0]
        for key in ("W_q", "W_o", "b_v"):
            res[f"layer_grad_{key}_{t}"] = layer.grads[key]
        layer = mha.MultiHeadAttention(64, 8, dtype=dtype, seed=3, softcap=0.5)
        out, _ = layer(x, causal=True)
        res[f"layer_softcap_out_{t}"] = out
        res[f"layer_softcap_dx_{t}"] = layer.backward(rng.standard_normal(out.shape).astype(dtype))[0]
    return res
'''


def run_path(path, tmp_path, extra_env=None):
    """The workload's results and build_info() in a process with MHA_SIMD=path, and its stderr."""
    out = tmp_path / f"results_{path}.npz"
    code = WORKLOAD + (
        "\nimport sys, json\n"
        "np.savez(sys.argv[1], **workload())\n"
        "print(json.dumps(mha.build_info()))\n")
    env = {**os.environ, "MHA_SIMD": path, **(extra_env or {})}
    res = subprocess.run([sys.executable, "-c", code, str(out)], env=env, capture_output=True,
                         text=True, cwd=tmp_path, timeout=300)
    assert res.returncode == 0, res.stderr
    with np.load(out) as data:
        return {k: data[k] for k in data.files}, json.loads(res.stdout.splitlines()[-1]), res.stderr


@functools.lru_cache(maxsize=1)
def here():
    """The workload's results in this process (on its path)."""
    scope = {}
    exec(WORKLOAD, scope)
    return scope["workload"]()


def test_build_info_names_the_path_in_use():
    info = mha.build_info()
    assert info["simd"] in info["simd_paths"]
    assert info["simd_paths"][-1] == "baseline"
    assert info["kernels"] in ("vector extensions", "portable C")
    if os.environ.get("MHA_SIMD", "auto").lower() == "auto":
        assert info["simd"] == info["simd_paths"][0], "auto must take the best path this CPU runs"
        assert info["simd_choice"].startswith("auto")


@pytest.mark.parametrize("path", ["baseline", "avx2", "avx512"])
def test_every_path_matches_this_process(path, tmp_path):
    if path not in mha.build_info()["simd_paths"]:
        pytest.skip(f"this build or CPU has no {path} path")
    theirs, info, stderr = run_path(path, tmp_path)
    assert info["simd"] == path and info["simd_choice"] == f"MHA_SIMD={path}"
    assert "warning" not in stderr
    ours = here()
    assert sorted(theirs) == sorted(ours)
    for name, a in ours.items():
        b = theirs[name]
        tol = PATH_TOL[a.dtype.type]
        assert_close(b, a, tol, f"{name}: {path} path vs {mha.build_info()['simd']}")
        # bitwise: zeros (masked rows, masked and dropped weights, dead rows) and NaN positions
        np.testing.assert_array_equal(b == 0, a == 0, err_msg=f"{name}: exact zeros differ")
        np.testing.assert_array_equal(np.isnan(b), np.isnan(a), err_msg=f"{name}: NaN differ")
    assert np.isnan(ours["attn_nan_float32"][0, 0, 36]).all()  # the NaN key reached its rows
    assert (ours["attn_out_float64"][:, :, 0] == 0).all()       # fully masked rows: exactly 0


@pytest.mark.parametrize("value, expected", [("BASELINE", "baseline"), ("auto", None), ("", None)])
def test_mha_simd_values(value, expected, tmp_path):
    code = "import json, mha; print(json.dumps(mha.build_info()))"
    res = subprocess.run([sys.executable, "-c", code], env={**os.environ, "MHA_SIMD": value},
                         capture_output=True, text=True, cwd=tmp_path, check=True)
    info = json.loads(res.stdout)
    assert info["simd"] == (expected or info["simd_paths"][0])
    assert res.stderr == ""


@pytest.mark.parametrize("value", ["avx10", "avx2 ;x", "neon"])
def test_unknown_or_unavailable_path_warns_and_runs_the_best(value, tmp_path):
    """A path that is not one of mha's (or not this machine's) is ignored, loudly: a warning on
    stderr, simd_choice says why, and the kernels run the best path, correctly."""
    theirs, info, stderr = run_path(value, tmp_path)
    assert info["simd"] == info["simd_paths"][0]
    assert "ignored" in info["simd_choice"]
    assert stderr.count("mha: warning: MHA_SIMD=") == 1, stderr
    assert ";" not in info["simd_choice"]  # the value is sanitised before it enters build_info
    ours = here()
    for name in ("attn_out_float64", "layer_dx_float32"):
        assert_close(theirs[name], ours[name], PATH_TOL[ours[name].dtype.type], name)
