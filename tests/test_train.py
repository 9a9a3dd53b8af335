"""mha.train: the period-3 task, the small model trained on the C backward, the parameter counts,
and the experiments of mha.apps.training (1 vs 4 vs 8 heads, the sweep over head counts, the
head-pruning procedure).

The model's gradient is held to finite differences (float64) and its training run to the same
model written in PyTorch, started from the same weights (loss per epoch within 1e-6 relative).
"""
import math

import numpy as np
import pytest

import mha
from conftest import assert_close, numeric_grad
from mha import train
from mha.apps import epoch_speed, training, training_figures
from mha.train import (Adam, SimpleAttentionModel, cross_entropy, fit, pattern_ceiling,
                       pattern_data, pattern_min_loss)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """The test machine's cores are shared: keep the C kernels (and torch) on one thread."""
    old = mha.get_num_threads()
    mha.set_num_threads(1)
    try:
        import torch
        old_torch = torch.get_num_threads()
        torch.set_num_threads(1)
    except ImportError:
        torch = None
    yield
    mha.set_num_threads(old)
    if torch is not None:
        torch.set_num_threads(old_torch)


# --- the task --------------------------------------------------------------------------------

def test_pattern_data_is_the_period_3_task():
    x, y = pattern_data(300, seq_len=12, vocab_size=5, period=3, seed=0)
    assert x.shape == y.shape == (300, 12) and x.dtype == y.dtype == np.int64
    assert x.min() >= 0 and x.max() == 4
    np.testing.assert_array_equal(x[:, 3:], x[:, :-3])                 # period 3
    np.testing.assert_array_equal(y[:, :-1], x[:, 1:])                 # next token
    np.testing.assert_array_equal(y[:, 2:], x[:, :-2])                 # = the token 2 back
    x0, y0 = pattern_data(2, seq_len=6, vocab_size=5, seed=0)
    np.testing.assert_array_equal(x0[0], [4, 3, 2, 4, 3, 2])
    np.testing.assert_array_equal(y0[0], [3, 2, 4, 3, 2, 4])
    again, _ = pattern_data(300, seq_len=12, vocab_size=5, seed=0)
    other, _ = pattern_data(300, seq_len=12, vocab_size=5, seed=1)
    np.testing.assert_array_equal(again, x)
    assert (other != x).any()
    x7, _ = pattern_data(10, seq_len=13, vocab_size=9, period=4, seed=3)
    np.testing.assert_array_equal(x7[:, 4:], x7[:, :-4])


def test_pattern_ceiling():
    assert pattern_ceiling(12, 5, 3) == pytest.approx(10.4 / 12)
    assert pattern_ceiling(12, 5, 1) == 1.0
    assert pattern_ceiling(8, 2, 4) == pytest.approx((5 + 3 / 2) / 8)


def test_pattern_min_loss():
    assert pattern_min_loss(12, 5, 3) == pytest.approx(2 * math.log(5) / 12)
    assert pattern_min_loss(12, 5, 1) == 0.0


def test_pattern_data_validates():
    with pytest.raises(ValueError, match="period"):
        pattern_data(10, period=0)


# --- model pieces ----------------------------------------------------------------------------

def test_cross_entropy_and_its_gradient(rng):
    logits = rng.standard_normal((3, 4, 6)) * 3
    targets = rng.integers(0, 6, size=(3, 4))
    loss, d_logits = cross_entropy(logits, targets)
    p = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    expected = -np.mean(np.log(np.take_along_axis(p, targets[..., None], -1)))
    assert loss == pytest.approx(expected, rel=1e-12)
    onehot = np.eye(6)[targets]
    assert_close(d_logits, (p - onehot) / 12, 1e-12, "d_logits")
    big, _ = cross_entropy(np.array([[1000.0, 0.0]]), np.array([1]))     # no overflow
    assert big == pytest.approx(1000.0)
    with pytest.raises(ValueError, match="targets"):
        cross_entropy(logits, targets[:, :3])


