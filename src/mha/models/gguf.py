"""GGUF files (llama.cpp's format): the config, the tensors and the tokenizer of one file.

A GGUF file (https://github.com/ggml-org/ggml/blob/master/docs/gguf.md) holds key/value
metadata (the architecture's sizes, the tokenizer's vocabulary and merges) and named tensors,
each in a ggml type. :func:`read_gguf` reads one (its header parsed here, each tensor read
when asked for; no package beyond NumPy, and ``tokenizers`` for the tokenizer) and gives what a
Hugging Face folder gives: a transformers config.json dict, a mapping of tensors under
transformers' checkpoint names in torch's layout (out, in), and a tokenizer. Architectures:
"llama" (LLaMA, Mistral and others written as llama), "qwen2", "qwen3". Tensor types: F32,
F16, BF16 and Q8_0, each kept as stored (``checkpoint.raw``) or widened to float32 on access
(``checkpoint[name]``), one tensor at a time. Tokenizers: byte-level BPE ("gpt2", with the
pre-tokenizers of LLaMA 3, Qwen2, SmolLM, GPT-2 and a few more) and SentencePiece ("llama").

ggml rotates (x[2i], x[2i+1]) pairs in its "llama" rotary mode; transformers rotates
(x[i], x[i + d/2]). llama.cpp's converter therefore permutes the rows of each head of q_proj
and k_proj when it writes a llama file (``LlamaModel.permute`` in convert_hf_to_gguf.py); this
module gathers them back on access. Qwen2 and Qwen3 rotate like transformers ("neox" mode):
their rows are as transformers has them. The gather moves whole rows, and a Q8_0 block runs
along a row, so it is exact for every type.
"""
from __future__ import annotations

import json
import math
import mmap
import os
import struct
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from .hub import CheckpointError

__all__ = ["read_gguf", "GGUFFiles", "GGUFCheckpoint", "dequantize_q8_0",
           "SUPPORTED_ARCHITECTURES", "TENSOR_TYPES"]

#: GGUF's ``general.architecture`` values read, and the transformers model_type of each
SUPPORTED_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
_HF_CLASSES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
               "qwen3": "Qwen3ForCausalLM"}
#: architectures whose q_proj / k_proj rows llama.cpp stores permuted for ggml's rotary mode
_PERMUTED = {"llama"}
#: the ggml tensor types read (the others, Q4_K and the like, raise NotImplementedError)
TENSOR_TYPES = ("F32", "F16", "BF16", "Q8_0")

Q8_0_BLOCK = 32                 # values per Q8_0 block
Q8_0_BYTES = 34                 # bytes per block: a float16 scale d, then 32 int8

_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight",
                 "output_norm.weight": "model.norm.weight",
                 "output.weight": "lm_head.weight"}
_BLOCK_NAMES = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj",
                "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
                "attn_k_norm": "self_attn.k_norm", "ffn_norm": "post_attention_layernorm",
                "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}

# llama.cpp's token types (llama_token_type / gguf.TokenType)
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6


# ggml's tensor types (enum ggml_type): the names, for the messages; the four read, with the
# NumPy dtype of their stored values and (values, bytes) per block
_GGML_TYPES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0",
               9: "Q8_1", 10: "Q2_K", 11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K",
               15: "Q8_K", 16: "IQ2_XXS", 17: "IQ2_XS", 18: "IQ3_XXS", 19: "IQ1_S",
               20: "IQ4_NL", 21: "IQ3_S", 22: "IQ2_S", 23: "IQ4_XS", 24: "I8", 25: "I16",
               26: "I32", 27: "I64", 28: "F64", 29: "IQ1_M", 30: "BF16", 34: "TQ1_0",
               35: "TQ2_0", 39: "MXFP4"}
_STORED = {"F32": ("<f4", 1, 4), "F16": ("<f2", 1, 2), "BF16": ("<u2", 1, 2),
           "Q8_0": ("u1", Q8_0_BLOCK, Q8_0_BYTES)}
# GGUF's metadata value types (gguf_type): struct formats of the scalars
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
            10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


