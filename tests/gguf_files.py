"""GGUF files written by llama.cpp's own converter, for the tests of mha.models.gguf.

The authoritative writer of GGUF is llama.cpp's ``convert_hf_to_gguf.py``. It is not on PyPI
by itself, but the llama-cpp-python sdist (PyPI) vendors llama.cpp whole: ``llama_cpp_dir()``
downloads that sdist once with pip (``pip download --no-binary :all: --no-deps``) and keeps the
converter, its ``conversion`` package and its own ``gguf-py`` in the user's cache
(``$XDG_CACHE_HOME/mha`` or ``~/.cache/mha``; ``MHA_LLAMA_CPP_DIR`` points at a llama.cpp
checkout instead). Nothing is fetched from GitHub.

``hf_folder(family, folder)`` writes a tiny random transformers model (LlamaForCausalLM,
MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM; float32 safetensors) with a
byte-level BPE tokenizer trained on a few sentences, whose pre-tokenizer is the one of a
llama.cpp pre-tokenizer name, or (the llama2 family) a SentencePiece BPE tokenizer.model.
``convert(jobs)`` runs the converter on
them in one subprocess, with ``--outtype`` f32, f16, bf16 or q8_0.

The converter names the pre-tokenizer by hashing the tokenizer's output on a test string and
looking the hash up in a table of released models; a tokenizer trained here is in no table,
so the converter is run with that lookup falling back, for an unknown hash only, to the name
the folder declares (``gguf_pre.txt``): the file then says what a released model's would.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import numpy as np

import tiny_models

#: the llama-cpp-python release whose vendored llama.cpp writes the test files
LLAMA_CPP_PYTHON = "0.3.36"
OUTTYPES = ("f32", "f16", "bf16", "q8_0")

#: tiny_models' sentences, one of them traded for contractions, digits and whitespace runs
CORPUS = [*tiny_models.CORPUS[:5],
          "I've been told he's there, you'll see. We'd like 33 teas.\n\nNew  lines\tand tabs.",
          tiny_models.CORPUS[6]]
#: what the tokenizer tests encode (unseen words, digits, runs of spaces, newlines, accents)
TEXTS = [CORPUS[0], "Time flies like an arrow!", CORPUS[2], "  indented 2024 text\n\nand 3.14",
         "héllo wörld, it's 12345 o'clock", ""]

# transformers' own pre-tokenizer regexes of Llama 3 and Qwen2 (their tokenizer.json)
LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}"
                r"\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+"
               r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

#: family -> (transformers class, config, llama.cpp pre-tokenizer name, special tokens, BOS, EOS)
FAMILIES = {
    # Llama 3 style: untied head, GQA, the "llama-bpe" pre-tokenizer, BOS added
    "llama": ("LlamaForCausalLM", dict(
        model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, rope_theta=500000.0,
        max_position_embeddings=256, tie_word_embeddings=False),
        "llama-bpe", ["<|begin_of_text|>", "<|end_of_text|>"], "<|begin_of_text|>",
        "<|end_of_text|>"),
    # Llama 3.1's "llama3" RoPE scaling (a rope_freqs tensor in GGUF) and tied embeddings
    "llama31": ("LlamaForCausalLM", dict(
        model_type="llama", hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, rms_norm_eps=1e-5, rope_theta=500000.0,
        max_position_embeddings=1024, tie_word_embeddings=True,
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                          high_freq_factor=4.0, original_max_position_embeddings=64)),
        "llama-bpe", ["<|begin_of_text|>", "<|end_of_text|>"], "<|begin_of_text|>",
        "<|end_of_text|>"),
    # LLaMA 2 style: a SentencePiece BPE tokenizer (tokenizer.model, byte fallback), no GQA
    "llama2": ("LlamaForCausalLM", dict(
        model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, rms_norm_eps=1e-6, rope_theta=10000.0,
        max_position_embeddings=128, tie_word_embeddings=False),
        "spm", ["<unk>", "<s>", "</s>"], "<s>", "</s>"),
    # Mistral: no sliding window (GGUF's llama architecture records none); SmolLM's
    # pre-tokenizer (single digits, GPT-2's regex); more rows in the embedding than tokens
    "mistral": ("MistralForCausalLM", dict(
        model_type="mistral", hidden_size=64, intermediate_size=160, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=2, rms_norm_eps=1e-5, rope_theta=1e6,
        max_position_embeddings=512, sliding_window=None, tie_word_embeddings=False),
        "smollm", ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], "<|im_start|>",
        "<|endoftext|>"),
    # Qwen2: q/k/v biases, tied embeddings, NEOX rotary (no row permutation)
    "qwen2": ("Qwen2ForCausalLM", dict(
        model_type="qwen2", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6, rope_theta=1e6,
        max_position_embeddings=512, tie_word_embeddings=True, use_sliding_window=False),
        "qwen2", ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], None, "<|endoftext|>"),
    # Qwen3: QK-norm, head_dim 32 != hidden_size / heads
    "qwen3": ("Qwen3ForCausalLM", dict(
        model_type="qwen3", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6,
        rope_theta=1e6, max_position_embeddings=512, tie_word_embeddings=False,
        use_sliding_window=False),
        "qwen2", ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], None, "<|im_end|>"),
}


# -- the converter ------------------------------------------------------------------------------

def cache_root() -> Path:
    """mha's folder in the user's cache: $XDG_CACHE_HOME/mha or ~/.cache/mha."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "mha"


