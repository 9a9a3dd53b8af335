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
    elif family == "gpt2":
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
}
CAUSAL = ("gpt2", "llama", "llama-mqa-tied", "qwen2", "mistral")


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


@contextlib.contextmanager
def float64_everywhere(model):
    """transformers' LLaMA family computes RMSNorm, the rotary angles and the attention softmax
    in float32 even in a float64 model. Inside this block they run in float64 with the same
    formulas (the rotary frequencies from transformers' own init functions), so that a float64
    comparison tests mha's float64 path, not transformers' float32 steps."""
    import torch
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    patched = []
    for module in model.modules():
        name = type(module).__name__
        if name.endswith("RMSNorm"):
            def rms(x, m=module):
                return m.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True)
                                                   + m.variance_epsilon))
            module.forward = rms
            patched.append(module)
        elif name.endswith("RotaryEmbedding"):
            init = (module.compute_default_rope_parameters if module.rope_type == "default"
                    else ROPE_INIT_FUNCTIONS[module.rope_type])
            real_float, torch.float = torch.float, torch.float64    # its arange(...).to(torch.float)
            try:
                inv_freq, scaling = init(module.config)
            finally:
                torch.float = real_float
            assert inv_freq.dtype == torch.float64

            def rotary(x, position_ids, inv_freq=inv_freq, scaling=scaling):
                freqs = position_ids[..., None].double() * inv_freq
                emb = torch.cat((freqs, freqs), dim=-1)
                return emb.cos() * scaling, emb.sin() * scaling
            module.forward = rotary
            patched.append(module)
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
