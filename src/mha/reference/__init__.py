"""Pure NumPy multi-head attention: the oracle the C kernels are tested against.

Everything here follows docs/semantics.md to the letter and is written to be read, like a
textbook's NumPy: one step per line, shapes in the comments, no tricks. It is
slow on purpose; `mha.attention` and `mha.MultiHeadAttention` are the fast C twins with the same
signatures. This package never imports the C path, and the C path never imports it: what both
share (argument checks, parameters, the layer's bookkeeping) is in `mha.checks` and
`mha.layer_base`.

Mask convention
    A bool mask is True where a query MAY attend to a key and False where the key is masked,
    like the textbook `mask == 0 -> -inf` and torch.nn.functional.scaled_dot_product_attention.
    This is the OPPOSITE of torch.nn.MultiheadAttention, whose bool masks are True = masked:
    pass `~torch_mask` here. Integer masks count as bool (nonzero = may attend); a float mask
    is added to the scores. Masks broadcast to the scores' shape (..., n_q, n_k).
    `key_padding_mask` of the layer is (B, n_k) bool with True = real token, False = padding.

Modules:

- ``dropout``: splitmix64, dropout_keep, the counter-based dropout RNG;
- ``sdpa``: attention, attention_backward, scaled dot-product attention;
- ``layer``: MultiHeadAttention, the full layer, forward and backward;
- ``narrow``: the narrow weight formats (bfloat16, ggml's Q8_0) and their packed layout, the
  twins of the C core's packing for ``mha._core.linear(..., format=...)``;
- ``block``: the rest of a transformer block (dense layer with activation, LayerNorm, RMSNorm,
  RoPE, embedding gather, their backward, the cross-entropy and the Adam step), the twins of
  ``mha._C``'s block kernels.

The parameter helpers init_params, params_from_torch, prune_params and KVCache are
`mha.layer_base`'s, importable from here too.
"""
from ..layer_base import KVCache, init_params, params_from_torch, prune_params
from .dropout import dropout_keep, splitmix64
from .layer import MultiHeadAttention
from .narrow import dequantize_q8_0, from_bfloat16, quantize_q8_0, to_bfloat16
from .sdpa import attention, attention_backward, row_statistics

__all__ = [
    "splitmix64",
    "dropout_keep",
    "attention",
    "attention_backward",
    "row_statistics",
    "init_params",
    "params_from_torch",
    "prune_params",
    "KVCache",
    "MultiHeadAttention",
    "to_bfloat16",
    "from_bfloat16",
    "quantize_q8_0",
    "dequantize_q8_0",
]
