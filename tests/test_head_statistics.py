"""model.head_statistics (row statistics of every layer, head and query on one forward without
maps) and keep_weights (only the chosen layers, heads and query rows of the weights).

The statistics are held to `mha.reference.row_statistics` of the materialised maps of the same
forward: the maps every layer's kernel computed for the same q and k (a forward with
``keep_weights`` of every layer, head and row, which runs the model exactly as head_statistics
does and asks the kernel for those rows' weights). At 1,024 tokens on a tiny model of each
family, with a batch padded on the right (the second text 100 tokens shorter), grouped-query
attention (the LLaMA family, 4 query heads on 2 or 1 key heads), causal masks and sliding
windows (Qwen2, Mistral). Tolerances as tests/test_row_stats.py's: absolute on the
probabilities (max, masses, self, prev, next) 1e-6 in float32 and 1e-12 in float64; the entropy
relative to its scale log(n), the distance relative to n; the argmax must name a key whose
weight is the row's largest within the same tolerance.
"""
import sys
from unittest import mock

import numpy as np
import pytest

import mha
import mha.models
from mha.reference import row_statistics

import tiny_models
from conftest import assert_close

FAMILIES = ["bert", *tiny_models.FAMILIES]
N = 1024
TOL = {np.float32: 1e-6, np.float64: 1e-12}
PROBABILITIES = ("max", "self", "prev", "next")


def _build_long(family, folder):
    """The tiny model of ``family`` with N positions (tests/tiny_models.py's has 64)."""
    if family == "bert":
        import torch
        import transformers
        tiny_models._tokenizer("distilbert", folder)
        torch.manual_seed(0)
        config = transformers.BertConfig(vocab_size=300, hidden_size=32, num_hidden_layers=2,
                                         num_attention_heads=4, intermediate_size=48,
                                         max_position_embeddings=N)
        model = transformers.BertModel(config).eval()
        tiny_models.perturb(model, 3)
        model.save_pretrained(folder, safe_serialization=True)
        return
    config_class, model_class, kwargs = tiny_models.FAMILIES[family]
    key = "n_positions" if family == "gpt2" else "max_position_embeddings"
    kwargs = {**kwargs, key: N + (2 if family == "roberta" else 0)}
    if "original_max_position_embeddings" in kwargs:        # Phi-3: no long-RoPE switch
        kwargs["original_max_position_embeddings"] = N
    with mock.patch.dict(tiny_models.FAMILIES, {family: (config_class, model_class, kwargs)}):
        tiny_models.build(family, folder)


@pytest.fixture(scope="module")
def long_model(tmp_path_factory):
    """(family, dtype) -> the tiny model with N positions, built once per family."""
    folders = {}

    def folder(family):
        if family not in folders:
            folders[family] = tmp_path_factory.mktemp(f"long-{family}")
            _build_long(family, folders[family])
        return folders[family]

    def get(family, dtype):
        return mha.models.load(folder(family), dtype=dtype)
    get.folder = folder
    return get


def _batch(model, rng, n=N, short=100):
    """Random ids (2, n), the second text ``short`` tokens shorter (padded on the right)."""
    ids = rng.integers(5, model.config.vocab_size, size=(2, n))
    mask = np.ones((2, n), bool)
    mask[1, n - short:] = False
    ids[1, n - short:] = model.config.pad_token_id
    return ids, mask


def _maps(model, ids, mask):
    """The weights (B, L, H, n, n) of every layer, as the kernel computes them for the forward
    that head_statistics runs (the kept weights of every head and row)."""
    enc, _ = model.run_with_cache(ids, attention_mask=mask, names=[], logits=False,
                                  keep_weights={layer: None for layer in range(model.n_layers)})
    assert enc.attentions is None
    return np.stack([enc.kept_weights[layer] for layer in range(model.n_layers)], axis=1)


