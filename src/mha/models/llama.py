"""The LLaMA family (LlamaForCausalLM, Qwen2ForCausalLM, MistralForCausalLM): pre-RMSNorm
causal decoders with rotary positions, grouped-query attention and a SwiGLU MLP.

    x = tok_emb[ids]
    for each layer:
        h = RMSNorm_1(x)
        q, k, v = h W_q (+ b_q), h W_k (+ b_k), h W_v (+ b_v)      # H, H_kv, H_kv heads
        q, k = rope(q), rope(k)                                      # position of each token
        x = x + attention(q, k, v, causal [, sliding window]) W_o (+ b_o)   # mha.attention, GQA
        x = x + (silu(RMSNorm_2(x) W_gate) * (RMSNorm_2(x) W_up)) W_down
    hidden_states = [emb, out_0, ..., out_{L-2}, RMSNorm_f(out_{L-1})]  (as transformers)
    logits = hidden_states[-1] W_vocab^T        (W_vocab = tok_emb when the embeddings are tied)

The three differ in their config.json: Qwen2 has q, k, v biases (always) and an optional
sliding window on its upper layers (``use_sliding_window``, ``max_window_layers``); Mistral a
sliding window on every layer when ``sliding_window`` is set (query i sees keys
i - W < j <= i); LLaMA optional biases (``attention_bias``, ``mlp_bias``), ``head_dim`` and
the "linear" and "llama3" RoPE scalings (all three read ``rope_theta`` and ``rope_scaling``).

Checkpoint names are Hugging Face's (``model.layers.{i}.self_attn.q_proj.weight`` ...);
``lm_head.weight`` when the embeddings are untied. A base model (LlamaModel, Qwen2Model,
MistralModel, as ``save_pretrained`` writes it and as embedding models built on these families
ship) has its names without ``model.`` and no ``lm_head.weight``: with untied embeddings it
loads without an LM head (``has_lm_head`` False: no logits, no generate). The q, k and v
projections are fused into one (d, (H + 2 H_kv) d_head) matrix and gate and up into one
(d, 2 d_ff) matrix, so a layer does four products. The rotary tables are computed in float64
and rounded once to the model's dtype (transformers computes the angles in float32).
"""
from __future__ import annotations

import numpy as np

from . import ops
from .backward import DecoderLayout
from .base import TransformerModel
from .causal import CausalLM
from .tape import Differentiable


class LlamaModel(CausalLM, Differentiable, TransformerModel):
    """Run a LLaMA-family decoder (model_type "llama", "qwen2", "mistral") on mha's C kernels.

    Grouped-query attention runs on the kernel's own GQA (no repeated keys).

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
    anchor = "embed_tokens.weight"
    rotary = True
    rms_norm = True
    _gated = True
    _grad_layout = DecoderLayout(
        ln1=("input_norm", None), ln2=("post_attention_norm", None), final=("norm", None),
        attention=("W_qkv", "b_qkv", "W_o", "b_o"), mlp=("W_gate_up", "b_gate_up", "W_down",
                                                          "b_down"),
        gated=True, embed="embed_tokens", positions=None)

    def _load(self, read):
        cfg = self.config
        d, f, dh = cfg.d_model, cfg.d_ff, cfg.d_head
        H, H_kv = cfg.n_heads, cfg.n_kv_heads

        def dense(name, n_in, n_out, bias):        # torch Linear (out, in) -> (in, out)
            w = read(name + ".weight", (n_out, n_in)).T
            return w, (read(name + ".bias", (n_out,)) if bias else None)

        self.embed_tokens = read("embed_tokens.weight", (cfg.vocab_size, d))
        self.norm = read("norm.weight", (d,))
        self.lm_head = None                                 # tied: the LM head is embed_tokens
        if not cfg.tie_word_embeddings:
            if not read.has("lm_head.weight", prefixed=False) and read.prefix == "":
                self.has_lm_head = False                        # a base-model folder
            else:
                self.lm_head = read("lm_head.weight", (cfg.vocab_size, d), prefixed=False)
        self.layers = []
        for i in range(cfg.n_layers):
            p = f"layers.{i}."
            attn = [dense(p + f"self_attn.{s}_proj", d, h * dh, cfg.attention_bias)
                    for s, h in (("q", H), ("k", H_kv), ("v", H_kv))]
            w_o, b_o = dense(p + "self_attn.o_proj", H * dh, d, cfg.attention_out_bias)
            mlp = [dense(p + f"mlp.{s}_proj", d, f, cfg.mlp_bias) for s in ("gate", "up")]
            w_down, b_down = dense(p + "mlp.down_proj", f, d, cfg.mlp_bias)
            layer = {
                "input_norm": read(p + "input_layernorm.weight", (d,)),
                "W_qkv": np.ascontiguousarray(np.concatenate([w for w, _ in attn], axis=1)),
                "W_o": np.ascontiguousarray(w_o),
                "post_attention_norm": read(p + "post_attention_layernorm.weight", (d,)),
                "W_gate_up": np.ascontiguousarray(np.concatenate([w for w, _ in mlp], axis=1)),
                "W_down": np.ascontiguousarray(w_down),
            }
            if cfg.attention_bias:
                layer["b_qkv"] = np.concatenate([b for _, b in attn])
            if cfg.attention_out_bias:
                layer["b_o"] = b_o
            if cfg.mlp_bias:
                layer["b_gate_up"] = np.concatenate([b for _, b in mlp])
                layer["b_down"] = b_down
            self.layers.append(layer)
        self._act = ops.activation(cfg.activation)
        self._frequencies = ops.rope_frequencies(dh, cfg.rope_theta, cfg.rope_scaling)
        self._rope_cache = ops.rope_table(0, 0, self._frequencies, self.dtype)

    def parameters(self):
        """Return every weight by name.

        Returns
        -------
        dict of str to ndarray
            Dense weights stored (in, out).
        """
        params = {"embed_tokens": self.embed_tokens, "norm": self.norm}
        if self.lm_head is not None:
            params["lm_head"] = self.lm_head
        for i, layer in enumerate(self.layers):
            params.update({f"layers.{i}.{k}": v for k, v in layer.items()})
        return params

    def _vocab_matrix(self):
        if not self.has_lm_head:
            raise self._no_lm_head()
        return self.embed_tokens if self.lm_head is None else self.lm_head

    def _final_norm(self, x: np.ndarray) -> np.ndarray:
        """The final RMSNorm (gain) over the last axis of x (..., d_model)."""
        d = x.shape[-1]
        return ops.rms_norm(x.reshape(-1, d), self.norm, self.config.norm_eps).reshape(x.shape)

    def _rope(self, start, stop):
        """cos, sin (stop - start, d_head / 2) for positions [start, stop), from a table kept
        for the longest length seen (grown by doubling)."""
        cos, sin = self._rope_cache
        if len(cos) < stop:
            cos, sin = self._rope_cache = ops.rope_table(
                0, max(stop, 2 * len(cos)), self._frequencies, self.dtype)
        return cos[start:stop], sin[start:stop]

