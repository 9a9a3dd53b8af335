"""Tiny random models of every family mha.models runs, built offline with transformers and
saved with save_pretrained (config.json + model.safetensors), each with a tokenizer.json that
the tokenizers library trains on a few sentences. Nothing is downloaded.

``build(family, folder)`` writes one model and returns its transformers class; FAMILIES lists
the names. The weights are transformers' random init plus N(0, 0.2) noise, so that heads are
peaked (a uniform head would hide a wrong mask) and LayerNorm / RMSNorm gains are not all 1.
"""
import contextlib

import numpy as np

CORPUS = [
    "The doctor said that she would help the patient.",
    "The man saw the astronomer with a telescope.",
    "Unbelievably, the tokenizer splits hyphenated-words and numbers like 1234567!",
    "The cat sat on the mat because it was tired.",
    "Time flies like an arrow; fruit flies like a banana.",
    "The bank by the river is closed on Sundays, but money flows.",
    "Attention heads look at the previous token, the next one, or the first.",
]
TEXTS = [CORPUS[0], "Time flies like an arrow!", CORPUS[2]]


def _bpe(special, vocab_size=400):
    """A byte-level BPE tokenizer trained on CORPUS; special tokens get the first ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(CORPUS * 4, trainer)
    return tok


def _wordpiece():
    """A BERT-style WordPiece tokenizer ([CLS] text [SEP] text [SEP]) trained on CORPUS."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers
    from tokenizers import processors, trainers
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    special = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tok.train_from_iterator(CORPUS * 4, trainers.WordPieceTrainer(
        vocab_size=300, special_tokens=special, show_progress=False))
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    return tok


def _tokenizer(family, folder):
    from tokenizers import processors
    if family == "distilbert":
        tok = _wordpiece()
    elif family == "roberta":
        tok = _bpe(["<s>", "<pad>", "</s>", "<unk>", "<mask>"])
        tok.post_processor = processors.RobertaProcessing(("</s>", 2), ("<s>", 0))
    elif family in ("gpt2", "gpt_neox"):          # no BOS (Pythia's tokenizer adds none)
        tok = _bpe(["<|endoftext|>"])
    else:                                   # the LLaMA family: BOS first, no EOS
        tok = _bpe(["<unk>", "<s>", "</s>"])
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)])
    tok.save(str(folder / "tokenizer.json"))
    return tok


# family -> (transformers config class, model class, config keywords); vocab_size is added
_LLAMA = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, bos_token_id=1,
              eos_token_id=2)
_GEMMA = dict(hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, bos_token_id=1,
              eos_token_id=2, pad_token_id=0)