def test_model_shapes_parameters_and_validation():
    model = SimpleAttentionModel(vocab_size=5, d_model=32, n_heads=4, seq_len=12, seed=0)
    assert model.dtype == np.float32
    assert list(model.params) == ["token_embedding", "pos_embedding", "W_q", "W_k", "W_v",
                                  "W_o", "W_out", "b_out"]
    # embeddings 5*32 + 12*32, attention 4*32*32, output layer 32*5 + 5
    assert model.num_parameters() == 160 + 384 + 4096 + 160 + 5 == 4805
    assert all(model.params[k] is model.attention.params[k] for k in ("W_q", "W_o"))
    x, _ = pattern_data(7, seed=0)
    logits, weights = model(x)
    assert logits.shape == (7, 12, 5) and weights.shape == (7, 4, 12, 12)
    assert_close(weights.sum(-1), np.ones((7, 4, 12)), 1e-5, "row sums")
    assert np.all(np.triu(weights, 1) == 0)                               # causal
    one, w1 = model(x[0])
    assert one.shape == (12, 5) and w1.shape == (4, 12, 12)
    assert_close(one, logits[0], 1e-5, "unbatched")
    short, _ = model(x[:, :5])                                            # shorter sequences
    assert_close(short, logits[:, :5], 1e-5, "prefix (causal)")
    with pytest.raises(TypeError, match="integer"):
        model(x.astype(float))
    with pytest.raises(ValueError, match="outside"):
        model(x + 5)
    with pytest.raises(ValueError, match="seq_len=12"):
        model(np.zeros((2, 13), int))
    with pytest.raises(RuntimeError, match="forward"):
        SimpleAttentionModel(seed=0).backward(np.zeros((1, 12, 5)))


def _loss_at(model, x, y):
    return model.loss(x, y)


@pytest.mark.parametrize("bias, n_heads", [(False, 2), (True, 1)])
def test_gradient_matches_finite_differences(bias, n_heads):
    model = SimpleAttentionModel(vocab_size=4, d_model=6, n_heads=n_heads, seq_len=6,
                                 bias=bias, dtype=np.float64, seed=3)
    rng = np.random.default_rng(1)
    for name in ("b_q", "b_k", "b_v", "b_o"):       # non-zero biases exercise their gradients
        if name in model.params:
            model.params[name][...] = 0.3 * rng.standard_normal(model.params[name].shape)
    x, y = pattern_data(3, seq_len=5, vocab_size=4, seed=2)           # 5 < seq_len: last pos row
    x[0, 0], y[1, 1] = 3, 0                                            # not the plain pattern
    loss, grads = model.loss_and_grads(x, y)
    assert loss == pytest.approx(_loss_at(model, x, y), rel=1e-14)
    assert set(grads) == set(model.params) | {"head_mask"}
    for name, param in model.params.items():
        expected = numeric_grad(lambda: _loss_at(model, x, y), param, eps=1e-6)
        assert_close(grads[name], expected, 1e-6, f"d loss / d {name}",
                     scale=np.abs(expected).max() + 1e-3)
    assert np.all(grads["pos_embedding"][5:] == 0)                     # unused positions
    head_mask = model.attention.head_mask
    expected = numeric_grad(lambda: _loss_at(model, x, y), head_mask, eps=1e-6)
    assert_close(grads["head_mask"], expected, 1e-6, "d loss / d head_mask")


def test_adam_matches_torch_adam(rng):
    torch = pytest.importorskip("torch")
    params = {"a": rng.standard_normal((3, 4)), "b": rng.standard_normal(5)}
    t_params = [torch.tensor(p.copy(), requires_grad=True) for p in params.values()]
    adam = Adam(params, lr=0.01, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1)
    t_adam = torch.optim.Adam(t_params, lr=0.01, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1)
    for step in range(12):
        grads = {k: np.sin(p * (step + 1)) + p ** 2 for k, p in params.items()}
        for t, g in zip(t_params, grads.values()):
            t.grad = torch.tensor(g)
        adam.step(grads)
        t_adam.step()
    for (name, p), t in zip(params.items(), t_params):
        assert_close(p, t.detach().numpy(), 1e-13, f"Adam {name}")


# --- against PyTorch -------------------------------------------------------------------------

def _torch_twin(model):
    """The same model written directly in torch (float64), from `model`'s current weights."""
    torch = pytest.importorskip("torch")
    P = {k: torch.tensor(v.copy(), dtype=torch.float64, requires_grad=True)
         for k, v in model.params.items()}
    H, D = model.n_heads, model.attention.d_head

    def forward(tokens):
        B, n = tokens.shape
        x = P["token_embedding"][tokens] + P["pos_embedding"][:n]
        def heads(t):
            return t.view(B, n, H, D).transpose(1, 2)
        q = heads(x @ P["W_q"] + P.get("b_q", 0))
        k = heads(x @ P["W_k"] + P.get("b_k", 0))
        v = heads(x @ P["W_v"] + P.get("b_v", 0))
        scores = q @ k.transpose(-2, -1) / math.sqrt(D)
        causal = torch.tril(torch.ones(n, n, dtype=torch.bool))
        attn = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1)
        context = (attn @ v).transpose(1, 2).reshape(B, n, H * D)
        h = context @ P["W_o"] + P.get("b_o", 0)
        return h @ P["W_out"] + P["b_out"]

    return P, forward


