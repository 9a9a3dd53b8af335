"""GPT-2: pre-LayerNorm decoder, causal attention.

    x = tok_emb[ids] + pos_emb[0..n)
    for each layer:
        h = LN_1(x)
        x = x + attention(h W_q + b_q, h W_k + b_k, h W_v + b_v, causal) W_o + b_o   # mha.attention
        x = x + gelu_tanh(LN_2(x) W_fc + b_fc) W_proj + b_proj
    hidden_states = [emb, out_0, ..., out_{L-2}, LN_f(out_{L-1})]   (as transformers reports them)

GPT-2's Conv1D stores weights (in, out), so ``x @ W`` needs no transpose; ``c_attn`` already
holds [W_q | W_k | W_v] as one (d, 3d) matrix. Checkpoint names are Hugging Face's
(``h.{i}.attn.c_attn.weight`` ...), with or without the ``transformer.`` prefix of
GPT2LMHeadModel; the causal-mask buffers (``attn.bias``, ``attn.masked_bias``) of old
checkpoints are ignored.
"""
from __future__ import annotations

import numpy as np

from . import ops
from .backward import DecoderLayout
from .base import TransformerModel, family_doc
from .causal import CausalLM
from .tape import Differentiable


@family_doc
class GPT2Model(CausalLM, Differentiable, TransformerModel):
    """Run GPT-2 (model_type "gpt2") in NumPy on mha's C attention kernels.
    """
    anchor = "wte.weight"
    _pos_embed = True
    ln_f: tuple[np.ndarray, np.ndarray]                    # the final LayerNorm: gain, bias
    _grad_layout = DecoderLayout(
        ln1=("ln_1_weight", "ln_1_bias"), ln2=("ln_2_weight", "ln_2_bias"),
        final=("ln_f_weight", "ln_f_bias"), attention=("W_qkv", "b_qkv", "W_o", "b_o"),
        mlp=("W_fc", "b_fc", "W_proj", "b_proj"), gated=False, embed="wte", positions="wpe")

    def _load(self, read):
        cfg = self.config
        d, f = cfg.d_model, cfg.d_ff

        def norm(name: str) -> tuple[np.ndarray, np.ndarray]:
            return read(name + ".weight", (d,)), read(name + ".bias", (d,))

        self.wte = self._table(read("wte.weight", (cfg.vocab_size, d)))      # tied with the LM head
        self.wpe = read("wpe.weight", (cfg.max_positions, d))
        self.ln_f = norm("ln_f")
        self.layers = []
        for i in range(cfg.n_layers):
            p = f"h.{i}."
            (g_1, c_1), (g_2, c_2) = norm(p + "ln_1"), norm(p + "ln_2")
            self.layers.append(self._keep({
                "ln_1_weight": g_1, "ln_1_bias": c_1,
                "W_qkv": read(p + "attn.c_attn.weight", (d, 3 * d)),
                "b_qkv": read(p + "attn.c_attn.bias", (3 * d,)),
                "W_o": read(p + "attn.c_proj.weight", (d, d)),
                "b_o": read(p + "attn.c_proj.bias", (d,)),
                "ln_2_weight": g_2, "ln_2_bias": c_2,
                "W_fc": read(p + "mlp.c_fc.weight", (d, f)),
                "b_fc": read(p + "mlp.c_fc.bias", (f,)),
                "W_proj": read(p + "mlp.c_proj.weight", (f, d)),
                "b_proj": read(p + "mlp.c_proj.bias", (d,)),
            }))
        self._act = ops.activation(cfg.activation)

    def _stored(self):
        params = {"wte": self.wte, "wpe": self.wpe,
                  "ln_f_weight": self.ln_f[0], "ln_f_bias": self.ln_f[1]}
        for i, layer in enumerate(self.layers):
            params.update({f"layers.{i}.{k}": v for k, v in layer.stored().items()})
        return params

    def attention_scale(self, layer):
        """Return the factor on q k^T in a layer, following config.json's GPT-2 options.

        1 / sqrt(d_head) with ``scale_attn_weights`` (else 1), further divided by layer + 1 with
        ``scale_attn_by_inverse_layer_idx``.

        Parameters
        ----------
        layer : int
            The layer (negative counts from the end).

        Returns
        -------
        float
            The scale.

        Raises
        ------
        IndexError
            A layer out of range.
        """
        layer = self._layer_index(layer)
        s = 1.0 / np.sqrt(self.config.d_head) if self.config.scale_attn_weights else 1.0
        if self.config.scale_attn_by_inverse_layer_idx:
            s /= float(layer + 1)
        return s