FAMILIES = {
    "roberta": ("RobertaConfig", "RobertaForMaskedLM", dict(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48,
        max_position_embeddings=66, type_vocab_size=1, pad_token_id=1, bos_token_id=0,
        eos_token_id=2, layer_norm_eps=1e-5)),
    "distilbert": ("DistilBertConfig", "DistilBertForMaskedLM", dict(
        dim=32, n_layers=2, n_heads=4, hidden_dim=48, max_position_embeddings=64,
        pad_token_id=0)),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", dict(
        n_positions=64, n_embd=32, n_layer=2, n_head=4, bos_token_id=0, eos_token_id=0)),
    # GQA 4/2, head_dim 24 (not hidden / heads), every bias, untied, Llama 3.1's RoPE scaling
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(
        _LLAMA, head_dim=24, attention_bias=True, mlp_bias=True, tie_word_embeddings=False,
        rope_theta=500000.0, rope_scaling=dict(
            rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
            original_max_position_embeddings=16))),
    # one KV head for four queries (multi-query), tied embeddings, linear RoPE scaling
    "llama-mqa-tied": ("LlamaConfig", "LlamaForCausalLM", dict(
        _LLAMA, num_key_value_heads=1, tie_word_embeddings=True,
        rope_scaling=dict(rope_type="linear", factor=2.0))),
    # q/k/v biases, tied; a sliding window of 6 tokens on layer 1 (max_window_layers=1)
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(
        _LLAMA, tie_word_embeddings=True, rope_theta=1000000.0, use_sliding_window=True,
        sliding_window=6, max_window_layers=1)),
    # a sliding window of 5 tokens on every layer, untied
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(
        _LLAMA, sliding_window=5, tie_word_embeddings=False)),
    # Pythia: parallel residual (attention and MLP both read the layer's input), a quarter of
    # each head rotated (rope_parameters' partial_rotary_factor, transformers 5's form of
    # rotary_pct), fused query_key_value interleaved per head, every bias, untied
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", dict(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=64, use_parallel_residual=True, tie_word_embeddings=False,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0,
                             partial_rotary_factor=0.25), bos_token_id=0, eos_token_id=0)),
    # the same with the sequential residual (x + attn, then + mlp), as Pythia's siblings allow
    "gpt_neox-sequential": ("GPTNeoXConfig", "GPTNeoXForCausalLM", dict(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=64, use_parallel_residual=False, tie_word_embeddings=False,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0,
                             partial_rotary_factor=0.25), bos_token_id=0, eos_token_id=0)),
    # Gemma: d 48 (sqrt(48), the embedding scale, is not a float32 number), multi-query,
    # head_dim 16 (4 x 16 != 48), RMSNorm gains 1 + w, tied; config.json says hidden_act
    # "gelu" as the Hub's do (CONFIG_EDITS; transformers reads it as tanh GELU)
    "gemma": ("GemmaConfig", "GemmaForCausalLM", dict(
        _GEMMA, num_key_value_heads=1, head_dim=16, tie_word_embeddings=True)),
    # Gemma 2: soft-capped scores (2.0) and logits (5.0), both beyond tanh's linear range
    # here; query_pre_attn_scalar 24 != head_dim 16; a 4-token window on the even layers
    # (the default alternation: no layer_types, as on the Hub); sandwich norms; 3 layers
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(
        _GEMMA, num_hidden_layers=3, head_dim=16, query_pre_attn_scalar=24,
        attn_logit_softcapping=2.0, final_logit_softcapping=5.0, sliding_window=4,
        hidden_activation="gelu_pytorch_tanh")),
    # Gemma 3 (text): q/k RMSNorm (1 + w) per head, a 4-token window on layers 0 and 2
    # (sliding_window_pattern 2), rope_theta 1e6 with linear scaling on the full layer and
    # 1e4 on the sliding ones (two rotary tables); "gemma3_text-old" is the same model with
    # its config.json rewritten by hand in the old form (CONFIG_EDITS)
    "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        _GEMMA, num_hidden_layers=3, head_dim=16, query_pre_attn_scalar=16, sliding_window=4,
        sliding_window_pattern=2, rope_parameters=dict(
            full_attention=dict(rope_type="linear", factor=2.0, rope_theta=1000000.0),
            sliding_attention=dict(rope_type="default", rope_theta=10000.0)))),
    # Qwen3: q/k RMSNorm per head, head_dim 24 != 64 / 4, GQA, tied, a 4-token window on
    # layer 1 (use_sliding_window, max_window_layers 1)
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(
        _LLAMA, head_dim=24, tie_word_embeddings=True, use_sliding_window=True,
        sliding_window=4, max_window_layers=1)),
    # OLMo 2: norms after attention and MLP (no input norm), q/k RMSNorm over the whole
    # projection (not per head), GQA, untied
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", dict(_LLAMA, tie_word_embeddings=False,
                                                      pad_token_id=0)),
    # Phi-3: fused qkv_proj and gate_up_proj, GQA, a 4-token window on every layer, three
    # quarters of each head rotated (Phi-4-mini's 0.75), untied
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(
        _LLAMA, sliding_window=4, tie_word_embeddings=False, pad_token_id=0,
        original_max_position_embeddings=64, rope_parameters=dict(
            rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.75))),
}
#: the families of issue 36 (the rest ran before it)
NEW = ("gpt_neox", "gpt_neox-sequential", "gemma", "gemma2", "gemma3_text", "qwen3", "olmo2",
       "phi3")
CAUSAL = ("gpt2", "llama", "llama-mqa-tied", "qwen2", "mistral", *NEW)


def _gelu_as_on_the_hub(config):
    """Gemma's Hub configs say hidden_act "gelu" (transformers reads it as tanh GELU)."""
    config["hidden_act"] = "gelu"


def _no_layer_types(config):
    """Gemma 2's and Qwen3's Hub configs have no layer_types: the windows follow from the
    default alternation (Gemma 2) or max_window_layers (Qwen3)."""
    del config["layer_types"]


#: family -> an edit of the config.json that save_pretrained wrote (how Hub configs say it)
CONFIG_EDITS = {"gemma": _gelu_as_on_the_hub, "gemma2": _no_layer_types,
                "qwen3": _no_layer_types}