def _check(stats, maps, sets, dtype):
    """Every statistic of head_statistics against row_statistics of the maps."""
    tol = TOL[dtype]
    n = maps.shape[-1]
    names = [s for s in stats if not s.startswith("mass:")]
    expected = row_statistics(maps, [s for s in names if s != "argmax"])
    for name in names:
        got = stats[name]
        assert got.shape == maps.shape[:-1], name
        assert got.dtype == (np.int64 if name == "argmax" else dtype), name
        if name == "argmax":
            chosen = np.take_along_axis(maps, got[..., None], axis=-1)[..., 0]
            assert_close(chosen, maps.max(axis=-1), tol, name, scale=1.0)
        else:
            scale = {"entropy": np.log(n), "distance": n}.get(name, 1.0)
            assert_close(got, expected[name], tol, name, scale=scale)
    for name, keys in sets.items():
        batch_keys = np.broadcast_to(keys, (maps.shape[0], n))
        want = np.stack([row_statistics(maps[b], "key_set_mass", key_set=batch_keys[b])
                         ["key_set_mass"] for b in range(maps.shape[0])])
        assert_close(stats[f"mass:{name}"], want, tol, f"mass:{name}", scale=1.0)


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("family", FAMILIES)
def test_equal_to_the_maps_at_1024_tokens(long_model, family, dtype, rng):
    model = long_model(family, dtype)
    ids, mask = _batch(model, rng)
    random_keys = rng.random((2, N)) < 0.05
    first = np.zeros(N, bool)
    first[0] = True
    punctuation = mha.analysis.token_classes(
        [[model.tokenizer.id_to_token(int(i)) for i in row] for row in ids])["punct"] & mask
    stats = model.head_statistics(ids, attention_mask=mask, key_sets={
        "first": "first", "random": random_keys, "punctuation": "punctuation"})
    assert sorted(stats) == sorted(["entropy", "max", "argmax", "self", "prev", "next",
                                    "distance", "mass:first", "mass:random",
                                    "mass:punctuation"])
    assert punctuation.any()
    maps = _maps(model, ids, mask)
    assert maps.shape == (2, model.n_layers, model.n_heads, N, N)
    _check(stats, maps, {"first": first, "random": random_keys & mask,
                         "punctuation": punctuation}, dtype)


@pytest.mark.parametrize("family", FAMILIES)
def test_texts_one_or_a_batch_and_built_in_sets(tiny, family):
    model = mha.models.load(tiny(family)[0], dtype=np.float64)
    texts = tiny_models.TEXTS
    batch = model.head_statistics(texts, stats=["entropy", "argmax"],
                                  key_sets=["first", "special", "punctuation"])
    enc = model.encode(texts)
    B, n = enc.input_ids.shape
    L, H = model.n_layers, model.n_heads
    assert {k: v.shape for k, v in batch.items()} == dict.fromkeys(
        ["entropy", "argmax", "mass:first", "mass:special", "mass:punctuation"], (B, L, H, n))
    tokenized = [np.array(t.special + [False] * (n - len(t))) for t in enc.tokenized]
    classes = mha.analysis.token_classes(enc.tokens, n)
    sets = {"first": np.eye(1, n, dtype=bool)[0], "special": np.stack(tokenized),
            "punctuation": classes["punct"]}
    assert sets["punctuation"].any()
    # GPT-2 and GPT-NeoX (Pythia) add no special token
    assert sets["special"][:, 0].all() or family.startswith(("gpt2", "gpt_neox"))
    stats = dict(batch)
    _check(stats, _maps(model, enc.input_ids, enc.attention_mask), sets, np.float64)
    # one text: (L, H, n), the same as its row of the batch (its real tokens)
    one = model.head_statistics(texts[1], stats="entropy", key_sets="special")
    m = len(enc.tokens[1])
    assert one["entropy"].shape == (L, H, m)
    assert_close(one["entropy"], batch["entropy"][1, ..., :m], 1e-12, scale=np.log(n))
    assert_close(one["mass:special"], batch["mass:special"][1, ..., :m], 1e-12, scale=1.0)
    # ids of one text give the same; their "special" set read from the vocabulary
    ids = model.head_statistics(enc.input_ids[1, :m], stats="entropy", key_sets="special")
    assert_close(ids["mass:special"], one["mass:special"], 1e-12, scale=1.0)


def test_the_sink_of_a_causal_model_is_its_first_column(tiny):
    model = mha.models.load(tiny("gpt2")[0])
    stats = model.head_statistics("The cat sat on the mat.", stats=[], key_sets="first")
    _, weights = model.attentions("The cat sat on the mat.")
    assert list(stats) == ["mass:first"]
    assert_close(stats["mass:first"], weights[..., 0], 1e-6, scale=1.0)
    assert_close(stats["mass:first"][..., 0], np.ones(stats["mass:first"].shape[:2]), 1e-6)