class _Header:
    """GGUF's header, parsed from a memory map of the file: the metadata (key -> int, float,
    bool, str, list of str, or a NumPy array for a numeric array) and each tensor's (name,
    ggml type number, shape in ggml's order (ne0 = the row length first), offset)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.pos = 0
        with open(path, "rb") as fh:
            self.size = os.fstat(fh.fileno()).st_size
            self.mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        try:
            self._parse()
        except (struct.error, UnicodeDecodeError, OverflowError, MemoryError) as e:
            raise CheckpointError(f"{path} is a broken or truncated GGUF file: {e}") from None
        finally:
            self.mm.close()

    def _take(self, fmt: str) -> Any:
        value = struct.unpack_from(fmt, self.mm, self.pos)[0]
        self.pos += struct.calcsize(fmt)
        return value

    def _string(self) -> str:
        n = self._take("<Q")
        if self.pos + n > self.size:
            raise CheckpointError(f"{self.path} is truncated (a string runs past the end)")
        text = self.mm[self.pos:self.pos + n].decode("utf-8")
        self.pos += n
        return text

    def _value(self, kind: int) -> Any:
        if kind in _SCALARS:
            return self._take(_SCALARS[kind])
        if kind == _STRING:
            return self._string()
        if kind == _ARRAY:
            item, n = self._take("<I"), self._take("<Q")
            if item == _STRING:
                return [self._string() for _ in range(n)]
            if item not in _SCALARS:
                raise CheckpointError(f"{self.path}: an array of value type {item}")
            dtype = np.dtype(_SCALARS[item])
            end = self.pos + n * dtype.itemsize
            if end > self.size:
                raise CheckpointError(f"{self.path} is truncated (an array runs past the end)")
            values = np.frombuffer(self.mm[self.pos:end], dtype)
            self.pos = end
            return values
        raise CheckpointError(f"{self.path}: a metadata value of unknown type {kind}")

    def _parse(self) -> None:
        self.pos = 4
        version = self._take("<I")
        if version not in (2, 3):
            swapped = int.from_bytes(version.to_bytes(4, "little"), "big")
            if swapped in (2, 3):
                raise NotImplementedError(f"{self.path} is a big-endian GGUF file; mha reads "
                                          f"little-endian ones")
            raise CheckpointError(f"{self.path} is GGUF version {version}; mha reads 2 and 3")
        n_tensors, n_kv = self._take("<Q"), self._take("<Q")
        self.metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = self._string()
            self.metadata[key] = self._value(self._take("<I"))
        self.tensors: list[tuple[str, int, tuple[int, ...], int]] = []
        for _ in range(n_tensors):
            name = self._string()
            n_dims = self._take("<I")
            if n_dims > 4:
                raise CheckpointError(f"{self.path}: tensor {name} has {n_dims} dimensions")
            dims = tuple(self._take("<Q") for _ in range(n_dims))
            self.tensors.append((name, self._take("<I"), dims, self._take("<Q")))
        align = int(self.metadata.get("general.alignment", 32))
        if align <= 0 or align & (align - 1):
            raise CheckpointError(f"{self.path}: general.alignment {align} is not a power of 2")
        self.data_start = -(-self.pos // align) * align


def dequantize_q8_0(blocks: np.ndarray, n_in: int | None = None) -> np.ndarray:
    """Widen Q8_0 blocks to float32, as ggml does: each value is ``d * q``.

    Parameters
    ----------
    blocks : ndarray of uint8, shape (..., n_blocks * 34)
        Rows of ggml ``block_q8_0``: a little-endian float16 scale ``d``, then 32 int8 values
        ``q``; the blocks of a row follow each other along the row.
    n_in : int, optional
        The row's length (the first ``n_in`` values are kept); ``n_blocks * 32`` by default.

    Returns
    -------
    ndarray of float32, shape (..., n_in)
        ``float32(d) * float32(q)``: bit for bit what ggml's ``dequantize_row_q8_0`` gives.

    Raises
    ------
    ValueError
        Rows whose length is not a whole number of blocks.

    Examples
    --------
    >>> block = np.zeros(34, np.uint8)
    >>> block[:2] = np.frombuffer(np.float16(0.5).tobytes(), np.uint8)    # d = 0.5
    >>> block[2:] = np.arange(-16, 16).astype(np.int8).view(np.uint8)     # q = -16 ... 15
    >>> dequantize_q8_0(block)[:4]
    array([-8. , -7.5, -7. , -6.5], dtype=float32)
    """
    blocks = np.asarray(blocks)
    if blocks.dtype != np.uint8 or blocks.ndim == 0 or blocks.shape[-1] % Q8_0_BYTES:
        raise ValueError(f"Q8_0 blocks must be uint8 rows of a multiple of {Q8_0_BYTES} bytes, "
                         f"got {blocks.dtype} {blocks.shape}")
    lead, n_blocks = blocks.shape[:-1], blocks.shape[-1] // Q8_0_BYTES
    n_in = n_blocks * Q8_0_BLOCK if n_in is None else int(n_in)
    rows = blocks.reshape(-1, n_blocks, Q8_0_BYTES)
    out = np.empty((rows.shape[0], n_blocks, Q8_0_BLOCK), np.float32)
    step = max(1, (1 << 22) // max(1, n_blocks * Q8_0_BLOCK))     # ~16 MB of float32 a chunk
    for start in range(0, rows.shape[0], step):
        chunk = rows[start:start + step]
        d = np.ascontiguousarray(chunk[..., :2]).view("<f2").astype(np.float32)
        with np.errstate(invalid="ignore"):         # an inf scale times 0 is NaN, as in ggml
            np.multiply(chunk[..., 2:].view(np.int8), d, out=out[start:start + step],
                        dtype=np.float32)
    out2 = out.reshape(rows.shape[0], n_blocks * Q8_0_BLOCK)
    if n_in != out2.shape[1]:
        out2 = np.ascontiguousarray(out2[:, :n_in])
    return out2.reshape(*lead, n_in)


def _unpermute_rows(n_rows: int, n_heads: int) -> np.ndarray:
    """The row gather that undoes convert_hf_to_gguf.py's ``LlamaModel.permute``: transformers'
    row ``h*d + t*d/2 + j`` (head h, half t, pair j) is the file's row ``h*d + 2*j + t``."""
    d = n_rows // n_heads
    r = np.arange(n_rows)
    h, rem = np.divmod(r, d)
    t, j = np.divmod(rem, d // 2)
    return h * d + 2 * j + t


class _Stored:
    """A tensor's stored values in the file, read when asked for (``np.asarray``), not
    memory-mapped: a mapping's pages would stay in the process's memory beside the model's
    own copy of the weights, as large as the file. ``stored[a:b]``: rows a..b, unread."""
    __slots__ = ("path", "offset", "dtype", "shape")

    def __init__(self, path: Path, offset: int, dtype: np.dtype, shape: tuple[int, ...]):
        self.path, self.offset, self.dtype, self.shape = path, offset, dtype, shape

    def __getitem__(self, rows: slice) -> "_Stored":
        start, stop, _ = rows.indices(self.shape[0])
        row = math.prod(self.shape[1:]) * self.dtype.itemsize
        return _Stored(self.path, self.offset + start * row, self.dtype,
                       (stop - start, *self.shape[1:]))

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        values = np.fromfile(self.path, dtype=self.dtype, count=math.prod(self.shape),
                             offset=self.offset).reshape(self.shape)
        return values if dtype is None else values.astype(dtype)


class GGUFCheckpoint(Mapping):
    """The tensors of a GGUF file under transformers' checkpoint names, read on demand.

    ``checkpoint[name]`` is a new float32 array in torch's layout (out, in), read from the file
    (F16 and BF16 widened, Q8_0 dequantised);
    ``checkpoint.raw(name)`` gives the stored type and values instead. llama files' q_proj and
    k_proj rows are put back in transformers' order on access (a row gather, a copy).
    ``files`` and ``file_of(name)`` are those of :class:`mha.models.hub.Checkpoint`.

    Parameters
    ----------
    path : str or os.PathLike
        The GGUF file (for ``files`` and the messages).
    entries : dict
        name -> (GGUF name, ggml type name, the stored array, its logical shape (out, in),
        a row gather or None), as :func:`read_gguf` builds it.

    See Also
    --------
    read_gguf : opens a file and builds this.

    Examples
    --------
    >>> files = read_gguf("SmolLM2-135M-Q8_0.gguf")                    # doctest: +SKIP
    >>> files.checkpoint.raw("model.layers.0.self_attn.q_proj.weight")[0]  # doctest: +SKIP
    'Q8_0'
    """

    def __init__(self, path: str | os.PathLike[str], entries: dict[str, tuple]) -> None:
        self.path = Path(path)
        self.files = [self.path]
        self._entries = entries

    def file_of(self, name: str) -> Path:
        """The file a tensor is read from (the one GGUF file).

        Parameters
        ----------
        name : str
            A checkpoint name.

        Returns
        -------
        pathlib.Path
            The file.

        Raises
        ------
        KeyError
            A name the file does not hold.
        """
        self._entries[name]                     # KeyError for a name not in the file
        return self.path

    def gguf_name(self, name: str) -> str:
        """The tensor's name in the file ("blk.0.attn_q.weight" for
        "model.layers.0.self_attn.q_proj.weight").

        Parameters
        ----------
        name : str
            A checkpoint name.

        Returns
        -------
        str
            GGUF's name.
        """
        return str(self._entries[name][0])

    def stored_type(self, name: str) -> str:
        """A tensor's ggml type, without reading it.

        Parameters
        ----------
        name : str
            A checkpoint name.

        Returns
        -------
        str
            "F32", "F16", "BF16" or "Q8_0".
        """
        return str(self._entries[name][1])

    def shape(self, name: str) -> tuple[int, ...]:
        """A tensor's shape in torch's layout, without reading it.

        Parameters
        ----------
        name : str
            A checkpoint name.

        Returns
        -------
        tuple of int
            (out, in) for a matrix, (n,) for a vector.
        """
        return tuple(self._entries[name][3])

    def raw(self, name: str) -> tuple[str, np.ndarray]:
        """A tensor as stored: its ggml type and values, rows in transformers' order.

        Parameters
        ----------
        name : str
            A checkpoint name.

        Returns
        -------
        code : str
            "F32", "F16", "BF16" or "Q8_0".
        array : ndarray
            F32: float32 (out, in); F16: float16 (out, in); BF16: the uint16 bit patterns
            (out, in); Q8_0: uint8 (out, in / 32 * 34), each row its ggml blocks (a float16
            scale, then 32 int8). A new array, read from the file.

        Raises
        ------
        KeyError
            A name the file does not hold.
        """
        _, code, stored, _, rows = self._entries[name]
        data = np.asarray(stored)
        if rows is not None:
            data = data[rows]
        return code, data

    def __getitem__(self, name: str) -> np.ndarray:
        code, data = self.raw(name)
        if code == "F32":
            return data
        if code == "F16":
            return data.astype(np.float32)
        if code == "BF16":
            return (data.astype(np.uint32) << 16).view(np.float32)
        return dequantize_q8_0(data, self._entries[name][3][-1])

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)