@pytest.mark.parametrize("n_heads, bias", [(4, False), (1, False), (2, True)])
def test_loss_curve_matches_torch(n_heads, bias):
    torch = pytest.importorskip("torch")
    model = SimpleAttentionModel(vocab_size=5, d_model=32, n_heads=n_heads, seq_len=12,
                                 bias=bias, dtype=np.float64, seed=7)
    x, y = pattern_data(64, seq_len=12, vocab_size=5, seed=0)
    P, forward = _torch_twin(model)
    optimizer = torch.optim.Adam(list(P.values()), lr=0.005)
    t_x, t_y = torch.from_numpy(x), torch.from_numpy(y)
    t_losses = []
    for epoch in range(20):
        loss = torch.nn.functional.cross_entropy(forward(t_x).reshape(-1, 5), t_y.reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        if epoch == 0:
            _, grads = model.loss_and_grads(x, y)
            # b_k's gradient is 0 in exact arithmetic (a key bias shifts whole score rows)
            scale = max(float(p.grad.abs().max()) for p in P.values())
            for name, p in P.items():
                assert_close(grads[name], p.grad.numpy(), 1e-10, f"first gradient {name}",
                             scale=scale)
        optimizer.step()
        t_losses.append(loss.item())
    history = fit(model, x, y, epochs=20, lr=0.005, progress=False)
    t_losses = np.array(t_losses)
    rel = np.abs(history["loss"] - t_losses) / t_losses
    assert rel.max() < 1e-6, f"max relative loss difference {rel.max():.2e}"
    assert t_losses[-1] < 0.8 * t_losses[0]                           # it did learn


def test_torch_model_holds_our_weights():
    torch = pytest.importorskip("torch")
    for n_heads in (1, 4):
        model = SimpleAttentionModel(5, 16, n_heads, 12, dtype=np.float64, seed=n_heads)
        module = train.torch_model(model)
        x, _ = pattern_data(5, seed=4)
        logits, weights = model(x)
        t_logits, t_weights = module(torch.from_numpy(x))
        assert_close(logits, t_logits.detach().numpy(), 1e-10, "logits")
        assert_close(weights.reshape(t_weights.shape), t_weights.detach().numpy(), 1e-10, "weights")
    model.attention.head_mask[0] = 0
    with pytest.raises(ValueError, match="head mask"):
        train.torch_model(model)


# --- the training loop -----------------------------------------------------------------------

def test_fit_history_minibatches_and_progress(capsys):
    x, y = pattern_data(40, seed=0)
    xt, yt = pattern_data(20, seed=1)
    model = SimpleAttentionModel(5, 16, 2, 12, seed=0)
    history = fit(model, x, y, xt, yt, epochs=5, lr=0.01, batch_size=16, eval_every=2,
                  seed=0, progress=False)
    assert capsys.readouterr().err == ""
    assert history["loss"].shape == (5,)
    np.testing.assert_array_equal(history["test_epochs"], [2, 4, 5])
    assert history["test_accuracy"].shape == (3,)
    assert history["final_test_accuracy"] == model.accuracy(xt, yt)
    assert history["final_loss"] == pytest.approx(model.loss(x, y), rel=1e-6)
    assert history["seconds"] > 0
    # 3 Adam steps per epoch (16 + 16 + 8): the same run with an explicit optimizer agrees
    model2 = SimpleAttentionModel(5, 16, 2, 12, seed=0)
    optimizer = Adam(model2.params, lr=0.01)
    again = fit(model2, x, y, epochs=5, batch_size=16, seed=0, optimizer=optimizer,
                progress=False)
    assert optimizer.t == 15
    assert_close(again["loss"], history["loss"], 1e-6, "loss")
    assert np.isnan(again["final_test_accuracy"]) and again["test_accuracy"].size == 0
    fit(model2, x, y, epochs=2, progress=True, desc="tiny")
    err = capsys.readouterr().err
    assert "tiny" in err and "2/2" in err and "loss=" in err


# --- one head against many -------------------------------------------------------------------

def test_compare_heads_learns_the_pattern():
    results = training.compare_heads((1, 4), d_model=32, epochs=60, lr=0.01, n_train=150,
                                  n_test=50, seed=0, progress=False)
    assert list(results) == [1, 4]
    ceiling = pattern_ceiling()
    for h, r in results.items():
        assert r["loss"].shape == (60,) and r["loss"][-1] < 0.6 * r["loss"][0]
        assert r["attention"].shape == (h, 12, 12)
        assert r["n_parameters"] == 4805
    # both find the period: at the task's ceiling of 0.867 (the first two targets are random)
    assert results[1]["final_test_accuracy"] > ceiling - 0.03
    assert results[4]["final_test_accuracy"] > ceiling - 0.03
    # the single head, and some head of the 4, look only at copies of the next token
    assert training.period_mass(results[1]["attention"])[0] > 0.95
    assert training.period_mass(results[4]["attention"]).max() > 0.95
    assert len(set(results[4]["tokens"][:3].tolist())) == 3             # a clear example
    figs = training_figures.compare_heads_figures(results)
    assert set(figs) == {"summary", "patterns"}
    assert len(figs["summary"].axes) == 2
    assert len([ax for ax in figs["patterns"].axes if ax.get_visible()]) >= 4


# --- parameter counts ------------------------------------------------------------------------

def test_parameter_counts_with_and_without_bias():
    base = train.parameter_count(512, 8, bias=False)
    assert base["d_head"] == 64 and base["W_q"] == 512 * 512 and base["total"] == 1_048_576
    with_bias = train.parameter_count(512, 8, bias=True)
    assert with_bias["biases"] == 4 * 512 and with_bias["total"] == 1_050_624
    assert train.parameter_count(512, 1, bias=True)["total"] == with_bias["total"]
    for d_model, h, bias in ((512, 8, True), (64, 1, False), (48, 3, True)):
        layer = mha.MultiHeadAttention(d_model, h, bias=bias, seed=0)
        assert train.parameter_count(d_model, h, bias=bias)["total"] == layer.num_parameters()
    assert train.parameter_count(8, 2, d_head=8, bias=False)["total"] == 4 * 8 * 16

    t = train.transformer_parameters(512, 8, 2048, n_layers=6, vocab_size=37000)
    block = t["block"]
    assert block["ffn"] == 2 * 512 * 2048 + 2048 + 512 == 2_099_712
    assert block["total"] == 1_050_624 + 2_099_712 + 2048
    assert block["mha_share"] == pytest.approx(0.3333, abs=1e-3)
    assert block["ffn_share"] == pytest.approx(0.6661, abs=1e-3)
    assert t["mha"] == 18 * 1_050_624 and t["ffn"] == 12 * 2_099_712
    assert t["embedding"] == 37000 * 512
    assert 60e6 < t["total"] < 65e6                                     # the paper's "65M"
    assert t["mha_share"] + t["ffn_share"] + t["layer_norm_share"] + t["embedding_share"] \
        == pytest.approx(1.0)

    rows = train.parameter_table(512, (1, 8), bias=(False, True))
    assert [(r["n_heads"], r["bias"]) for r in rows] == [(1, False), (8, False), (1, True),
                                                        (8, True)]
    assert rows[0]["mha"] == rows[1]["mha"] == 1_048_576
    assert rows[0]["d_head"] == 512 and rows[1]["d_head"] == 64
    text = train.format_table(rows)
    assert "| 1,048,576 |" in text and "| 1,050,624 |" in text and "33.3%" in text
    assert len(text.splitlines()) == 6


# --- the sweep over head counts --------------------------------------------------------------

def test_offset_profile():
    n = 5
    eye = np.eye(n)
    prev = np.eye(n, k=-1)
    prev[0, 0] = 1.0
    profile = training.offset_profile(np.stack([eye, prev]))
    assert_close(profile[0], [1, 0, 0, 0, 0], 1e-15, "diagonal head")
    assert_close(profile[1], [0.2, 1, 0, 0, 0], 1e-15, "previous-token head")


def test_period_mass():
    n = 7
    copy_head = np.eye(n, k=-2)                       # attends to i-2, the token to copy
    copy_head[0, 0] = copy_head[1, 1] = 1.0
    assert training.period_mass(copy_head) == pytest.approx(1.0)
    far_copy = np.zeros((n, n))                       # i-5 (same token, period 3), else key 0
    for i in range(n):
        far_copy[i, max(i - 5, 0)] = 1.0
    # rows 2..6: key 0 is 2, 3, 4 back (copy, no, no), then i-5 twice (copy)
    assert training.period_mass(far_copy) == pytest.approx(3 / 5)
    uniform = np.tril(np.ones((n, n))) / np.arange(1, n + 1)[:, None]
    # rows 2..6 have 1, 1, 1, 2, 2 copy positions among 3..7 keys
    expected = np.mean([1 / 3, 1 / 4, 1 / 5, 2 / 6, 2 / 7])
    assert training.period_mass(np.stack([uniform, copy_head])) == pytest.approx([expected, 1.0])


def test_heads_sweep_small():
    results = training.heads_sweep((1, 2, 4), d_model=16, epochs=4, lr=0.01, n_train=20,
                                n_test=10, seed=0, progress=False)
    uniform = np.mean(np.log(np.arange(1, 13)))
    for h, r in results.items():
        assert r["entropy"].shape == (h,) and r["offsets"].shape == (h, 12)
        assert np.all(r["entropy"] >= 0) and np.all(r["entropy"] <= uniform + 1e-9)
        assert r["entropy_uniform"] == pytest.approx(uniform)
        assert r["epochs_to_target"] is None or 1 <= r["epochs_to_target"] <= 4
        assert r["target_accuracy"] == pytest.approx(0.97 * pattern_ceiling())
        assert r["target_loss"] == pytest.approx(pattern_min_loss() + 0.1)
        assert r["epochs_to_loss"] is None or 1 <= r["epochs_to_loss"] <= 4
        assert r["period_mass"].shape == (h,)
        assert np.all((r["period_mass"] >= 0) & (r["period_mass"] <= 1 + 1e-9))
    figs = training_figures.heads_sweep_figures(results)
    assert set(figs) == {"summary", "entropy"}


# --- the head-pruning procedure --------------------------------------------------------------

def test_prune_experiment_small():
    r = training.prune_experiment(4, d_model=16, epochs=30, lr=0.02, n_train=100, n_test=60,
                               seed=0, progress=False)
    model, curve = r["model"], r["curve"]
    xt, yt = r["test_data"]
    assert xt.shape == (60, 12)
    assert r["baseline_accuracy"] == model.accuracy(xt, yt)
    # ablation importance: accuracy with each head zeroed, by hand
    for h in range(4):
        model.attention.head_mask[:] = 1
        model.attention.head_mask[h] = 0
        assert r["ablation"][h] == pytest.approx(r["baseline_accuracy"] - model.accuracy(xt, yt))
    model.attention.head_mask[:] = 1
    assert r["ablation"][r["ranking"][0]] == r["ablation"].max()
    assert r["gradient"].shape == (4,) and np.linalg.norm(r["gradient"]) == pytest.approx(1.0)
    # the pruning curve: one head per step, to the end; prunable heads keep accuracy within 1%
    np.testing.assert_array_equal(curve.n_pruned, [0, 1, 2, 3, 4])
    assert r["baseline_accuracy"] - curve.metric[curve.prunable] <= 0.01 + 1e-12
    if curve.prunable < 4:
        assert r["baseline_accuracy"] - curve.metric[curve.prunable + 1] > 0.01
    assert len(r["surviving_heads"]) == 4 - r["prunable"]
    # removing the pruned heads for real scores what masking them scored
    assert r["pruned_accuracy"] == pytest.approx(curve.metric[curve.prunable])
    assert r["attention"].shape == (4, 12, 12) and r["offsets"].shape == (4, 12)
    figs = training_figures.prune_figures(r)
    assert set(figs) == {"importance", "pruning", "surviving"}


# --- speed -----------------------------------------------------------------------------------

def test_benchmark_epoch_runs():
    pytest.importorskip("torch")
    b = epoch_speed.benchmark_epoch(2, d_model=16, n_samples=20, threads=1, repeats=2, warmup=1)
    assert len(b["mha_times"]) == len(b["torch_times"]) == 2
    assert b["mha_seconds"] > 0 and b["torch_seconds"] > 0
    assert b["speedup"] == pytest.approx(b["torch_seconds"] / b["mha_seconds"])
    assert mha.get_num_threads() == 1                                    # restored