def test_bad_input_names_the_argument(tiny):
    model = mha.models.load(tiny("llama")[0])
    text = "The cat sat."
    n = len(model.tokenize(text))
    with pytest.raises(ValueError, match=r"stats: unknown statistic 'sink'"):
        model.head_statistics(text, stats=["entropy", "sink"])
    with pytest.raises(ValueError, match=r"stats: 'key_set_mass' is asked with key_sets"):
        model.head_statistics(text, stats="key_set_mass")
    with pytest.raises(ValueError, match=rf"key_sets\['nouns'\] has shape \(3,\) but the text "
                                         rf"has {n} tokens"):
        model.head_statistics(text, key_sets={"nouns": np.ones(3, bool)})
    with pytest.raises(ValueError, match=r"key_sets\['x'\] = 'firsts': the built-in key sets"):
        model.head_statistics(text, key_sets={"x": "firsts"})
    with pytest.raises(TypeError, match=r"key_sets\['x'\] must be a bool array"):
        model.head_statistics(text, key_sets={"x": np.ones(n)})
    with pytest.raises(ValueError, match="ask for nothing"):
        model.head_statistics(text, stats=[])
    with pytest.raises(TypeError, match="attention_mask is for ids"):
        model.head_statistics(text, attention_mask=np.ones(n, bool))
    with pytest.raises(IndexError, match=r"keep_weights: layer must be an int in \[0, 2\)"):
        model.encode(text, keep_weights={2: None})
    with pytest.raises(IndexError, match=r"keep_weights\[1\]: heads: 4 is out of range for 4"):
        model.encode(text, keep_weights={1: [0, 4]})
    with pytest.raises(IndexError, match=rf"keep_weights\[0\]: rows: {n} is out of range "
                                         rf"for {n}"):
        model.encode(text, keep_weights={0: (None, [n])})
    with pytest.raises(TypeError, match="keep_weights must be a dict"):
        model.encode(text, keep_weights=[0])


# --- keep_weights ------------------------------------------------------------------------------

@pytest.mark.parametrize("family", FAMILIES)
def test_kept_weights_are_the_rows_of_the_full_maps(tiny, family):
    model = mha.models.load(tiny(family)[0], dtype=np.float64)
    enc_full = model.encode(tiny_models.TEXTS)
    n = enc_full.n_tokens
    last = model.n_layers - 1
    keep = {-1: (3, slice(-5, None)), 0: ([2, 0], [0, 4, -1])}        # -1: the last layer
    enc = model.encode(tiny_models.TEXTS, keep_weights=keep)
    assert enc.attentions is None and sorted(enc.kept_weights) == [0, last]
    full = enc_full.attentions
    assert_close(enc.kept_weights[last], full[:, last, 3:4, n - 5:], 1e-12)
    assert_close(enc.kept_weights[0], full[:, 0][:, [2, 0]][:, :, [0, 4, n - 1]], 1e-12)
    assert enc.kept_weights[last].shape == (3, 1, 5, n)
    # every head and row of a layer, from ids with padding
    enc, _ = model.run_with_cache(enc_full.input_ids, attention_mask=enc_full.attention_mask,
                                  names=[], keep_weights={1: None})
    assert_close(enc.kept_weights[1], full[:, 1], 1e-12)
    assert_close(enc.hidden_states, enc_full.hidden_states, 1e-12)


@pytest.mark.parametrize("family", ["bert", "qwen2", "llama-mqa-tied"])
def test_run_with_cache_keeps_only_the_chosen_part(tiny, family):
    model = mha.models.load(tiny(family)[0], dtype=np.float64)
    text = tiny_models.TEXTS[2]
    _, full = model.run_with_cache(text, names=lambda name: "pattern" in name)
    enc, cache = model.run_with_cache(text, keep_weights={1: ([1, 2], slice(-4, None))})
    n = enc.n_tokens
    assert cache["pattern", 1].shape == (1, 2, 4, n)
    assert_close(cache["pattern", 1], full["pattern", 1][:, 1:3, -4:], 1e-12)
    # the cache holds the encoding's kept rows, with a batch axis (one text)
    assert np.array_equal(cache["pattern", 1][0], enc.kept_weights[1])
    assert "blocks.0.attn.hook_pattern" not in cache            # not chosen
    assert not any("attn_scores" in name for name in cache)     # no full map
    assert "blocks.0.hook_resid_pre" in cache                   # the rest as asked
    # a hook on the pattern sees the whole map; the cache keeps the chosen part of it
    seen = []
    enc, cache = model.run_with_cache(
        text, names=["blocks.1.attn.hook_pattern"], keep_weights={1: (0, [0])},
        fwd_hooks=[("blocks.1.attn.hook_pattern", lambda p, name: seen.append(p.shape))])
    assert seen == [(1, model.n_heads, n, n)]
    assert_close(cache["pattern", 1], full["pattern", 1][:, :1, :1], 1e-12)


