"""mha.layer_base on its own: the parameters' initialisation against PyTorch's, their layout
against what params_from_torch reads from a torch module, pruning, the KV cache, and the
LayerBase skeleton (checks, dropout seeds, aliasing, unbatching) around a stub layer.

Both mha.MultiHeadAttention and mha.reference.MultiHeadAttention are built on this module, so
no comparison between the two can catch a bug in it.
"""
import math

import numpy as np
import pytest

from mha import layer_base
from mha.layer_base import KVCache, LayerBase, init_params, params_from_torch, prune_params

QUANTILES = np.linspace(0.05, 0.95, 19)


def assert_uniform(w, bound, what):
    """w looks like U(-bound, bound): within the bound, reaching it, quantiles where they belong
    (for 2**16 samples a quantile's standard error is below 0.004 of the bound)."""
    w = np.asarray(w, np.float64).ravel() / bound
    assert np.abs(w).max() <= 1 + 1e-6, f"{what}: outside the bound"
    assert np.abs(w).max() > 0.99, f"{what}: does not reach the bound"
    np.testing.assert_allclose(np.quantile(w, QUANTILES), 2 * QUANTILES - 1, atol=0.02, err_msg=what)


# --- initialisation and layout against PyTorch -------------------------------------------------

@pytest.mark.parametrize("config", [dict(d_model=16, n_heads=4), dict(d_model=16, n_heads=4, kdim=6, vdim=5),
                                    dict(d_model=12, n_heads=3, bias=False)])
def test_init_layout_is_the_layout_from_torch_expects(config):
    """The same names, shapes and dtype as the arrays params_from_torch reads from a torch module
    of the same configuration, and the same meaning: x @ W is torch's projection of x."""
    torch = pytest.importorskip("torch")
    module = torch.nn.MultiheadAttention(config["d_model"], config["n_heads"], batch_first=True,
                                         kdim=config.get("kdim"), vdim=config.get("vdim"),
                                         bias=config.get("bias", True))
    torch_config, from_torch = params_from_torch(module)
    ours = init_params(**config, rng=0)
    assert list(ours) == list(from_torch)
    for name in ours:
        assert ours[name].shape == from_torch[name].shape and ours[name].dtype == from_torch[name].dtype, name
    assert torch_config["d_head"] == config["d_model"] // config["n_heads"]
    x = np.random.default_rng(1).standard_normal((3, config.get("kdim", config["d_model"])))
    E = config["d_model"]
    k_weight = module.in_proj_weight[E:2 * E] if module._qkv_same_embed_dim else module.k_proj_weight
    expected = torch.nn.functional.linear(torch.from_numpy(x).float(), k_weight).detach().numpy()
    np.testing.assert_allclose(x.astype(np.float32) @ from_torch["W_k"], expected, rtol=1e-5, atol=1e-6)


def test_init_matches_torch_where_torch_draws_each_projection():
    """With kdim and vdim different from d_model, torch draws q_proj_weight, k_proj_weight and
    v_proj_weight each Xavier-uniform; init_params draws W_q, W_k, W_v from the same
    distributions. Biases are zero in both."""
    torch = pytest.importorskip("torch")
    E, kdim, vdim = 256, 384, 128
    torch.manual_seed(0)
    module = torch.nn.MultiheadAttention(E, 4, kdim=kdim, vdim=vdim)
    _, theirs = params_from_torch(module)
    ours = init_params(E, 4, kdim=kdim, vdim=vdim, rng=0)
    for name, fan_in in (("W_q", E), ("W_k", kdim), ("W_v", vdim), ("W_o", None)):
        bound = 1 / math.sqrt(E) if name == "W_o" else math.sqrt(6 / (fan_in + E))
        assert_uniform(theirs[name], bound, f"torch {name}")
        assert_uniform(ours[name], bound, f"mha {name}")
    for name in ("b_q", "b_k", "b_v", "b_o"):
        assert not theirs[name].any() and not ours[name].any(), name