class GGUFFiles:
    """What :func:`read_gguf` finds in a GGUF file: a config, the tensors and a tokenizer.

    Parameters
    ----------
    path : pathlib.Path
        The file.
    config : dict
        A transformers config.json dict for the model (model_type, the sizes, rms_norm_eps,
        rope_theta and rope_parameters, vocab_size, max_position_embeddings,
        tie_word_embeddings, the special token ids, ...): ``mha.models.ModelConfig.from_dict``
        reads it as it reads a folder's config.json.
    checkpoint : GGUFCheckpoint
        The tensors, by transformers' names.
    tokenizer : mha.models.Tokenizer or None
        The tokenizer the file describes, or None for a kind mha does not build (a warning
        says so); ids work without it.
    metadata : dict
        The file's scalar and string metadata (the arrays, such as the vocabulary, left out).

    Examples
    --------
    >>> files = read_gguf("SmolLM2-135M-Q8_0.gguf")                    # doctest: +SKIP
    >>> files.config["model_type"], files.config["num_hidden_layers"]  # doctest: +SKIP
    ('llama', 30)
    """

    def __init__(self, path: Path, config: dict[str, Any], checkpoint: GGUFCheckpoint,
                 tokenizer: Any, metadata: dict[str, Any]) -> None:
        self.path = path
        self.config = config
        self.checkpoint = checkpoint
        self.tokenizer = tokenizer
        self.metadata = metadata

    def __repr__(self) -> str:
        c = self.config
        return (f"GGUFFiles({str(self.path)!r}, model_type={c['model_type']!r}, "
                f"layers={c['num_hidden_layers']}, tensors={len(self.checkpoint)})")