#: run in a fresh interpreter: load the model (float32), warm the call up on 8 tokens, reset
#: the process's peak resident set (echo 5 > /proc/self/clear_refs), call on N tokens and print
#: the growth of the peak (VmHWM) over the resident set before the call (VmRSS), in bytes. The
#: resident set counts every page the process touches, the C core's malloc included
#: (tracemalloc sees only Python's and NumPy's allocators). Not ru_maxrss: execve carries the
#: forking parent's peak into it (a pytest process with torch loaded: 320 MiB).
_RSS = """
import sys
import numpy as np
import mha.models
folder, call, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
model = mha.models.load(folder, dtype=np.float32)
ids = np.random.default_rng(1).integers(5, model.config.vocab_size, size=n)
sets = {"first": "first", "punctuation": "punctuation",
        "random": np.random.default_rng(2).random(n) < 0.1}
keep = {"forward": None, "keep_rows": {1: (3, slice(-16, None))}, "keep_layer": {1: None}}
def run(ids):
    if call == "head_statistics":
        return model.head_statistics(ids, key_sets={k: v if isinstance(v, str) else v[:len(ids)]
                                                    for k, v in sets.items()})
    return model.run_with_cache(ids, names=[], logits=False, keep_weights=keep[call])[0]
run(ids[:8])
def status(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
resident = status("VmRSS:")
out = run(ids)
print(status("VmHWM:") - resident)
"""


def _peak_growth(folder, call):
    """The peak RSS growth (bytes) of ``call`` on N tokens, each in a fresh subprocess: a
    forward without weights ("forward"), one keeping 16 rows of one head ("keep_rows") or all
    of layer 1's weights ("keep_layer"), or head_statistics with three key sets."""
    import subprocess
    res = subprocess.run([sys.executable, "-c", _RSS, str(folder), call, str(N)],
                         capture_output=True, text=True, check=True, timeout=300)
    return int(res.stdout.split()[-1])


needs_linux = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                 reason="/proc/self/clear_refs and VmHWM: Linux")


@pytest.fixture(scope="module")
def growth(long_model):
    """call -> peak RSS growth (bytes) on the long qwen2 model, each measured once; and the
    size of one layer's maps, H n^2 float32 = 16 MiB."""
    folder = long_model.folder("qwen2")
    model = long_model("qwen2", np.float32)
    measured = {call: _peak_growth(folder, call)
                for call in ("forward", "keep_rows", "keep_layer", "head_statistics")}
    return measured, model.n_heads * N * N * 4


@needs_linux
def test_kept_memory_is_what_is_kept(growth):
    """At 1,024 tokens a forward keeping 16 rows of one head (64 KiB) grows the peak as a
    forward without weights does, within a quarter of one head's map (1 MiB; measured -0.25 to
    0.0 MiB from the forward's 2.6 MiB); the control, a forward keeping all of layer 1's
    weights, grows it by at least one layer's maps (16 MiB; measured 17.5 MiB above): the
    measure sees what the forward allocates."""
    measured, one_layer_maps = growth
    one_head_map = one_layer_maps // 4
    assert measured["keep_layer"] - measured["forward"] >= one_layer_maps, measured
    assert measured["keep_rows"] - measured["forward"] < one_head_map / 4, measured


@needs_linux
def test_head_statistics_memory_is_that_of_a_forward_without_weights(growth):
    """At 1,024 tokens, three key sets (the kernel's and one more pass with two value
    columns): the statistics (O(n) per head) grow the peak resident set as a forward without
    weights does, within a quarter of one head's (n, n) map (1 MiB; measured 0.13 to 0.24
    MiB): no map is allocated, by the C core either."""
    measured, one_layer_maps = growth
    assert measured["head_statistics"] - measured["forward"] < one_layer_maps / 16, measured