def edit_config(folder, edit):
    """Apply ``edit`` (a function of the config dict, in place) to folder/config.json."""
    import json
    path = folder / "config.json"
    config = json.loads(path.read_text())
    edit(config)
    path.write_text(json.dumps(config, indent=2))


def gemma3_old_form(config):
    """A Gemma 3 config.json rewritten in place in the form of the older Hub configs:
    ``sliding_window_pattern``, ``rope_theta``, ``rope_local_base_freq`` and ``rope_scaling``
    in place of ``layer_types`` and the per-layer-type ``rope_parameters``."""
    types = config.pop("layer_types")
    pattern = next(i + 1 for i, t in enumerate(types) if t == "full_attention")
    assert types == ["sliding_attention" if (i + 1) % pattern else "full_attention"
                     for i in range(len(types))], types
    rope = config.pop("rope_parameters")
    full, local = dict(rope["full_attention"]), rope["sliding_attention"]
    assert local.get("rope_type", "default") == "default"
    config["sliding_window_pattern"] = pattern
    config["rope_theta"] = full.pop("rope_theta")
    config["rope_local_base_freq"] = local["rope_theta"]
    config["rope_scaling"] = None if full.get("rope_type", "default") == "default" else full


def perturb(model, seed):
    """Add N(0, 0.2) to every parameter (in place)."""
    import torch
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.2)


def build(family, folder, seed=0):
    """Write the tiny ``family`` model into ``folder``; return its transformers model class."""
    import torch
    import transformers
    config_class, model_class, kwargs = FAMILIES[family]
    tok = _tokenizer(family.split("-")[0], folder)
    torch.manual_seed(seed)
    config = getattr(transformers, config_class)(vocab_size=tok.get_vocab_size(), **kwargs)
    model = getattr(transformers, model_class)(config).eval()
    perturb(model, seed + 1)
    model.save_pretrained(folder, safe_serialization=True)
    if family in CONFIG_EDITS:
        edit_config(folder, CONFIG_EDITS[family])
    return getattr(transformers, model_class)


def build_bert(folder):
    """Write a tiny BERT (BertModel, token types, absolute positions) with the WordPiece
    tokenizer of the "distilbert" family into ``folder`` (no MiniLM needed); return its class."""
    import torch
    import transformers
    _tokenizer("distilbert", folder)
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=300, hidden_size=32, num_hidden_layers=2,
                                     num_attention_heads=4, intermediate_size=48,
                                     max_position_embeddings=64)
    model = transformers.BertModel(config).eval()
    perturb(model, 3)
    model.save_pretrained(folder, safe_serialization=True)
    return transformers.BertModel


def load_reference(model_class, folder, dtype="float32"):
    """The saved model back in transformers with eager attention (float32 or float64)."""
    import torch
    model = model_class.from_pretrained(folder, attn_implementation="eager").eval()
    return model.to(getattr(torch, dtype))


def _float64_rope_init(init, config, **kwargs):
    """transformers' rotary init function with its float32 arange (``dtype=torch.float``)
    made float64: the same formula, the frequencies not rounded to float32."""
    import torch
    real_float, torch.float = torch.float, torch.float64
    try:
        inv_freq, scaling = init(config, **kwargs)
    finally:
        torch.float = real_float
    assert inv_freq.dtype == torch.float64
    return inv_freq, scaling


