"""mha.models.gguf against llama.cpp's own writer, the gguf package and transformers.

Tiny random LLaMA (Llama 3 style; Llama 3.1's scaled RoPE with tied embeddings; Llama 2
style with a SentencePiece tokenizer), Mistral, Qwen2 and Qwen3 models are written by
transformers, then converted by llama.cpp's convert_hf_to_gguf.py (from the llama-cpp-python
sdist on PyPI, tests/gguf_files.py) to F32, F16, BF16 and Q8_0 GGUF files. read_gguf must
give back:

- the header as the gguf package's GGUFReader reads it (every metadata value, every tensor's
  type and bytes);

- every tensor of the transformers model, under its name, in torch's layout (llama's q/k rows
  put back from ggml's rotary order): F32 exactly, F16 and BF16 equal to the weights rounded
  to those types (torch rounds them), Q8_0 bit for bit the gguf package's dequantisation of
  the file's bytes (an implementation independent of mha's) and within Q8_0's error bound of
  the original weights;
- the config: ``ModelConfig.from_dict`` reads the same model from it as from the folder's
  config.json, and transformers builds the same config from it;
- the tokenizer: the ids of transformers' tokenizer of the folder (SentencePiece's own for
  the llama2 family), special tokens included, and of llama.cpp's tokenizer on the file;
- Llama 3.1's RoPE scaling back from the rope_freqs tensor llama.cpp writes in its place.

The errors: a file that is not GGUF or is truncated, an architecture, a tensor type, a RoPE
scaling or a tensor mha does not read; a tokenizer it does not build (a warning).

With llama-cpp-python installed, llama.cpp's logits on each file are held to a float64
reference on the same (dequantised) weights: ``check_llama_cpp`` takes any callable
ids -> logits, so that mha's model can be held to the same reference.
"""
import dataclasses
from pathlib import Path

import numpy as np
import pytest

import gguf_files
from gguf_files import FAMILIES, OUTTYPES, TEXTS

gguf = pytest.importorskip("gguf")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from mha.models.config import ModelConfig  # noqa: E402
from mha.models.gguf import dequantize_q8_0, read_gguf  # noqa: E402
from mha.models.hub import CheckpointError  # noqa: E402

CASES = [(f, t) for f in FAMILIES for t in OUTTYPES]


@pytest.fixture(scope="session")
def files(tmp_path_factory):
    """{(family, outtype): GGUF path, (family, "hf"): the transformers folder}, made once."""
    return gguf_files.make_files(tmp_path_factory.mktemp("gguf"))