def test_init_matches_torch_for_the_fused_projection_and_the_output():
    torch = pytest.importorskip("torch")
    E = 256
    torch.manual_seed(0)
    _, theirs = params_from_torch(torch.nn.MultiheadAttention(E, 4))
    ours = init_params(E, 4, rng=0)
    for name, bound in (("W_q", math.sqrt(6 / (4 * E))), ("W_o", 1 / math.sqrt(E))):
        assert_uniform(theirs[name], bound, f"torch {name}")             # torch's own, as stated
        assert_uniform(ours[name], bound, f"mha {name}")


def test_init_draws_float64_then_casts_and_leaves_the_generator_advanced():
    gen = np.random.default_rng(3)
    p32 = init_params(6, 2, kdim=4, rng=gen)
    again = np.random.default_rng(3)
    for name, shape in (("W_q", (6, 6)), ("W_k", (4, 6)), ("W_v", (6, 6)), ("W_o", (6, 6))):
        bound = 1 / math.sqrt(6) if name == "W_o" else math.sqrt(6 / sum(shape))
        np.testing.assert_array_equal(p32[name], again.uniform(-bound, bound, shape).astype(np.float32))
    assert gen.integers(2**63) == again.integers(2**63)               # the same draws, no more
    with pytest.raises(MemoryError, match="GiB"):
        init_params(2**20, 1, rng=0)


# --- pruning ---------------------------------------------------------------------------------------

def test_prune_params_removes_the_heads_columns_and_rows():
    params = init_params(6, 3, d_head=2, rng=0)
    params = {name: a + np.arange(a.size, dtype=a.dtype).reshape(a.shape) for name, a in params.items()}
    pruned = prune_params(params, [1, 1], n_heads=3, n_kv_heads=3, d_head=2)
    keep = [0, 1, 4, 5]                                               # heads 0 and 2
    for name in ("W_q", "W_k", "W_v"):
        np.testing.assert_array_equal(pruned[name], params[name][:, keep])
        assert pruned[name].flags.c_contiguous
    for name in ("b_q", "b_k", "b_v"):
        np.testing.assert_array_equal(pruned[name], params[name][keep])
    np.testing.assert_array_equal(pruned["W_o"], params["W_o"][keep])
    np.testing.assert_array_equal(pruned["b_o"], params["b_o"])
    assert not any(np.shares_memory(pruned[n], params[n]) for n in params)
    same = prune_params(params, [], 3, 3, 2)
    assert all(np.array_equal(same[n], params[n]) and same[n] is not params[n] for n in params)


@pytest.mark.parametrize("heads, n_kv_heads, message", [
    ([0], 1, "cannot prune heads with grouped key/value heads (n_kv_heads=1 != n_heads=3)"),
    ([3], 3, "head 3 is out of range for n_heads=3"),
    ([-1], 3, "head -1 is out of range for n_heads=3"),
    ([0, 1, 2], 3, "cannot prune all 3 heads"),
])
def test_prune_params_errors(heads, n_kv_heads, message):
    params = init_params(6, 3, n_kv_heads=n_kv_heads, d_head=2, rng=0)
    with pytest.raises(ValueError) as info:
        prune_params(params, heads, 3, n_kv_heads, 2)
    assert str(info.value) == message


# --- the KV cache ------------------------------------------------------------------------------

def test_kv_cache_views_share_the_rows():
    cache = KVCache(2, 3, 5, 4, np.float64)
    assert cache.k.shape == cache.v.shape == (2, 3, 5, 4) and cache.k_rows.shape == (2, 5, 12)
    assert (cache.batch_size, cache.max_len, cache.length) == (2, 5, 0)
    cache.k[1, 2, 3] = [1.0, 2.0, 3.0, 4.0]                           # batch 1, head 2, position 3
    np.testing.assert_array_equal(cache.k_rows[1, 3, 8:12], [1.0, 2.0, 3.0, 4.0])
    assert cache.k_rows.sum() == 10 and not cache.v_rows.any()
    cache.length = 4
    cache.reset()
    assert cache.length == 0
    assert repr(cache) == "KVCache(batch_size=2, n_kv_heads=3, max_len=5, d_head=4, length=0)"
    with pytest.raises(ValueError, match="max_len"):
        KVCache(2, 3, 0, 4)