@contextlib.contextmanager
def float64_everywhere(model):
    """transformers computes RMSNorm (LLaMA, Qwen2/3, Mistral, OLMo 2, Phi-3 and Gemma's
    1 + w form, the q/k norms included), the rotary angles (partial for GPT-NeoX and Phi-3,
    one table per layer type for Gemma 3) and the attention softmax in float32 even in a
    float64 model, and Gemma's embedding scale sqrt(d) is a float32 buffer. Inside this
    block they run in float64 with the same formulas (the rotary frequencies from
    transformers' own init functions), so that a float64 comparison tests mha's float64
    path, not transformers' float32 steps (test_new_families checks that no float32 tensor
    is made in a float64 forward)."""
    import math

    import torch
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    patched, buffers = [], []

    def init_of(module, rope_type):
        return (module.compute_default_rope_parameters if rope_type == "default"
                else ROPE_INIT_FUNCTIONS[rope_type])

    for module in model.modules():
        name = type(module).__name__
        if name.endswith("RMSNorm"):
            eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
            if name.startswith("Gemma"):             # x / rms(x) * (1 + w)
                def rms(x, m=module, eps=eps):
                    return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)) * (
                        1.0 + m.weight)
            else:
                def rms(x, m=module, eps=eps):
                    return m.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))
            module.forward = rms
            patched.append(module)
        elif name.endswith("RotaryEmbedding"):
            if isinstance(module.rope_type, dict):   # Gemma 3: a table per layer type
                tables = {t: _float64_rope_init(init_of(module, kind), module.config,
                                                layer_type=t)
                          for t, kind in module.rope_type.items()}

                def rotary(x, position_ids, layer_type, tables=tables):
                    inv_freq, scaling = tables[layer_type]
                    freqs = position_ids[..., None].double() * inv_freq
                    emb = torch.cat((freqs, freqs), dim=-1)
                    return emb.cos() * scaling, emb.sin() * scaling
            else:
                inv_freq, scaling = _float64_rope_init(init_of(module, module.rope_type),
                                                       module.config)

                def rotary(x, position_ids, inv_freq=inv_freq, scaling=scaling):
                    freqs = position_ids[..., None].double() * inv_freq
                    emb = torch.cat((freqs, freqs), dim=-1)
                    return emb.cos() * scaling, emb.sin() * scaling
            module.forward = rotary
            patched.append(module)
        elif hasattr(module, "scalar_embed_scale") and module.weight.dtype == torch.float64:
            # Gemma's ScaledWordEmbedding: torch.tensor(sqrt(d)) was made in float32
            exact = torch.tensor(float(module.scalar_embed_scale), dtype=torch.float64)
            assert exact == math.sqrt(model.config.hidden_size)
            buffers.append((module, module.embed_scale))
            module.embed_scale = exact
    real_softmax = torch.nn.functional.softmax

    def softmax(x, dim=None, _stacklevel=3, dtype=None):
        return real_softmax(x, dim=dim, dtype=None if x.dtype == torch.float64 else dtype)
    torch.nn.functional.softmax = softmax
    try:
        yield model
    finally:
        torch.nn.functional.softmax = real_softmax
        for module in patched:
            del module.forward
        for module, buffer in buffers:
            module.embed_scale = buffer


def reference_outputs(model, ids, mask=None):
    """(attentions (B, L, H, n, n), hidden states (B, L+1, n, d), logits or None) of a
    transformers model, as float64 NumPy arrays."""
    import torch
    with torch.no_grad():
        out = model(input_ids=torch.from_numpy(np.asarray(ids)),
                    attention_mask=None if mask is None else torch.from_numpy(
                        np.asarray(mask).astype(np.int64)),
                    output_attentions=True, output_hidden_states=True)
    attn = torch.stack(out.attentions, dim=1).double().numpy()
    hidden = torch.stack(out.hidden_states, dim=1).double().numpy()
    logits = getattr(out, "logits", None)
    return attn, hidden, None if logits is None else logits.double().numpy()


def build_base(family, folder, seed=0, **overrides):
    """Write the tiny ``family`` model as its base model into ``folder``, the way
    ``AutoModel.from_config(config).save_pretrained(folder)`` writes it (LlamaModel,
    Qwen2Model, MistralModel, GPT2Model: tensor names without the "model." or "transformer."
    prefix, no lm_head.weight); ``overrides`` change the family's config keywords (e.g.
    ``tie_word_embeddings=False``). Return the base model class."""
    import torch
    import transformers
    config_class, _, kwargs = FAMILIES[family]
    tok = _tokenizer(family.split("-")[0], folder)
    torch.manual_seed(seed)
    config = getattr(transformers, config_class)(vocab_size=tok.get_vocab_size(),
                                                 **{**kwargs, **overrides})
    model = transformers.AutoModel.from_config(config).eval()
    perturb(model, seed + 1)
    model.save_pretrained(folder, safe_serialization=True)
    if family in CONFIG_EDITS:
        edit_config(folder, CONFIG_EDITS[family])
    return type(model)


def padded_batch(model, n, cuts, seed=0):
    """Right-padded random ids (3, n) of the model's vocabulary and their mask: texts of n,
    n - cuts[0] and n - cuts[1] tokens, padding set to the pad id (or 0)."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(3, model.config.vocab_size, size=(3, n))
    mask = np.ones((3, n), bool)
    mask[1, n - cuts[0]:] = False
    mask[2, n - cuts[1]:] = False
    ids[~mask] = model.config.pad_token_id or 0
    return ids, mask
