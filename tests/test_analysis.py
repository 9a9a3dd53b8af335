"""mha.analysis on constructed attention whose answers are known, and on a real layer."""
import math

import numpy as np
import pytest

import mha
from mha import analysis


def shifted(n, k):
    """A head that attends from i to i + k (rows without such a key attend to themselves)."""
    w = np.zeros((n, n))
    for i in range(n):
        j = i + k
        w[i, j if 0 <= j < n else i] = 1.0
    return w


def first_token(n):
    w = np.zeros((n, n))
    w[:, 0] = 1.0
    return w


def uniform(n):
    return np.full((n, n), 1.0 / n)


def softmax(s):
    e = np.exp(s - s.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def random_attention(rng, *shape):
    return softmax(rng.standard_normal(shape) * 2)


# --- the package -----------------------------------------------------------------------------

def test_every_name_is_importable_from_mha_analysis():
    names = ["head_similarity", "head_diversity", "head_distance", "entropy", "confidence",
             "PATTERNS", "pattern_scores", "dominant_pattern", "attention_mass",
             "head_importance_ablation", "head_importance_gradient", "head_mask_grads",
             "use_head_mask", "PruningCurve", "pruning_curve", "HEAD_FUSIONS",
             "attention_rollout", "attention_flow", "value_norms", "CLARK_METRICS",
             "token_classes", "head_statistic_sums", "row_statistic_sums",
             "model_head_statistic_sums", "clark_metrics", "broad_heads",
             "classical_mds", "head_map", "metric_mds", "CONVENTIONS", "detect_head",
             "head_detection_pattern", "HEAD_NAMES", "head_importance",
             "pruning_against_random", "gradient_relevance", "attention_x_gradient",
             "AttentionGradient", "integrated_gradients", "IntegratedGradients", "IG_METHODS",
             "attribution_patching", "attn_lrp", "AttnLRP"]
    assert sorted(analysis.__all__) == sorted(names)
    for name in names:
        assert getattr(analysis, name) is not None
    # each concern's module lists its own names, and the package lists them all once
    modules = [analysis.similarity, analysis.per_head, analysis.importance, analysis.pruning,
               analysis.beyond, analysis.clark, analysis.headmap, analysis.detectors,
               analysis.attribution, analysis.lrp]
    listed = [n for m in modules for n in m.__all__]
    assert sorted(listed + ["CONVENTIONS"]) == sorted(names)


def test_to_numpy_takes_tensor_like_objects():
    from mha.analysis._inputs import _to_numpy

    class Tensor:                                          # what torch.Tensor offers
        def __init__(self, a):
            self.a = a

        def detach(self):
            return self

        def cpu(self):
            return self

        def numpy(self):
            return self.a

    w = np.full((2, 2), 0.5)
    assert np.array_equal(_to_numpy(Tensor(w)), w) and np.array_equal(_to_numpy([1, 2]), [1, 2])
    assert analysis.entropy(Tensor(w)) == pytest.approx(math.log(2), rel=1e-15)


# --- pattern scores -------------------------------------------------------------------------

def test_pure_heads_score_one_on_their_pattern():
    n = 7
    heads = np.stack([shifted(n, -1), shifted(n, +1), first_token(n), shifted(n, 0)])
    s = analysis.pattern_scores(heads)
    assert s["previous_token"][0] == pytest.approx(1.0)
    assert s["next_token"][1] == pytest.approx(1.0)
    assert s["first_token"][2] == pytest.approx(1.0)
    assert s["local"][3] == pytest.approx(1.0)           # self attention is local
    assert s["previous_token"][1] == 0 and s["next_token"][0] == 0
    assert list(analysis.dominant_pattern(heads)) == ["previous_token", "next_token",
                                                       "first_token", "local"]


def test_pattern_scores_match_their_definition_in_loops(rng):
    # local: row i's weight on i-1 and i; first token: on key 0; previous token: on i-1,
    # averaged over the rows i >= 1 that have one
    def by_loops(attn):
        n = attn.shape[0]
        return {
            "local": np.mean([attn[i, max(0, i - 1):i + 1].sum() for i in range(n)]),
            "first_token": np.mean(attn[:, 0]),
            "previous_token": np.mean([attn[i, i - 1] for i in range(1, n)]),
        }
    w = random_attention(rng, 2, 3, 9, 9)
    ours = analysis.pattern_scores(w)
    for l in range(2):
        for h in range(3):
            expected = by_loops(w[l, h])
            for name, value in expected.items():
                assert ours[name][l, h] == pytest.approx(value, abs=1e-12), name
    assert ours["next_token"][1, 2] == pytest.approx(np.mean([w[1, 2, i, i + 1] for i in range(8)]))


def test_pattern_scores_shapes_and_scalar():
    w = np.broadcast_to(shifted(5, -1), (2, 3, 5, 5))
    assert analysis.pattern_scores(w)["local"].shape == (2, 3)
    assert analysis.dominant_pattern(w).shape == (2, 3)
    assert analysis.dominant_pattern(shifted(5, -1)) == "previous_token"
    assert isinstance(analysis.dominant_pattern(first_token(5)), str)


def test_pattern_scores_non_square_are_bottom_right_aligned():
    # 2 new queries over 5 keys (a KV-cache step): query i sits at key position i + 3
    w = np.zeros((2, 5))
    w[0, 2] = w[1, 3] = 1.0                               # each attends to its previous token
    assert analysis.pattern_scores(w)["previous_token"] == pytest.approx(1.0)


# --- entropy and confidence -----------------------------------------------------------------

def test_entropy_of_uniform_rows_is_ln_n_and_of_one_hot_is_zero():
    n = 11
    w = np.stack([uniform(n), shifted(n, -1)])
    assert analysis.entropy(w) == pytest.approx([math.log(n), 0.0])
    assert analysis.entropy(w, per_query=True).shape == (2, n)
    assert analysis.confidence(w) == pytest.approx([1.0 / n, 1.0])


def test_entropy_matches_definition_and_skips_masked_rows(rng):
    n = 6
    w = random_attention(rng, 4, n, n)
    expected = -(w * np.log(w)).sum(axis=-1).mean(axis=-1)
    assert analysis.entropy(w) == pytest.approx(expected, rel=1e-12)
    # causal uniform rows: entropy ln(i + 1); a fully masked row (all zero) is left out
    causal = np.tril(np.ones((n, n)))
    causal /= causal.sum(axis=-1, keepdims=True)
    assert analysis.entropy(causal) == pytest.approx(np.mean(np.log(np.arange(1, n + 1))))
    masked = causal.copy()
    masked[2] = 0.0
    keep = [i for i in range(n) if i != 2]
    assert analysis.entropy(masked) == pytest.approx(np.mean(np.log(np.arange(1, n + 1)[keep])))
    assert analysis.confidence(masked) == pytest.approx(np.mean(1.0 / np.arange(1, n + 1)[keep]))


def test_layers_by_heads_shapes(rng):
    w = random_attention(rng, 3, 4, 5, 5)
    assert analysis.entropy(w).shape == (3, 4)
    assert analysis.confidence(w).shape == (3, 4)
    assert analysis.head_similarity(w).shape == (3, 4, 4)
    assert analysis.head_distance(w).shape == (3, 4, 4)
    assert np.ndim(analysis.entropy(w[0, 0])) == 0
    # a list of per-layer arrays (Hugging Face style) is stacked
    assert analysis.entropy([w[0], w[1]]).shape == (2, 4)


# --- similarity and distance ----------------------------------------------------------------

def test_identical_heads_similarity_one_distance_zero(rng):
    a = random_attention(rng, 6, 6)
    b = shifted(6, -1)
    w = np.stack([a, a, b])
    sim = analysis.head_similarity(w)
    dist = analysis.head_distance(w)
    assert sim[0, 1] == pytest.approx(1.0, abs=1e-12)
    assert np.diag(sim) == pytest.approx(np.ones(3))
    assert dist[0, 1] == pytest.approx(0.0, abs=1e-12)
    assert np.diag(dist) == pytest.approx(np.zeros(3))
    assert np.array_equal(sim, sim.T) and np.array_equal(dist, dist.T)


def test_disjoint_heads_similarity_zero_distance_one():
    other = np.zeros((5, 5))
    for i, j in enumerate([1, 2, 3, 4, 3]):               # never attends to itself
        other[i, j] = 1.0
    w = np.stack([shifted(5, 0), other])
    assert analysis.head_similarity(w)[0, 1] == pytest.approx(0.0)
    assert analysis.head_distance(w)[0, 1] == pytest.approx(1.0)


def test_similarity_is_the_cosine_of_flattened_maps(rng):
    w = random_attention(rng, 5, 7, 7)
    flat = w.reshape(5, -1)
    flat = flat / (np.linalg.norm(flat, axis=1, keepdims=True) + 1e-8)
    assert analysis.head_diversity(w) == pytest.approx(flat @ flat.T, abs=1e-7)


def test_js_distance_matches_pairwise_definition(rng):
    w = random_attention(rng, 3, 4, 6)                   # cross-attention shape is fine

    def js(p, q):
        m = (p + q) / 2
        return 0.5 * np.sum(p * np.log2(p / m)) + 0.5 * np.sum(q * np.log2(q / m))
    expected = np.array([[np.mean([js(w[i, r], w[j, r]) for r in range(4)]) for j in range(3)]
                         for i in range(3)])
    assert analysis.head_distance(w) == pytest.approx(expected, abs=1e-12)


# --- attention mass -------------------------------------------------------------------------

def test_attention_mass_on_chosen_tokens():
    n = 5
    w = np.stack([first_token(n), uniform(n)])
    assert analysis.attention_mass(w, 0) == pytest.approx([1.0, 0.2])
    assert analysis.attention_mass(w, [0, 4]) == pytest.approx([1.0, 0.4])
    sel = np.array([True, False, False, False, True])
    assert analysis.attention_mass(w, sel) == pytest.approx([1.0, 0.4])
    # from one query ("she") to one key ("doctor")
    prev = shifted(n, -1)
    assert analysis.attention_mass(prev, 1, queries=2) == pytest.approx(1.0)
    assert analysis.attention_mass(prev, 1, queries=[3]) == pytest.approx(0.0)
    with pytest.raises(IndexError):
        analysis.attention_mass(w, 7)


# --- importance -----------------------------------------------------------------------------

def test_ablation_importance_is_the_metric_drop():
    value = np.array([[0.30, 0.00, 0.05], [0.10, 0.20, 0.01]])
    calls = []

    def evaluate(mask):
        calls.append(mask.copy())
        return 0.5 + float((value * mask).sum())          # each head adds its value
    imp = analysis.head_importance_ablation(evaluate, value.shape)
    assert imp == pytest.approx(value)
    assert len(calls) == 1 + value.size
    assert calls[0].shape == (2, 3) and np.all(calls[0] == 1)
    loss = analysis.head_importance_ablation(lambda m: -evaluate(m), (2, 3), higher_is_better=False)
    assert loss == pytest.approx(value)
    # from a current mask: pruned heads are not measured
    current = np.ones((2, 3))
    current[0, 0] = 0
    imp = analysis.head_importance_ablation(evaluate, current)
    assert np.isnan(imp[0, 0]) and imp[1, 1] == pytest.approx(0.2)
    assert analysis.head_importance_ablation(lambda m: float(m.sum()), 4).shape == (4,)


def test_gradient_importance_is_mean_abs_normalised_per_layer():
    # two examples whose gradients cancel: |.| must be taken per example (Michel et al.)
    grads = np.array([[[1.0, -2.0], [3.0, 0.0]],
                      [[-1.0, 2.0], [-3.0, 4.0]]])        # (examples, layers, heads)
    raw = analysis.head_importance_gradient(grads, normalize=False)
    assert raw == pytest.approx(np.array([[1.0, 2.0], [3.0, 2.0]]))
    imp = analysis.head_importance_gradient(grads)
    assert imp == pytest.approx(raw / np.linalg.norm(raw, axis=-1, keepdims=True))
    assert np.linalg.norm(imp, axis=-1) == pytest.approx([1.0, 1.0])
    # any iterable, e.g. a generator of per-example gradients
    assert analysis.head_importance_gradient(g for g in grads) == pytest.approx(imp)
    with pytest.raises(ValueError):
        analysis.head_importance_gradient(iter([]))


# --- pruning --------------------------------------------------------------------------------

def test_pruning_curve_removes_least_important_first_and_counts_prunable():
    # 10 heads; four are useless, the others cost 0.004 .. 0.3 accuracy when removed
    value = np.array([0.0, 0.3, 0.0, 0.004, 0.1, 0.0, 0.02, 0.005, 0.0, 0.2])

    def accuracy(mask):
        return 0.4 + float((value * mask.ravel()).sum())
    curve = analysis.pruning_curve(accuracy, 10)            # 10% of 10 heads = 1 per step
    assert list(curve.n_pruned) == list(range(11))
    assert curve.metric[0] == pytest.approx(accuracy(np.ones(10)))
    assert [r[0][0] for r in curve.removed[1:5]] == [0, 2, 5, 8]   # the useless ones first
    assert curve.removed[5] == [(3,)]
    # drops: 0 after 4, 0.004 after 5, 0.009 after 6 (<= 0.01), 0.029 after 7
    assert curve.prunable == 6
    assert curve.prunable_mask.sum() == 4
    assert np.all(np.diff(curve.metric) <= 1e-12)          # accuracy only goes down here
    assert curve.drop()[6] == pytest.approx(0.009)
    assert curve.fraction_pruned[-1] == 1.0
    # relative tolerance, a fixed importance array, early stop, two heads a step
    fixed = analysis.pruning_curve(accuracy, 10, importance=value, step=2, max_drop=0.01,
                                   relative=True, stop_early=True)
    assert list(fixed.n_pruned[:3]) == [0, 2, 4]
    assert fixed.prunable == 6                            # a drop of 0.009 / 1.029 < 1%
    assert fixed.n_pruned[-1] == 8                        # stopped after the first big drop
    # a callable importance is recomputed on the current mask
    seen = []

    def importance(mask):
        seen.append(mask.sum())
        return value.reshape(mask.shape)
    analysis.pruning_curve(accuracy, (2, 5), importance=importance, step=0.5)
    assert seen == [10, 5]


def test_pruning_curve_with_a_loss():
    value = np.array([0.5, 0.0, 0.2, 0.001])
    curve = analysis.pruning_curve(lambda m: 1.0 - float((value * m).sum()), 4,
                                   higher_is_better=False, max_drop=0.01)
    assert curve.removed[1] == [(1,)] and curve.removed[2] == [(3,)]
    assert curve.prunable == 2


# --- on a real mha.MultiHeadAttention -------------------------------------------------------

@pytest.fixture
def layers_and_data():
    rng = np.random.default_rng(7)
    layers = [mha.MultiHeadAttention(12, 4, seed=s, dtype=np.float64) for s in (1, 2)]
    x = rng.standard_normal((3, 6, 12))
    target = rng.standard_normal((3, 6, 12))
    return layers, x, target


def _forward(layers, x):
    h = x
    for layer in layers:
        out, _ = layer(h)
        h = h + out                                       # residual, two layers deep
    return h


def _loss(layers, x, target):
    return 0.5 * float(np.sum((_forward(layers, x) - target) ** 2))


def _backward(layers, x, target):
    d = _forward(layers, x) - target                      # dL/dh_2
    for layer in reversed(layers):
        d_in, _, _ = layer.backward(d)
        d = d + d_in                                      # through the residual
    return analysis.head_mask_grads(layers)               # (layers, heads)


def test_gradient_importance_on_real_layers(layers_and_data):
    layers, x, target = layers_and_data
    per_example = [_backward(layers, x[b:b + 1], target[b:b + 1]) for b in range(3)]
    assert per_example[0].shape == (2, 4)
    # the head-mask gradient equals finite differences of the loss through use_head_mask
    eps = 1e-6
    for l, h in [(0, 1), (1, 3)]:
        plus, minus = np.ones((2, 4)), np.ones((2, 4))
        plus[l, h] += eps
        minus[l, h] -= eps
        with analysis.use_head_mask(layers, plus):
            f_plus = _loss(layers, x[:1], target[:1])
        with analysis.use_head_mask(layers, minus):
            f_minus = _loss(layers, x[:1], target[:1])
        assert per_example[0][l, h] == pytest.approx((f_plus - f_minus) / (2 * eps), rel=1e-5)
    assert np.all(layers[0].head_mask == 1) and np.all(layers[1].head_mask == 1)   # restored
    imp = analysis.head_importance_gradient(per_example)
    expected = np.mean(np.abs(per_example), axis=0)
    assert imp == pytest.approx(expected / np.linalg.norm(expected, axis=-1, keepdims=True))


def test_ablation_and_pruning_on_real_layers(layers_and_data):
    layers, x, target = layers_and_data

    def evaluate(mask):
        with analysis.use_head_mask(layers, mask):
            return -_loss(layers, x, target)              # higher is better
    imp = analysis.head_importance_ablation(evaluate, (2, 4))
    full = -_loss(layers, x, target)
    layers[1].head_mask[2] = 0.0                          # the same ablation by hand
    ablated = -_loss(layers, x, target)
    layers[1].head_mask[2] = 1.0
    assert imp[1, 2] == pytest.approx(full - ablated)
    curve = analysis.pruning_curve(evaluate, (2, 4), step=0.25, max_drop=0.05, relative=True)
    assert list(curve.n_pruned) == [0, 2, 4, 6, 8]
    assert curve.metric[0] == pytest.approx(evaluate(np.ones((2, 4))))
    assert curve.metric[-1] == pytest.approx(evaluate(np.zeros((2, 4))))
    assert 0 <= curve.prunable <= 8


def test_dominant_pattern_prefers_previous_token_within_rtol():
    # 99% on the previous token, 1% on itself: local (1.0) beats previous (0.99) by 1% only
    n = 8
    w = 0.99 * shifted(n, -1) + 0.01 * np.eye(n)
    w[0] = 0
    w[0, 0] = 1
    scores = analysis.pattern_scores(w)
    assert scores["local"] > scores["previous_token"]
    assert analysis.dominant_pattern(w) == "previous_token"
    assert analysis.dominant_pattern(w, rtol=0) == "local"            # the plain maximum
    # a head clearly on itself stays local
    assert analysis.dominant_pattern(0.5 * shifted(n, -1) + 0.5 * np.eye(n)) == "local"