def test_kv_cache_append_writes_rows_and_returns_every_position():
    """What the causal models use: each step's (B, H_kv, n, d_head) keys and values go after the
    cached ones as rows, and the views of all of them are what the attention kernel reads."""
    rng = np.random.default_rng(0)
    cache = KVCache(2, 3, 5, 4, np.float32)
    steps = [rng.standard_normal((2, 3, n, 4)).astype(np.float32) for n in (2, 1, 2)]
    for t, k in enumerate(steps):
        keys, values = cache.append(k, -k)
        seen = np.concatenate(steps[:t + 1], axis=2)
        assert cache.length == seen.shape[2] and keys.shape == (2, 3, cache.length, 4)
        np.testing.assert_array_equal(keys, seen)
        np.testing.assert_array_equal(values, -seen)
        assert np.shares_memory(keys, cache.k_rows) and keys.strides[-1] == 4   # a view, last axis contiguous
    # rows layout: position p of head h is columns [4 h, 4 h + 4) of row p
    np.testing.assert_array_equal(cache.k_rows[1, 3, 8:12], steps[2][1, 2, 0])   # step 2 began at 3
    with pytest.raises(ValueError, match="cache overflow: 5 cached \\+ 1 new positions > max_len=5"):
        cache.append(steps[1], steps[1])
    assert cache.length == 5


# --- the LayerBase skeleton, around a stub layer -------------------------------------------------

class Stub(LayerBase):
    """Records what the skeleton hands to _forward/_backward; out = query @ W_q @ W_o."""

    def _forward(self, query, key, value, **kw):
        self.forward_args = dict(kw, query=query, key=key, value=value)
        out = query @ self.params["W_q"] @ self.params["W_o"]
        B, n_q, _ = query.shape
        weights = np.zeros((B, self.n_heads, n_q, key.shape[1] + (kw["cache"].length if kw["cache"] else 0)))
        return out, (weights if kw["need_weights"] else None), {"query": query}

    def _backward(self, d_out, saved):
        self.backward_args = (d_out, saved)
        d = np.ones_like(saved["query"])
        return d, (None if not saved["key_given"] else d), (None if not saved["value_given"] else d), \
            {"head_mask": np.zeros(self.n_heads, self.dtype)}


def test_skeleton_checks_before_forward_and_draws_one_seed_per_training_forward():
    layer = Stub(8, 2, dropout=0.5, seed=4)
    gen = np.random.default_rng(4)
    init_params(8, 2, rng=gen)                                        # the constructor's draws
    x = np.ones((2, 3, 8))
    with pytest.raises(ValueError, match="mask"):                      # fails before any draw
        layer(x, mask=np.ones((4, 4), bool))
    layer(x)
    assert layer.forward_args["seed"] == int(gen.integers(0, 2**63)) and layer.forward_args["dropout"] == 0.5
    layer(x)
    assert layer.forward_args["seed"] == int(gen.integers(0, 2**63))
    layer.eval()
    layer(x)
    assert layer.forward_args["seed"] is None and layer.forward_args["dropout"] == 0.0


def test_skeleton_hands_checked_arrays_to_forward():
    layer = Stub(8, 2, seed=0)
    x = np.ones((3, 8))                                                # unbatched float64
    out, weights = layer(x, mask=[[1, 0, 1]], key_padding_mask=np.array([1, 1, 0]), causal=1)
    a = layer.forward_args
    assert a["query"].shape == (1, 3, 8) and a["query"].dtype == np.float32
    assert a["key"] is a["query"] and a["value"] is a["query"]
    assert a["mask"].shape == (1, 2, 3, 3) and a["mask"].dtype == bool
    assert a["key_padding_mask"].tolist() == [[True, True, False]] and a["causal"] is True
    assert a["head_mask"].tolist() == [1.0, 1.0] and a["cache"] is None
    assert out.shape == (3, 8) and weights.shape == (2, 3, 3)          # the B axis dropped
    _, averaged = layer(x, average_weights=True)
    assert averaged.shape == (3, 3)
    assert layer(x, need_weights=False)[1] is None
    layer.head_mask = np.ones(3)
    with pytest.raises(ValueError, match="head_mask"):
        layer(x)