def llama_cpp_dir() -> Path:
    """A llama.cpp tree with convert_hf_to_gguf.py, conversion/ and gguf-py/: MHA_LLAMA_CPP_DIR,
    else the one vendored in the llama-cpp-python sdist, downloaded once into the cache."""
    if os.environ.get("MHA_LLAMA_CPP_DIR"):
        return Path(os.environ["MHA_LLAMA_CPP_DIR"])
    target = cache_root() / f"llama-cpp-python-{LLAMA_CPP_PYTHON}-llama.cpp"
    if (target / "convert_hf_to_gguf.py").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-binary", ":all:",
                        "--no-deps", f"llama-cpp-python=={LLAMA_CPP_PYTHON}",
                        "-d", tmp], check=True)
        sdist = next(Path(tmp).glob("llama_cpp_python-*.tar.gz"))
        prefix = f"{sdist.name[:-len('.tar.gz')]}/vendor/llama.cpp/"
        keep = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/", "LICENSE")
        staged = Path(tmp) / "llama.cpp"
        with tarfile.open(sdist) as tar:
            members = []
            for m in tar.getmembers():
                if m.name.startswith(prefix) and m.name[len(prefix):].startswith(keep) \
                        and (m.isfile() or m.isdir()):
                    m.name = m.name[len(prefix):]
                    members.append(m)
            safe = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
            tar.extractall(staged, members=members, **safe)
        try:
            staged.rename(target)           # atomic: a concurrent run's copy may have won
        except OSError:
            if not (target / "convert_hf_to_gguf.py").is_file():
                raise
    return target


# run in a subprocess: the converter imports its own gguf-py, not the installed gguf package
_RUNNER = r'''
import json, logging, runpy, sys
from pathlib import Path
root = Path(sys.argv[1])
sys.path.insert(0, str(root))
sys.path.insert(1, str(root / "gguf-py"))
from conversion import base
_pre = base.TextModel.get_vocab_base_pre
def get_vocab_base_pre(self, tokenizer):
    try:
        return _pre(self, tokenizer)
    except NotImplementedError:                 # a hash in no table: the folder's own name
        return (Path(self.dir_model) / "gguf_pre.txt").read_text().strip()
base.TextModel.get_vocab_base_pre = get_vocab_base_pre
logging.disable(logging.WARNING)
for folder, outtype, out in json.loads(sys.argv[2]):
    sys.argv = ["convert_hf_to_gguf.py", folder, "--outtype", outtype, "--outfile", out]
    runpy.run_path(str(root / "convert_hf_to_gguf.py"), run_name="__main__")
'''