def _float(x: Any) -> float:
    """A float32 metadata value as the decimal it was written from (1e-06, not 9.99e-07)."""
    return float(str(np.float32(x)))


def read_gguf(path: str | os.PathLike[str]) -> GGUFFiles:
    """Open a GGUF file: its config, its tensors (read on demand) and its tokenizer.

    Parameters
    ----------
    path : str or os.PathLike
        A GGUF file (version 2 or 3, little-endian) of a supported architecture
        (``SUPPORTED_ARCHITECTURES``: llama, qwen2, qwen3), its tensors F32, F16, BF16 or Q8_0.

    Returns
    -------
    GGUFFiles
        ``config`` (a transformers config.json dict), ``checkpoint`` (the tensors under
        transformers' names, torch's layout), ``tokenizer`` (or None) and ``metadata``.

    Raises
    ------
    FileNotFoundError
        No such file.
    CheckpointError
        A file that is not GGUF, or a broken one.
    NotImplementedError
        An architecture, a tensor type (Q4_K, ...), a RoPE scaling or a tensor mha does not
        read; the message says what it reads.

    Examples
    --------
    >>> files = read_gguf("SmolLM2-135M-Q8_0.gguf")                    # doctest: +SKIP
    >>> files.checkpoint["model.embed_tokens.weight"].shape            # doctest: +SKIP
    (49152, 576)
    >>> files.tokenizer("Hello world").ids                             # doctest: +SKIP
    [19556, 905]
    """
    path = Path(path)
    with open(path, "rb") as fh:
        magic = fh.read(4)
    if magic != b"GGUF":
        raise CheckpointError(f"{path} is not a GGUF file (it starts with {magic!r}, not "
                              f"b'GGUF')")
    header = _Header(path)
    meta = header.metadata

    def value(key: str, default: Any = None) -> Any:
        return meta.get(key, default)

    arch = value("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise NotImplementedError(
            f"{path}: GGUF architecture {arch!r} is not supported; mha reads "
            f"{', '.join(SUPPORTED_ARCHITECTURES)} (LLaMA, Mistral, Qwen2, Qwen3)")
    if value(f"{arch}.expert_count"):
        raise NotImplementedError(f"{path}: a mixture of experts ({arch}.expert_count = "
                                  f"{value(f'{arch}.expert_count')}) is not supported")

    size = path.stat().st_size
    tensors = {}
    for name, kind, dims, offset in header.tensors:
        code = _GGML_TYPES.get(kind, f"ggml type {kind}")
        if code not in TENSOR_TYPES:
            raise NotImplementedError(
                f"{path}: tensor {name} is {code}, which mha does not read yet; it reads "
                f"{', '.join(TENSOR_TYPES)} (convert with --outtype q8_0, bf16, f16 or f32)")
        dtype, per_block, block_bytes = _STORED[code]
        shape = tuple(reversed(dims))               # NumPy's order: (out, in)
        if shape and shape[-1] % per_block:
            raise CheckpointError(f"{path}: {name} is {code} with rows of {shape[-1]} values, "
                                  f"not a whole number of blocks of {per_block}")
        row_bytes = (shape[-1] if shape else 1) // per_block * block_bytes
        begin = header.data_start + offset
        end = begin + math.prod(shape[:-1]) * row_bytes
        if end > size:
            raise CheckpointError(f"{path}: tensor {name} ({code} {shape}) lies outside the "
                                  f"file (truncated?)")
        stored = _Stored(path, begin, np.dtype(dtype),
                         (*shape[:-1], row_bytes // np.dtype(dtype).itemsize))
        tensors[name] = (code, stored, shape)

    config = _config(path, arch, value, tensors)
    checkpoint = GGUFCheckpoint(path, _entries(path, arch, config, tensors))
    metadata = {k: v for k, v in meta.items() if not isinstance(v, (list, np.ndarray))}
    tokenizer = _tokenizer(value, config)
    return GGUFFiles(path, config, checkpoint, tokenizer, metadata)


# -- the config ----------------------------------------------------------------------------------

def _config(path: Path, arch: str, value: Any, tensors: dict[str, tuple]) -> dict[str, Any]:
    """A transformers config.json dict from the file's ``{arch}.*`` metadata and tensors."""
    def need(key: str) -> Any:
        v = value(f"{arch}.{key}")
        if v is None:
            raise CheckpointError(f"{path} has no {arch}.{key} in its metadata")
        return v

    d_model, n_heads = int(need("embedding_length")), int(need("attention.head_count"))
    n_kv = int(value(f"{arch}.attention.head_count_kv") or n_heads)
    head_dim = int(value(f"{arch}.attention.key_length") or d_model // n_heads)
    rope_dim = value(f"{arch}.rope.dimension_count")
    if rope_dim is not None and int(rope_dim) != head_dim:
        raise NotImplementedError(f"{path}: a rotary embedding over {rope_dim} of a head's "
                                  f"{head_dim} dimensions is not supported for {arch}")
    if "token_embd.weight" not in tensors:
        raise CheckpointError(f"{path} has no token_embd.weight")
    n_vocab = value(f"{arch}.vocab_size")
    if n_vocab is None:
        n_vocab = tensors["token_embd.weight"][2][0]
    theta = _float(value(f"{arch}.rope.freq_base", 10000.0))
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": theta}
    kind = value(f"{arch}.rope.scaling.type")
    if kind == "linear":
        rope.update(rope_type="linear", factor=_float(need("rope.scaling.factor")))
    elif kind not in (None, "none"):
        raise NotImplementedError(f"{path}: RoPE scaling {kind!r} is not supported; mha runs "
                                  f"'linear' and 'llama3'")
    if "rope_freqs.weight" in tensors:
        if rope["rope_type"] != "default":
            raise NotImplementedError(f"{path}: rope_freqs with a {kind} scaling")
        rope.update(_llama3_scaling(path, tensors["rope_freqs.weight"], theta, head_dim,
                                    value(f"{arch}.context_length")))
    blk = "blk.0."
    model_type = SUPPORTED_ARCHITECTURES[arch]
    config: dict[str, Any] = {
        "architectures": [_HF_CLASSES[arch]],
        "model_type": model_type,
        "hidden_size": d_model,
        "intermediate_size": int(need("feed_forward_length")),
        "num_hidden_layers": int(need("block_count")),
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": _float(need("attention.layer_norm_rms_epsilon")),
        "rope_theta": theta,
        "rope_parameters": rope,
        "max_position_embeddings": int(value(f"{arch}.context_length", 2048)),
        "vocab_size": int(n_vocab),
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": blk + "attn_q.bias" in tensors,
        "mlp_bias": blk + "ffn_gate.bias" in tensors,
        "bos_token_id": value("tokenizer.ggml.bos_token_id"),
        "eos_token_id": value("tokenizer.ggml.eos_token_id"),
    }
    if rope["rope_type"] != "default":           # transformers 4's names of the same
        config["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
    if value("tokenizer.ggml.padding_token_id") is not None:
        config["pad_token_id"] = value("tokenizer.ggml.padding_token_id")
    if model_type in ("qwen2", "qwen3"):
        config["use_sliding_window"] = False     # GGUF records no window for these
    return config


def _llama3_scaling(path: Path, rope_freqs: tuple, theta: float, head_dim: int,
                    context: Any) -> dict[str, Any]:
    """Llama 3.1's RoPE scaling from the rope_freqs tensor llama.cpp writes in its place.

    The converter stores, per frequency f_i = theta^(-2i/d) with wavelength w_i = 2 pi / f_i,
    the factor r_i the wavelength is stretched by: 1 below ``L / high``, ``factor`` above
    ``L / low``, and between them 1 / r = (1 - s) / factor + s with s = (L / w - low) /
    (high - low), where L is the original context. ``factor`` is the largest r; s is linear in
    1 / w, s = a / w - b with a = L / (high - low), b = low / (high - low), which fixes the two
    thresholds L / low = a / b and L / high = a / (b + 1) (all that the scaling depends on).
    With low_freq_factor 1 (every released Llama 3.x), L = a / b and high = 1 + 1 / b. The
    parameters found are checked by recomputing every r; a mismatch raises."""
    code, data, _ = rope_freqs
    if code != "F32":
        raise NotImplementedError(f"{path}: rope_freqs is {code}, expected F32")
    r = np.asarray(data, np.float64).reshape(-1)
    if r.size != head_dim // 2:
        raise NotImplementedError(f"{path}: rope_freqs has {r.size} factors for a head of "
                                  f"{head_dim}")
    freqs = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * np.pi / freqs
    factor = float(r.max())

    def factors(low: float, high: float, old: float) -> np.ndarray:
        s = (old / wavelen - low) / (high - low)
        middle = 1 / ((1 - s) / factor + s)
        return np.where(wavelen < old / high, 1.0, np.where(wavelen > old / low, factor, middle))

    candidates = []
    between = (r > 1 + 1e-6) & (r < factor * (1 - 1e-6))
    if factor > 1 and between.sum() >= 2:
        s = (1 / r[between] - 1 / factor) / (1 - 1 / factor)
        slope, intercept = np.polyfit(1 / wavelen[between], s, 1)
        a, b = slope, -intercept
        if a > 0 and b > 0:
            old, high = a / b, 1 + 1 / b
            candidates += [(1.0, round(high, 6), int(round(old))), (1.0, high, old)]
    elif factor > 1 and between.sum() == 1:     # one point: Llama 3's high_freq_factor 4
        i = int(np.flatnonzero(between)[0])
        s = (1 / r[i] - 1 / factor) / (1 - 1 / factor)
        old = wavelen[i] * (3 * s + 1)
        candidates += [(1.0, 4.0, int(round(old))), (1.0, 4.0, old)]
    elif factor > 1:                            # no point between: any L in the gap
        short = wavelen[r <= 1 + 1e-6].max(initial=0.0)
        long = wavelen[r >= factor * (1 - 1e-6)].min(initial=np.inf)
        if 4 * short < long:
            candidates.append((1.0, 4.0, float(math.sqrt(4 * short * long))))
    for low, high, old in candidates:
        if np.allclose(factors(low, high, old), r, rtol=1e-5, atol=0):
            return {"rope_type": "llama3", "factor": factor, "low_freq_factor": low,
                    "high_freq_factor": high, "original_max_position_embeddings": old}
    if factor == 1 and np.all(r == 1):
        return {}
    raise NotImplementedError(f"{path}: its rope_freqs factors are not a llama3 RoPE scaling "
                              f"(the one mha reads from rope_freqs)")


# -- the tensors --------------------------------------------------------------------------------

def _hf_name(name: str) -> str | None:
    """transformers' name of a GGUF tensor name, or None for one this module does not map."""
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    parts = name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() \
            and parts[2] in _BLOCK_NAMES and parts[3] in ("weight", "bias"):
        return f"model.layers.{parts[1]}.{_BLOCK_NAMES[parts[2]]}.{parts[3]}"
    return None


def _entries(path: Path, arch: str, config: dict[str, Any],
             tensors: dict[str, tuple]) -> dict[str, tuple]:
    """name -> (GGUF name, type, data, shape, rows) for every tensor of the model; a fused
    attn_qkv is split into q, k and v (row slices); llama's q and k get their row gather."""
    n_heads, n_kv = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config["head_dim"]
    entries: dict[str, tuple] = {}
    for name, (code, data, shape) in tensors.items():
        if name == "rope_freqs.weight":             # read into config["rope_parameters"]
            continue
        parts = name.split(".")
        if len(parts) == 4 and parts[0] == "blk" and parts[2] == "attn_qkv":
            sizes = [n_heads * head_dim, n_kv * head_dim, n_kv * head_dim]
            if shape[0] != sum(sizes):
                raise CheckpointError(f"{path}: {name} has {shape[0]} rows, expected "
                                      f"{sum(sizes)} (q, k and v)")
            start = 0
            for proj, size in zip("qkv", sizes):
                part = f"blk.{parts[1]}.attn_{proj}.{parts[3]}"
                entries[part] = (name, code, data[start:start + size], (size, *shape[1:]))
                start += size
            continue
        entries[name] = (name, code, data, shape)
    out: dict[str, tuple] = {}
    for name, (source, code, data, shape) in entries.items():
        hf = _hf_name(name)
        if hf is None:
            raise NotImplementedError(f"{path}: tensor {name} ({arch}) is not one mha reads")
        rows = None
        if arch in _PERMUTED and hf.endswith(("self_attn.q_proj.weight", "self_attn.q_proj.bias",
                                             "self_attn.k_proj.weight", "self_attn.k_proj.bias")):
            heads = n_heads if ".q_proj." in hf else n_kv
            if shape[0] % (2 * heads):
                raise CheckpointError(f"{path}: {name} has {shape[0]} rows, not a whole "
                                      f"number of {heads} heads of pairs")
            rows = _unpermute_rows(shape[0], heads)
        out[hf] = (source, code, data, shape, rows)
    return out


# -- the tokenizer ------------------------------------------------------------------------------

_LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}"
                 r"\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+"
                r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def _split(regex: str) -> dict[str, Any]:
    return {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated",
            "invert": False}


_BYTE_LEVEL = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
               "use_regex": False}
_GPT2_BYTE_LEVEL = dict(_BYTE_LEVEL, use_regex=True)
_DIGITS = {"type": "Digits", "individual_digits": True}
#: llama.cpp's pre-tokenizer names (tokenizer.ggml.pre) -> (the tokenizers pre-tokenizers as in
#: the released models' tokenizer.json, ignore_merges, add BOS when the file does not say);
#: the regexes of llama.cpp's llm_tokenizer_bpe for the same names
_PRE_TOKENIZERS: dict[str, tuple[list[dict[str, Any]], bool, bool]] = {}
for _names, _pre, _ignore, _bos in [
        (("llama-bpe", "llama3", "llama-v3", "falcon3", "pixtral"),
         [_split(_LLAMA3_REGEX), _BYTE_LEVEL], True, True),
        (("dbrx", "smaug-bpe"), [_split(_LLAMA3_REGEX), _BYTE_LEVEL], False, False),
        (("qwen2", "deepseek-r1-qwen", "stablelm2"), [_split(_QWEN2_REGEX), _BYTE_LEVEL],
         False, False),
        (("smollm", "starcoder", "refact", "codeshell"), [_DIGITS, _GPT2_BYTE_LEVEL], False,
         False),
        (("gpt-2", "gpt2", "phi-2", "olmo", "mpt"), [_GPT2_BYTE_LEVEL], False, False)]:
    for _name in _names:
        _PRE_TOKENIZERS[_name] = (_pre, _ignore, _bos)


def _tokenizer(value: Any, config: dict[str, Any]) -> Any:
    """mha's Tokenizer for the file's vocabulary: byte-level BPE (tokenizer.ggml.model "gpt2")
    with a known pre-tokenizer, or SentencePiece's BPE ("llama"); None with a warning for
    another kind, or a vocabulary the tokenizers library rejects."""
    kind, pre = value("tokenizer.ggml.model"), value("tokenizer.ggml.pre") or "default"
    if kind not in ("gpt2", "llama"):
        warnings.warn(f"a GGUF tokenizer of kind {kind!r} is not built (mha builds byte-level "
                      f"BPE, 'gpt2', and SentencePiece, 'llama'); the model runs on token ids",
                      stacklevel=3)
        return None
    if kind == "gpt2" and pre not in _PRE_TOKENIZERS:
        warnings.warn(f"the GGUF pre-tokenizer {pre!r} is not built (mha builds "
                      f"{', '.join(sorted(_PRE_TOKENIZERS))}); the model runs on token ids",
                      stacklevel=3)
        return None
    from tokenizers import Tokenizer as _HFTokenizer

    from .tokenizer import Tokenizer

    spec = _bpe_spec(value, pre) if kind == "gpt2" else _spm_spec(value)
    try:
        tok = _HFTokenizer.from_str(json.dumps(spec))
    except Exception as e:                      # tokenizers raises a bare Exception
        warnings.warn(f"the GGUF file's tokenizer could not be built ({e}); the model runs on "
                      f"token ids", stacklevel=3)
        return None
    return Tokenizer(tok, max_length=config.get("max_position_embeddings"))


def _added_and_post(value: Any, tokens: list[str], types: list[int],
                    default_bos: bool) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    """The added tokens (CONTROL ones special, USER_DEFINED ones not) and the template that
    adds BOS / EOS as tokenizer.ggml.add_bos_token / add_eos_token say."""
    added = [{"id": i, "content": token, "single_word": False, "lstrip": False,
              "rstrip": False, "normalized": False, "special": kind == _CONTROL}
             for i, (token, kind) in enumerate(zip(tokens, types))
             if kind in (_CONTROL, _USER_DEFINED)]
    bos, eos = value("tokenizer.ggml.bos_token_id"), value("tokenizer.ggml.eos_token_id")
    add_bos = bool(value("tokenizer.ggml.add_bos_token", default_bos)) and bos is not None
    add_eos = bool(value("tokenizer.ggml.add_eos_token", False)) and eos is not None
    if not (add_bos or add_eos):
        return added, None
    first = [{"SpecialToken": {"id": tokens[bos], "type_id": 0}}] if add_bos else []
    last = [{"SpecialToken": {"id": tokens[eos], "type_id": 0}}] if add_eos else []
    specials = {tokens[i]: {"id": tokens[i], "ids": [i], "tokens": [tokens[i]]}
                for i, on in ((bos, add_bos), (eos, add_eos)) if on}
    return added, {"type": "TemplateProcessing",
                   "single": [*first, {"Sequence": {"id": "A", "type_id": 0}}, *last],
                   "pair": [*first, {"Sequence": {"id": "A", "type_id": 0}}, *last, *first,
                            {"Sequence": {"id": "B", "type_id": 1}}, *last],
                   "special_tokens": specials}


def _token_types(value: Any, tokens: list[str]) -> list[int]:
    types = value("tokenizer.ggml.token_type")
    return [_NORMAL] * len(tokens) if types is None else [int(t) for t in types]


def _spm_spec(value: Any) -> dict[str, Any]:
    """tokenizer.json for SentencePiece's BPE (LLaMA 1/2, Mistral v0.x, TinyLlama), as
    transformers converts a tokenizer.model: the merges ranked by the merged piece's score
    (transformers' generate_merges), bytes falling back to <0xNN>, "▁" for spaces and one
    in front of the text (tokenizer.ggml.add_space_prefix, on by default)."""
    tokens = list(value("tokenizer.ggml.tokens") or [])
    types = _token_types(value, tokens)
    scores = value("tokenizer.ggml.scores")
    scores = [0.0] * len(tokens) if scores is None else [float(x) for x in scores]
    vocab: dict[str, int] = {}
    for i, token in enumerate(tokens):
        vocab.setdefault(token, i)
    merges = []
    for piece, score in zip(tokens, scores):
        local = [(piece[:k], piece[k:], score) for k in range(1, len(piece))
                 if piece[:k] in vocab and piece[k:] in vocab]
        merges.extend(sorted(local, key=lambda m: (vocab[m[0]], vocab[m[1]])))
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    unk = value("tokenizer.ggml.unknown_token_id")
    added, template = _added_and_post(value, tokens, types, default_bos=True)
    prefix = bool(value("tokenizer.ggml.add_space_prefix", True))
    return {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
        # one "\u2581" in front of every stretch of text, after a special token too, as
        # SentencePiece's add_dummy_prefix and llama.cpp's add_space_prefix do (transformers'
        # "legacy" normaliser; its Metaspace adds none to a text that starts with a space)
        "normalizer": {"type": "Sequence", "normalizers": [
            *([{"type": "Prepend", "prepend": "\u2581"}] if prefix else []),
            {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"}]},
        "pre_tokenizer": None,
        "post_processor": template,
        "decoder": {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
            {"type": "ByteFallback"}, {"type": "Fuse"},
            *([{"type": "Strip", "content": " ", "start": 1, "stop": 0}] if prefix else [])]},
        "model": {"type": "BPE", "dropout": None,
                  "unk_token": tokens[unk] if unk is not None else None,
                  "continuing_subword_prefix": None, "end_of_word_suffix": None,
                  "fuse_unk": True, "byte_fallback": True, "ignore_merges": False,
                  "vocab": vocab, "merges": [[a, b] for a, b, _ in merges]},
    }


def _bpe_spec(value: Any, pre: str) -> dict[str, Any]:
    """tokenizer.json for byte-level BPE with llama.cpp's pre-tokenizer ``pre``."""
    pre_tokenizers, ignore_merges, default_bos = _PRE_TOKENIZERS[pre]
    tokens = list(value("tokenizer.ggml.tokens") or [])
    types = _token_types(value, tokens)
    merges = [m.split(" ", 1) for m in value("tokenizer.ggml.merges") or []]
    vocab: dict[str, int] = {}
    for i, token in enumerate(tokens):
        vocab.setdefault(token, i)
    added, template = _added_and_post(value, tokens, types, default_bos)
    post: dict[str, Any] = {"type": "ByteLevel", "add_prefix_space": False,
                            "trim_offsets": False, "use_regex": False}
    if template is not None:
        post = {"type": "Sequence", "processors": [post, template]}
    return {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": pre_tokenizers},
        "post_processor": post,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True,
                    "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None,
                  "continuing_subword_prefix": None, "end_of_word_suffix": None,
                  "fuse_unk": False, "byte_fallback": False, "ignore_merges": ignore_merges,
                  "vocab": vocab, "merges": merges},
    }
