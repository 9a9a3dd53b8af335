"""Qwen3 (Qwen3ForCausalLM): LLaMA's decoder with q and k RMS-normed over each head before
the rotary embedding (QK-norm, gains ``self_attn.q_norm`` and ``k_norm`` of d_head), no q/k/v
biases, and sliding windows on the layers from ``max_window_layers`` on when
``use_sliding_window`` is set."""
from __future__ import annotations

from dataclasses import replace

from .llama import LlamaModel

__all__ = ["Qwen3Model"]


class Qwen3Model(LlamaModel):
    """Run a Qwen3 decoder (model_type "qwen3") on mha's C kernels.

    Parameters
    ----------
    config : ModelConfig
        The sizes and options read from config.json.
    checkpoint : mapping of str to array
        The tensors of the safetensors files, by name.
    tokenizer : Tokenizer, optional
        Without one the model runs on ids only.
    dtype : {numpy.float32, numpy.float64}, default numpy.float32
        What the model computes in.
    name : str, optional
        A name for ``repr``.
    folder : path, optional
        Where the model was read from.

    Raises
    ------
    CheckpointError
        A missing or wrongly shaped tensor (the message names the file and the tensor).

    See Also
    --------
    mha.models.load : Builds the right class from a folder.
    """
    _grad_layout = replace(LlamaModel._grad_layout, qk_norm=("q_norm", "k_norm"))