def convert(jobs):
    """Run convert_hf_to_gguf.py on each (hf folder, outtype, gguf path), in one subprocess."""
    jobs = [(str(f), t, str(p)) for f, t, p in jobs]
    env = dict(os.environ, NO_LOCAL_GGUF="1")     # the runner puts gguf-py on the path itself
    proc = subprocess.run([sys.executable, "-c", _RUNNER, str(llama_cpp_dir()), json.dumps(jobs)],
                          env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"convert_hf_to_gguf.py failed:\n{proc.stderr[-4000:]}")
    return [Path(p) for _, _, p in jobs]


# -- the transformers models --------------------------------------------------------------------

def _tokenizer(pre, special, bos, eos, vocab_size=360):
    """A byte-level BPE tokenizer trained on CORPUS with the pre-tokenizer of llama.cpp's name
    ``pre``; specials first; BOS added in front when ``bos`` is given."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from tokenizers import trainers
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    if pre == "llama-bpe":
        split = pre_tokenizers.Split(Regex(LLAMA3_REGEX), behavior="isolated")
        pre_tok = pre_tokenizers.Sequence([split, byte_level])
    elif pre == "qwen2":
        split = pre_tokenizers.Split(Regex(QWEN2_REGEX), behavior="isolated")
        pre_tok = pre_tokenizers.Sequence([split, byte_level])
    elif pre == "smollm":
        pre_tok = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    else:
        raise ValueError(pre)
    tok = Tokenizer(models.BPE(ignore_merges=pre == "llama-bpe"))
    tok.pre_tokenizer = pre_tok
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS * 4, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=special, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    if bos is not None:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
            special_tokens=[(bos, tok.token_to_id(bos))])
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def _sentencepiece(folder, vocab_size=400):
    """A SentencePiece BPE model (byte fallback; <unk> 0, <s> 1, </s> 2; LLaMA's options)
    trained on CORPUS, saved as folder/tokenizer.model with the tokenizer_config.json of
    LLaMA 2 (BOS added).
    Returns the SentencePieceProcessor."""
    import sentencepiece as spm
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS * 4), model_prefix=str(folder / "tokenizer"),
        vocab_size=vocab_size, model_type="bpe", byte_fallback=True, character_coverage=1.0,
        unk_id=0, bos_id=1, eos_id=2, pad_id=-1, minloglevel=2,
        # LLaMA's tokenizer.model: no normalisation, spaces kept, digits split
        normalization_rule_name="identity", remove_extra_whitespaces=False, split_digits=True,
        allow_whitespace_only_pieces=True)
    (folder / "tokenizer.vocab").unlink()
    (folder / "tokenizer_config.json").write_text(json.dumps(dict(
        tokenizer_class="LlamaTokenizer", add_bos_token=True, add_eos_token=False,
        bos_token="<s>", eos_token="</s>", unk_token="<unk>")))
    return spm.SentencePieceProcessor(model_file=str(folder / "tokenizer.model"))


def hf_folder(family, folder, seed=0):
    """Write a tiny random model of ``family`` (see FAMILIES) to ``folder``: config.json,
    model.safetensors (float32), tokenizer.json, tokenizer_config.json and gguf_pre.txt (the
    llama.cpp pre-tokenizer name). Norm gains and biases are random too (not 1 and 0), so that a
    tensor read under a wrong name shows. Returns the folder."""
    import torch
    import transformers
    from transformers import PreTrainedTokenizerFast

    cls_name, config, pre, special, bos, eos = FAMILIES[family]
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    config = dict(config)
    if pre == "spm":
        sp = _sentencepiece(folder)
        config.update(vocab_size=sp.vocab_size(), bos_token_id=sp.bos_id(),
                      eos_token_id=sp.eos_id())
    else:
        tok = _tokenizer(pre, special, bos, eos)
        # the mistral model has 5 embedding rows more than tokens (the converter pads the list)
        config["vocab_size"] = tok.get_vocab_size() + (5 if family == "mistral" else 0)
        config["bos_token_id"] = tok.token_to_id(bos) if bos else None
        config["eos_token_id"] = tok.token_to_id(eos)
    model_type = config.pop("model_type")
    cfg = transformers.AutoConfig.for_model(model_type, **config)
    torch.manual_seed(seed)
    model = getattr(transformers, cls_name)(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
            else:
                p.add_(0.05 * torch.randn_like(p))
    model.save_pretrained(folder)
    if pre != "spm":
        fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token=eos,
                                       model_max_length=config["max_position_embeddings"])
        fast.save_pretrained(folder)
        (folder / "gguf_pre.txt").write_text(pre)
    return folder


def hf_state_dict(folder):
    """The float32 tensors of ``folder``'s model.safetensors, as NumPy arrays (by name)."""
    from safetensors.numpy import load_file
    return load_file(str(Path(folder) / "model.safetensors"))


def hf_config(folder):
    return json.loads((Path(folder) / "config.json").read_text())


def make_files(root, families=tuple(FAMILIES), outtypes=OUTTYPES):
    """Every (family, outtype) GGUF file under ``root``: {(family, outtype): path}, plus
    {family: hf folder} under key (family, "hf"). Files already there are reused."""
    root = Path(root)
    out, jobs = {}, []
    for family in families:
        folder = root / family / "hf"
        if not (folder / "model.safetensors").is_file():
            hf_folder(family, folder)
        out[family, "hf"] = folder
        for t in outtypes:
            path = root / family / f"{family}-{t}.gguf"
            out[family, t] = path
            if not path.is_file():
                jobs.append((folder, t, path))
    if jobs:
        convert(jobs)
    return out


def q8_0_bound(w):
    """The largest error Q8_0 may make on each element of ``w`` (rows of blocks of 32 along the
    last axis): half a step of its block, d = amax / 127 rounded to float16, plus the float16
    rounding of d itself times 127."""
    blocks = np.abs(w.astype(np.float64)).reshape(*w.shape[:-1], -1, 32).max(-1, keepdims=True)
    d = blocks / 127
    return np.broadcast_to(d / 2 + 127 * d * 2.0 ** -11, (*w.shape[:-1], w.shape[-1] // 32, 32)) \
        .reshape(w.shape)


def write_gguf(path, arch="llama", tensors=None, metadata=None, tokenizer_model="gpt2"):
    """A small hand-made GGUF file (with the gguf package's writer), for the error cases:
    ``tensors`` {name: float32 array, or (uint8 bytes, ggml type name)}, ``metadata`` {key:
    value} added to a 1-layer model's sizes (d_model 32, 2 heads, d_ff 64, 8 tokens)."""
    import gguf
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_embedding_length(32)
    w.add_feed_forward_length(64)
    w.add_head_count(2)
    w.add_head_count_kv(2)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_context_length(64)
    w.add_tokenizer_model(tokenizer_model)
    w.add_token_list([f"t{i}" for i in range(8)])
    w.add_token_scores([0.0] * 8)
    w.add_token_types([1] * 8)
    for key, val in (metadata or {}).items():
        if isinstance(val, str):
            w.add_string(key, val)
        elif isinstance(val, float):
            w.add_float32(key, val)
        else:
            w.add_uint32(key, val)
    rng = np.random.default_rng(0)
    if tensors is None:
        tensors = {"token_embd.weight": rng.standard_normal((8, 32)).astype(np.float32),
                   "output_norm.weight": np.ones(32, np.float32)}
    for name, t in tensors.items():
        if isinstance(t, tuple):
            data, qtype = t
            w.add_tensor(name, data, raw_dtype=gguf.GGMLQuantizationType[qtype])
        else:
            w.add_tensor(name, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)