def test_skeleton_backward_checks_and_unbatches():
    layer = Stub(8, 2, seed=0)
    with pytest.raises(RuntimeError, match="forward"):
        layer.backward(np.ones((3, 8)))
    layer(np.ones((3, 8)), value=np.ones((3, 8)))
    with pytest.raises(ValueError, match=r"d_out has shape \(3, 7\) but the output has shape \(3, 8\)"):
        layer.backward(np.ones((3, 7)))
    d_query, d_key, d_value = layer.backward(np.ones((3, 8)))
    d_out, saved = layer.backward_args
    assert d_out.shape == (1, 3, 8) and d_out.dtype == np.float32
    assert not saved["key_given"] and saved["value_given"] and saved["unbatched"]
    assert d_query.shape == (3, 8) and d_key is None and d_value.shape == (3, 8)
    assert list(layer.grads) == ["head_mask"]
    cache = layer.new_cache(1, 4)
    layer(np.ones((1, 2, 8)), cache=cache)
    with pytest.raises(RuntimeError, match="KV cache"):
        layer.backward(np.ones((1, 2, 8)))
    with pytest.raises(TypeError, match="new_cache"):
        layer(np.ones((1, 2, 8)), cache=object())


def test_skeleton_configuration_prune_and_from_torch():
    layer = Stub(12, 3, seed=0)
    assert layer.scale == 0.5 and layer.num_parameters() == 4 * 144 + 4 * 12
    assert repr(layer) == "Stub(d_model=12, n_heads=3, d_head=4, bias=True, dropout=0.0, dtype=float32)"
    layer.head_mask = np.array([1.0, 0.25, 0.5])
    layer.prune_heads([1])
    assert (layer.n_heads, layer.n_kv_heads) == (2, 2) and layer.head_mask.tolist() == [1.0, 0.5]
    assert layer.params["W_q"].shape == (12, 8) and set(layer.grads) == set(layer.params) | {"head_mask"}
    assert layer_base.PARAMS == ("W_q", "W_k", "W_v", "W_o", "b_q", "b_k", "b_v", "b_o")
    torch = pytest.importorskip("torch")
    module = torch.nn.MultiheadAttention(8, 2, kdim=5, vdim=3, dtype=torch.float64).eval()
    imported = Stub.from_torch(module)
    assert type(imported) is Stub and not imported.training and imported.dtype == np.float64
    assert (imported.kdim, imported.vdim) == (5, 3)
    np.testing.assert_array_equal(imported.params["W_k"], module.k_proj_weight.detach().numpy().T)


# --- the oracle is a leaf --------------------------------------------------------------------------

def _imports(path):
    """The mha modules a source file imports (relative imports resolved), from its syntax tree."""
    import ast
    from pathlib import Path

    package = Path(layer_base.__file__).parent
    parts = list(Path(path).relative_to(package.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    here = parts if Path(path).name == "__init__.py" else parts[:-1]
    found = set()
    for node in ast.walk(ast.parse(Path(path).read_text())):
        if isinstance(node, ast.ImportFrom):
            base = here[:len(here) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            found.add(module)
            found.update(f"{module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {m for m in found if m == "mha" or m.startswith("mha.")}


def test_the_oracle_and_the_fast_path_do_not_import_each_other():
    from pathlib import Path

    package = Path(layer_base.__file__).parent
    oracle = sorted((package / "reference").glob("*.py"))
    fast = [package / "functional.py", package / "layer.py"]
    shared = [package / "checks.py", package / "layer_base.py"]
    for path in oracle + shared:
        bad = {m for m in _imports(path) if m.startswith(("mha.functional", "mha.layer.", "mha._C"))
               or m == "mha.layer"}
        assert not bad, f"{path.name} imports the fast path: {bad}"
    for path in fast + shared:
        bad = {m for m in _imports(path) if m.startswith("mha.reference")}
        assert not bad, f"{path.name} imports the oracle: {bad}"


def test_star_import_loads_no_lazy_submodule():
    import subprocess
    import sys

    code = ("import sys\nfrom mha import *\n"
            "print(sorted(m for m in sys.modules if m.split('.')[:2][-1] in "
            "('models', 'train', 'viz', 'analysis', 'bench', 'tour') and m.startswith('mha.')))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
