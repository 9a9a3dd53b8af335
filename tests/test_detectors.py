"""mha.analysis.detect_head: against TransformerLens 4.3's head detector on the same random
GPT-2-shaped weights (its bridge booted offline, weight processing off), the built-in
patterns' values, head selection, caches and texts, and bad input."""
import os

import numpy as np
import pytest

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

import mha.models
from mha.analysis import HEAD_NAMES, detect_head, head_detection_pattern

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import tiny_models  # noqa: E402

TEXT = "the cat sat on the mat, the cat sat on the mat"


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gpt2")
    return folder, tiny_models.build("gpt2", folder)


def test_equal_to_transformer_lens(gpt2):
    """The three built-in patterns with both exclusions: "mul" within 3e-7 (absolute, scores of
    0.05 to 0.3; measured at most 3.1e-8), "abs" within the 3-decimal rounding TransformerLens
    applies (mha does not round; measured 5.0e-4)."""
    bridge = pytest.importorskip("transformer_lens.model_bridge")
    head_detector = pytest.importorskip("transformer_lens.head_detector")
    folder, model_class = gpt2
    lens = bridge.TransformerBridge.boot_transformers(
        str(folder), hf_model=tiny_models.load_reference(model_class, folder), device="cpu")
    lens.enable_compatibility_mode(no_processing=True)
    model = mha.models.load(folder)
    ids = lens.to_tokens(TEXT)[0].numpy()                    # with the BOS it prepends
    for name in HEAD_NAMES:
        for exclude_bos in (False, True):
            for exclude_current_token in (False, True):
                for measure, tol in (("mul", 3e-7), ("abs", 5e-4 + 1e-6)):
                    kwargs = dict(exclude_bos=exclude_bos, error_measure=measure,
                                  exclude_current_token=exclude_current_token)
                    with torch.no_grad():
                        theirs = head_detector.detect_head(lens, TEXT, name, **kwargs).numpy()
                    ours = detect_head(model, ids, name, **kwargs)
                    assert ours.shape == (model.n_layers, model.n_heads)
                    assert np.abs(ours - theirs).max() < tol, (name, kwargs)
                    assert np.ptp(ours) > 0.01                 # the heads differ


def test_patterns():
    ids = [3, 5, 3, 5, 9]
    assert np.array_equal(head_detection_pattern("previous_token_head", ids), np.eye(5, k=-1))
    duplicate = np.zeros((5, 5))
    duplicate[2, 0] = duplicate[3, 1] = 1
    assert np.array_equal(head_detection_pattern("duplicate_token_head", ids), duplicate)
    induction = np.zeros((5, 5))
    induction[2, 1] = induction[3, 2] = 1
    assert np.array_equal(head_detection_pattern("induction_head", ids), induction)


def test_scores_by_hand_heads_cache_and_texts(gpt2):
    model = mha.models.load(gpt2[0])
    ids = np.asarray(model.tokenizer(TEXT).ids)
    _, cache = model.run_with_cache(ids, names=lambda name: name.endswith("hook_pattern"))
    scores = detect_head(model, ids, "previous_token_head")
    weights = cache["pattern", 1][0, 2].astype(np.float64)
    assert abs(scores[1, 2] - np.trace(weights, offset=-1) / weights.sum()) < 1e-12
    no_bos = weights.copy()
    no_bos[:, 0] = 0
    assert abs(detect_head(model, ids, "previous_token_head", exclude_bos=True)[1, 2]
               - np.trace(no_bos, offset=-1) / no_bos.sum()) < 1e-12
    abs_score = 1 - np.abs(weights - np.eye(len(ids), k=-1)).sum() / len(ids)
    assert abs(detect_head(model, ids, "previous_token_head", error_measure="abs")[1, 2]
               - abs_score) < 1e-12
    # a pattern of one's own equals the named one; a cache spares the forward
    custom = head_detection_pattern("induction_head", ids)
    assert np.array_equal(detect_head(model, ids, custom, cache=cache),
                          detect_head(model, ids, "induction_head"))
    # heads: the others are -1, in either form
    chosen = detect_head(model, ids, "previous_token_head", heads=[(0, 1), (1, 3)])
    same = detect_head(model, ids, "previous_token_head", heads={0: [1], 1: [3]})
    assert np.array_equal(chosen, same)
    mask = np.zeros_like(chosen, dtype=bool)
    mask[0, 1] = mask[1, 3] = True
    assert np.all(chosen[~mask] == -1) and np.array_equal(chosen[mask], scores[mask])
    # a text is tokenized; a list of texts averages their scores
    assert np.array_equal(detect_head(model, TEXT, "previous_token_head"), scores)
    texts = [TEXT, tiny_models.TEXTS[1]]
    assert np.allclose(detect_head(model, texts, "duplicate_token_head"),
                       np.mean([detect_head(model, t, "duplicate_token_head") for t in texts],
                               axis=0), atol=0, rtol=0)


def test_an_encoder_takes_any_pattern(tmp_path):
    """In a bidirectional model a head may attend later keys: a full pattern is allowed."""
    tiny_models.build("distilbert", tmp_path)
    model = mha.models.load(tmp_path)
    ids = np.asarray(model.tokenizer(TEXT).ids)
    n = len(ids)
    next_token = detect_head(model, ids, np.eye(n, k=1))
    _, cache = model.run_with_cache(ids, names=lambda name: name.endswith("hook_pattern"))
    weights = cache["pattern", 0][0, 1].astype(np.float64)
    assert abs(next_token[0, 1] - np.trace(weights, offset=1) / n) < 1e-6


def test_bad_input_is_named(gpt2):
    model = mha.models.load(gpt2[0])
    ids = np.asarray(model.tokenizer(TEXT).ids)
    n = len(ids)
    with pytest.raises(ValueError, match=r"detection_pattern has shape \(4, 4\) but seq has "
                                         rf"{n} tokens: expected \({n}, {n}\)"):
        detect_head(model, ids, np.eye(4))
    with pytest.raises(ValueError, match="lower-triangular for a causal model"):
        detect_head(model, ids, np.eye(n, k=1))
    with pytest.raises(ValueError, match=r"one of \('previous_token_head'.*'induction'"):
        detect_head(model, ids, "induction")
    with pytest.raises(ValueError, match="error_measure must be 'mul' or 'abs', got 'l2'"):
        detect_head(model, ids, "induction_head", error_measure="l2")
    with pytest.raises(ValueError, match="at least 2 tokens"):
        detect_head(model, ids[:1], "induction_head")
    _, cache = model.run_with_cache(ids, names=lambda name: name.endswith("hook_pattern"))
    with pytest.raises(ValueError, match="list of texts"):
        detect_head(model, [TEXT, TEXT], "induction_head", cache=cache)
    with pytest.raises(ValueError, match=rf"pattern of layer 0 has shape \(4, {n}, {n}\); "
                                         rf"expected \(4, {n - 2}, {n - 2}\)"):
        detect_head(model, ids[:-2], "induction_head", cache=cache)
    with pytest.warns(UserWarning, match="other than 0 and 1"):
        detect_head(model, ids, 0.5 * np.eye(n, k=-1))