def _permute(w, n_heads):
    """convert_hf_to_gguf.py's LlamaModel.permute (transformers' rows -> ggml's), as written
    there: the direction opposite to read_gguf's gather, so that the two check each other."""
    return (w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def _file_order(name, w, config):
    """A tensor in the file's row order: permuted for llama's q_proj and k_proj."""
    if config["model_type"] in ("llama", "mistral"):
        if ".q_proj." in name:
            return _permute(w, config["num_attention_heads"])
        if ".k_proj." in name:
            return _permute(w, config["num_key_value_heads"])
    return w


def _bf16(w):
    return torch.from_numpy(w).to(torch.bfloat16).to(torch.float32).numpy()


# -- the tensors --------------------------------------------------------------------------------

@pytest.mark.parametrize("family, outtype", CASES)
def test_tensors_equal_the_transformers_weights(files, family, outtype):
    folder = files[family, "hf"]
    weights = gguf_files.hf_state_dict(folder)
    hf_config = gguf_files.hf_config(folder)
    ck = read_gguf(files[family, outtype]).checkpoint
    expected = set(weights) - ({"lm_head.weight"} if hf_config["tie_word_embeddings"] else set())
    assert set(ck) == expected
    stored = {t.name: t for t in gguf.GGUFReader(files[family, outtype]).tensors}
    code2 = {"f32": "F32", "f16": "F16", "bf16": "BF16", "q8_0": "Q8_0"}[outtype]
    worst = 0.0
    for name in sorted(ck):
        w = weights[name]
        code, raw = ck.raw(name)
        got = ck[name]
        assert got.dtype == np.float32 and got.shape == w.shape == ck.shape(name), name
        assert code == (code2 if w.ndim == 2 else "F32"), name       # vectors stay F32
        if code == "F32":
            np.testing.assert_array_equal(got, w, err_msg=name)
        elif code == "F16":
            assert raw.dtype == np.float16
            np.testing.assert_array_equal(got, w.astype(np.float16).astype(np.float32), name)
        elif code == "BF16":
            assert raw.dtype == np.uint16
            np.testing.assert_array_equal(got, _bf16(w), err_msg=name)
        else:
            assert raw.dtype == np.uint8 and raw.shape == (w.shape[0], w.shape[1] // 32 * 34)
            file_bytes = stored[ck.gguf_name(name)].data
            # the stored bytes, in the file's row order, are the file's
            np.testing.assert_array_equal(_file_order(name, raw, hf_config), file_bytes, name)
            oracle = gguf.quants.dequantize(file_bytes, gguf.GGMLQuantizationType.Q8_0)
            mine = _file_order(name, got, hf_config)
            assert oracle.dtype == np.float32
            np.testing.assert_array_equal(mine.view(np.uint32), oracle.view(np.uint32), name)
            err = np.abs(got.astype(np.float64) - w)
            bound = gguf_files.q8_0_bound(w)
            assert (err <= bound).all(), f"{name}: {(err / bound).max():.2f} of Q8_0's bound"
            worst = max(worst, float((err / bound).max()))
    if outtype == "q8_0":
        print(f"{family} Q8_0: worst error {worst:.2f} of the bound (d/2 + 127 d 2^-11)")


@pytest.mark.parametrize("family", ["llama31", "qwen2"])
def test_header_as_the_gguf_package_reads_it(files, family):
    """mha's own header parser against the gguf package's GGUFReader: every metadata value,
    every tensor's type, shape and bytes."""
    path = files[family, "q8_0"]
    reader = gguf.GGUFReader(path)
    ours = read_gguf(path)
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        theirs = field.contents()
        if isinstance(theirs, list) and isinstance(theirs[0], str):
            assert mha_header(path).metadata[key] == theirs, key
        elif isinstance(theirs, list):
            np.testing.assert_array_equal(mha_header(path).metadata[key], theirs, key)
        else:
            assert ours.metadata[key] == theirs, key
    for t in reader.tensors:
        if t.name == "rope_freqs.weight":
            continue
        name = {v: k for k, v in ((k, ours.checkpoint.gguf_name(k)) for k in ours.checkpoint)}[
            t.name]
        assert ours.checkpoint.raw(name)[0] == t.tensor_type.name
        np.testing.assert_array_equal(
            _file_order(name, ours.checkpoint.raw(name)[1], ours.config).view(np.uint8),
            t.data.view(np.uint8), t.name)


def mha_header(path):
    from mha.models.gguf import _Header
    return _Header(Path(path))


def test_tensors_are_read_not_mapped(files):
    """A tensor is read into an array of its own (a mapping's pages would stay resident beside
    the model's copy); reading it again gives equal values."""
    ck = read_gguf(files["qwen2", "f32"]).checkpoint
    w = ck["model.layers.0.mlp.up_proj.weight"]
    assert w.base is None or not isinstance(w.base, np.memmap)
    np.testing.assert_array_equal(w, ck["model.layers.0.mlp.up_proj.weight"])
    q8 = read_gguf(files["llama", "q8_0"]).checkpoint
    assert q8.file_of("model.norm.weight") == files["llama", "q8_0"]
    assert q8.files == [files["llama", "q8_0"]]
    assert q8.gguf_name("model.layers.1.self_attn.q_proj.weight") == "blk.1.attn_q.weight"


def test_dequantize_q8_0_is_the_gguf_packages():
    """Random blocks (zero, subnormal, huge, NaN and inf scales among them), several row
    lengths: bit for bit gguf.quants.dequantize."""
    rng = np.random.default_rng(1)
    for rows, n_blocks in [(1, 1), (7, 3), (64, 8), (300, 129)]:
        blocks = rng.integers(0, 256, (rows, n_blocks, 34), dtype=np.uint8)
        scales = rng.standard_normal((rows, n_blocks)).astype(np.float16)
        scales.flat[:6] = [0, 6e-8, 6e4, np.nan, np.inf, -0.0][:scales.size]
        blocks[..., :2] = scales[..., None].view(np.uint8).reshape(rows, n_blocks, 2)
        blocks = blocks.reshape(rows, n_blocks * 34)
        ours = dequantize_q8_0(blocks)
        with np.errstate(invalid="ignore"):         # inf * 0
            oracle = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType.Q8_0)
        np.testing.assert_array_equal(ours.view(np.uint32), oracle.view(np.uint32))
    with pytest.raises(ValueError, match="multiple of 34"):
        dequantize_q8_0(np.zeros((2, 33), np.uint8))


# -- the config and the tokenizer ---------------------------------------------------------------

@pytest.mark.parametrize("family", list(FAMILIES))
def test_config_reads_as_the_folders(files, family):
    hf_raw = gguf_files.hf_config(files[family, "hf"])
    for outtype in ("f32", "q8_0"):
        config = read_gguf(files[family, outtype]).config
        theirs, ours = ModelConfig.from_dict(hf_raw), ModelConfig.from_dict(config)
        if family == "mistral":         # written as GGUF's llama architecture (no window)
            assert config["model_type"] == "llama"
            theirs = dataclasses.replace(theirs, model_type="llama")
        assert ours == theirs
        # and transformers reads the dict as the model it was written from
        built = transformers.AutoConfig.for_model(**config)
        original = transformers.AutoConfig.from_pretrained(files[family, "hf"])
        for key in ("hidden_size", "intermediate_size", "num_hidden_layers",
                    "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps",
                    "max_position_embeddings", "vocab_size", "tie_word_embeddings",
                    "bos_token_id", "eos_token_id", "hidden_act", "rope_parameters"):
            if hasattr(original, key):              # Qwen2's config has no head_dim
                assert getattr(built, key) == getattr(original, key), key


@pytest.mark.parametrize("family", list(FAMILIES))
def test_tokenizer_gives_the_folders_ids(files, family):
    """transformers' tokenizer of the folder (byte-level BPE), or SentencePiece itself on the
    folder's tokenizer.model (llama2), give the ids of the tokenizer read from GGUF."""
    tok = read_gguf(files[family, "q8_0"]).tokenizer
    folder = files[family, "hf"]
    special = FAMILIES[family][3]
    if FAMILIES[family][2] == "spm":
        sentencepiece = pytest.importorskip("sentencepiece")
        sp = sentencepiece.SentencePieceProcessor(model_file=str(folder / "tokenizer.model"))

        def encode(text, add):
            return ([sp.bos_id()] if add else []) + sp.encode(text)

        def decode(ids):
            return sp.decode(ids)
        texts = [*TEXTS, "  two leading spaces", "tabs\tand \u00e9\u00e8 \u4e2d\u6587 \U0001f680"]
    else:
        hf = transformers.AutoTokenizer.from_pretrained(folder)

        def encode(text, add):
            return hf(text, add_special_tokens=add)["input_ids"]

        def decode(ids):
            return hf.decode(ids, skip_special_tokens=True)
        texts = [*TEXTS, f"{special[-1]}user\nhello{special[0]} there"]
    for text in texts:
        for add in (True, False):
            assert tok(text, add_special_tokens=add).ids == encode(text, add), (text, add)
        assert tok.decode(encode(text, True)) == decode(encode(text, True)), text
    assert tok.vocab_size == gguf_files.hf_config(folder)["vocab_size"]
    assert tok.max_length == gguf_files.hf_config(folder)["max_position_embeddings"]


def _converter_rope_factors(theta, head_dim, factor, low_freq_factor, high_freq_factor,
                            original_max_position_embeddings):
    """rope_freqs as convert_hf_to_gguf.py's LlamaModel.generate_extra_tensors writes it."""
    import math
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    low_freq_wavelen = original_max_position_embeddings / low_freq_factor
    high_freq_wavelen = original_max_position_embeddings / high_freq_factor
    rope_factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_freq_wavelen:
            rope_factors.append(1)
        elif wavelen > low_freq_wavelen:
            rope_factors.append(factor)
        else:
            smooth = ((original_max_position_embeddings / wavelen - low_freq_factor)
                      / (high_freq_factor - low_freq_factor))
            rope_factors.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(rope_factors, dtype=torch.float32).numpy()


@pytest.mark.parametrize("theta, head_dim, factor, low, high, old", [
    (500000.0, 128, 8.0, 1.0, 4.0, 8192),       # Llama 3.1 8B / 70B / 405B
    (500000.0, 64, 32.0, 1.0, 4.0, 8192),       # Llama 3.2 1B
    (10000.0, 32, 4.0, 1.0, 4.0, 256),          # two frequencies between the thresholds
    (500000.0, 32, 8.0, 1.0, 4.0, 64),          # one (the llama31 file's)
    (10000.0, 64, 16.0, 1.0, 2.0, 1024)])       # another high_freq_factor
def test_llama3_scaling_from_rope_freqs(theta, head_dim, factor, low, high, old):
    """rope_freqs (the factors llama.cpp writes for Llama 3.1's scaling) read back to
    parameters with which transformers computes the same inverse frequencies."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from mha.models.gguf import _llama3_scaling

    def inv_freq(**rope):
        config = transformers.LlamaConfig(hidden_size=head_dim * 2, num_attention_heads=2,
                                          max_position_embeddings=1 << 17,
                                          head_dim=head_dim, rope_parameters=dict(
                                              rope_theta=theta, **rope))
        return ROPE_INIT_FUNCTIONS["llama3"](config)[0].double().numpy()

    params = dict(factor=factor, low_freq_factor=low, high_freq_factor=high,
                  original_max_position_embeddings=old)
    rope_freqs = _converter_rope_factors(theta, head_dim, **params)
    got = _llama3_scaling(Path("x.gguf"), ("F32", rope_freqs, rope_freqs.shape), theta,
                          head_dim, None)
    assert got.pop("rope_type") == "llama3"
    np.testing.assert_allclose(inv_freq(rope_type="llama3", **got),
                               inv_freq(rope_type="llama3", **params), rtol=1e-6)
    if (got["high_freq_factor"], got["low_freq_factor"]) == (high, low):
        assert got == params
    with pytest.raises(NotImplementedError, match="not a llama3 RoPE scaling"):
        noisy = rope_freqs * np.linspace(1, 1.1, rope_freqs.size, dtype=np.float32)
        _llama3_scaling(Path("x.gguf"), ("F32", noisy, noisy.shape), theta, head_dim, None)


# -- the errors ---------------------------------------------------------------------------------

def test_not_gguf(tmp_path, files):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"PK\x03\x04 not a gguf file")
    with pytest.raises(CheckpointError, match="is not a GGUF file"):
        read_gguf(bad)
    with pytest.raises(FileNotFoundError):
        read_gguf(tmp_path / "missing.gguf")
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(files["llama", "f32"].read_bytes()[:200])
    with pytest.raises(CheckpointError, match="truncated"):
        read_gguf(truncated)
    truncated.write_bytes(files["llama", "f32"].read_bytes()[:-100])
    with pytest.raises(CheckpointError, match="output_norm.weight .* lies outside the file"):
        read_gguf(truncated)


def test_unsupported_architecture_and_types(tmp_path):
    path = gguf_files.write_gguf(tmp_path / "gemma.gguf", arch="gemma2")
    with pytest.raises(NotImplementedError, match="'gemma2' is not supported.*llama, qwen2"):
        read_gguf(path)
    blocks = np.zeros((8, 144), np.uint8)           # one Q4_K super-block a row of 256
    path = gguf_files.write_gguf(tmp_path / "q4k.gguf", tensors={
        "token_embd.weight": np.zeros((8, 32), np.float32),
        "blk.0.attn_q.weight": (blocks, "Q4_K")})
    with pytest.raises(NotImplementedError, match="blk.0.attn_q.weight is Q4_K.*not read yet"):
        read_gguf(path)
    path = gguf_files.write_gguf(tmp_path / "yarn.gguf", metadata={
        "llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0})
    with pytest.raises(NotImplementedError, match="RoPE scaling 'yarn'"):
        read_gguf(path)
    path = gguf_files.write_gguf(tmp_path / "moe.gguf", metadata={"llama.expert_count": 8})
    with pytest.raises(NotImplementedError, match="mixture of experts"):
        read_gguf(path)
    path = gguf_files.write_gguf(tmp_path / "odd.gguf", tensors={
        "token_embd.weight": np.zeros((8, 32), np.float32),
        "blk.0.ffn_gate_exps.weight": np.zeros((2, 64, 32), np.float32)})
    with pytest.raises(NotImplementedError, match="ffn_gate_exps.weight.*not one mha reads"):
        read_gguf(path)


def test_other_vocabularies_warn(tmp_path):
    """A tokenizer kind mha does not build (BERT's WordPiece here) or a byte-level BPE with an
    unknown pre-tokenizer: a warning, no tokenizer, the rest read."""
    path = gguf_files.write_gguf(tmp_path / "wpm.gguf", tokenizer_model="bert")
    with pytest.warns(UserWarning, match="tokenizer of kind 'bert' is not built"):
        files = read_gguf(path)
    assert files.tokenizer is None and files.config["vocab_size"] == 8
    assert files.config["tie_word_embeddings"] is True
    assert files.config["num_key_value_heads"] == 2 and files.config["head_dim"] == 16
    path = gguf_files.write_gguf(tmp_path / "pre.gguf", metadata={
        "tokenizer.ggml.pre": "deepseek-coder"})
    with pytest.warns(UserWarning, match="pre-tokenizer 'deepseek-coder' is not built"):
        assert read_gguf(path).tokenizer is None


# -- llama.cpp ----------------------------------------------------------------------------------

def hf_float64_logits(folder, checkpoint):
    """ids -> float64 logits of the transformers model of ``folder`` with the weights of
    ``checkpoint`` (the dequantised GGUF tensors)."""
    config = transformers.AutoConfig.from_pretrained(folder)
    model = getattr(transformers, config.architectures[0])(config).double().eval()
    state = {name: torch.from_numpy(np.array(checkpoint[name], np.float64)) for name in checkpoint}
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    model.tie_weights()

    def logits(ids):
        with torch.no_grad():
            return model(torch.tensor([list(ids)])).logits[0].numpy()
    return logits


def llama_cpp_logits(path, ids):
    """llama.cpp's logits of every position (llama-cpp-python, 2 threads), its KV cache in
    float32 (its default, float16, adds 2e-4 to 6e-4 of max |logit| on the F32 files)."""
    from llama_cpp import GGML_TYPE_F32, Llama
    llm = Llama(model_path=str(path), logits_all=True, n_threads=2, n_ctx=max(64, len(ids)),
                n_batch=512, verbose=False, seed=0, type_k=GGML_TYPE_F32,
                type_v=GGML_TYPE_F32)
    llm.eval(list(ids))
    out = np.array(llm.scores[:len(ids)], np.float64)
    llm.close()
    return out


def check_llama_cpp(path, logits_fn, ids, tol):
    """Hold llama.cpp's logits on the GGUF file ``path`` and ``logits_fn(ids)`` (any callable
    giving (len(ids), vocab) logits: transformers in float64 here, mha's model for the lead)
    to each other: max |difference| / max |logits_fn's| <= tol. Returns that gap."""
    ours = np.asarray(logits_fn(ids), np.float64)
    theirs = llama_cpp_logits(path, ids)
    assert ours.shape == theirs.shape
    gap = float(np.abs(ours - theirs).max() / np.abs(ours).max())
    assert gap <= tol, f"llama.cpp vs the float64 reference: {gap:.2e} > {tol:.0e}"
    return gap


#: about 10x the largest gap measured over the five models (llama.cpp widens nothing: on F16,
#: BF16 and Q8_0 weights it rounds the activations to the weights' type too): F32 3.5e-7,
#: F16 6.2e-4, BF16 5.6e-3, Q8_0 2.2e-2 of max |logit|
LLAMA_CPP_TOL = {"f32": 3e-6, "f16": 6e-3, "bf16": 5e-2, "q8_0": 2e-1}


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("outtype", OUTTYPES)
def test_llama_cpp_logits(files, family, outtype):
    pytest.importorskip("llama_cpp")
    path = files[family, outtype]
    reference = hf_float64_logits(files[family, "hf"], read_gguf(path).checkpoint)
    ids = np.random.default_rng(0).integers(3, 300, 40).tolist()
    gap = check_llama_cpp(path, reference, ids, LLAMA_CPP_TOL[outtype])
    print(f"{family} {outtype}: llama.cpp's logits {gap:.2e} of max |logit| from float64")


@pytest.mark.parametrize("family", list(FAMILIES))
def test_llama_cpp_tokenizer(files, family):
    """llama.cpp's own tokenizer, on the same GGUF metadata, gives the same ids."""
    pytest.importorskip("llama_cpp")
    from llama_cpp import Llama
    path = files[family, "q8_0"]
    tok = read_gguf(path).tokenizer
    llm = Llama(model_path=str(path), vocab_only=True, verbose=False)
    special = FAMILIES[family][3]
    for text in [*TEXTS[:-1], f"hello{special[-1]} there", " leading space"]:
        for add in (True, False):
            theirs = llm.tokenize(text.encode(), add_bos=add, special=True)
            assert tok(text, add_special_tokens=add).ids == theirs, (text, add)
    llm.close()


# -- mha's models on GGUF files ------------------------------------------------------------------

#: the format mha keeps each file type's dense weights in (float32: F16 until the core reads it)
def _expected_format(outtype):
    from mha import _core
    fmt = {"f32": "float32", "f16": "float16", "bf16": "bfloat16", "q8_0": "q8_0"}[outtype]
    return fmt if fmt == "float32" or fmt in _core.WEIGHT_FORMATS else "float32"


def float64_reference(folder, checkpoint):
    """ids -> logits of transformers in float64 on the dequantised GGUF tensors, with its
    float32 steps (RMSNorm, rotary angles, softmax) made float64 (tiny_models)."""
    import tiny_models
    config = transformers.AutoConfig.from_pretrained(folder)
    model = getattr(transformers, config.architectures[0])(config).double().eval()
    state = {name: torch.from_numpy(np.array(checkpoint[name], np.float64)) for name in checkpoint}
    model.load_state_dict(state, strict=False)
    model.tie_weights()

    def logits(ids):
        with torch.no_grad(), tiny_models.float64_everywhere(model):
            return model(torch.tensor([list(ids)])).logits[0].numpy()
    return logits


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("outtype", OUTTYPES)
def test_mha_loads_gguf_files(files, family, outtype):
    """mha.models.load("x.gguf"): the file's type kept (Q8_0, BF16 narrow), logits equal to
    transformers in float64 on the dequantised weights (issue 37: Q8_0 within 1e-4), and the
    tokenizer from the metadata."""
    import mha.models
    path = files[family, outtype]
    model = mha.models.load(path)
    assert model.weight_format == _expected_format(outtype)
    assert model.tokenizer is not None
    ids = np.random.default_rng(0).integers(3, 300, 40)
    reference = float64_reference(files[family, "hf"], read_gguf(path).checkpoint)(ids)
    gap = float(np.abs(model.logits(ids) - reference).max() / np.abs(reference).max())
    assert gap <= GGUF_TOL, f"{family} {outtype}: {gap:.2e}"
    double = mha.models.load(path, dtype=np.float64)
    assert double.weight_format == "float64"
    gap64 = float(np.abs(double.logits(ids) - reference).max() / np.abs(reference).max())
    assert gap64 <= GGUF_TOL64, f"{family} {outtype} float64: {gap64:.2e}"


#: about 10x the largest gaps measured over the six families and four types: float32 models
#: 6.8e-7 of max |logit|, float64 models 1.1e-15
GGUF_TOL, GGUF_TOL64 = 7e-6, 1.2e-14


def test_a_q8_0_gguf_model_opens_up(files):
    """run_with_cache and head_statistics on a Q8_0 file; llama.cpp's logits on its F32 twin
    equal mha's."""
    import mha.models
    model = mha.models.load(files["qwen3", "q8_0"])
    ids = model.encode("The cat sat on the mat.").input_ids
    enc, cache = model.run_with_cache(ids)
    assert cache["blocks.1.attn.hook_pattern"].shape == (1, model.n_heads, len(ids), len(ids))
    stats = model.head_statistics(ids)
    assert np.all(np.isfinite(stats["entropy"]))
    pytest.importorskip("llama_cpp")
    f32 = mha.models.load(files["llama", "f32"])
    gap = check_llama_cpp(files["llama", "f32"], f32.logits, list(range(3, 43)), 5e-6)
    print(f"llama.cpp vs mha on F32: {gap:.2e}")
