"""Causal language models (GPT-2, the LLaMA family): next-token logits and generation on a
KV cache, with the attention of every generated token.

The models keep one `mha.KVCache` per layer and call the attention kernel on views of it,
rather than mha.MultiHeadAttention's ``cache=``: in the LLaMA family the rotary embedding sits
between the projection and the attention, where the layer's fused C forward has no place for
it, and the same mechanism then serves GPT-2. A layer's new keys and values are appended as
rows (``KVCache.append``) and the kernel reads the heads view ``[:, :, :length]`` (last axis
contiguous) without gathering anything.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np
from numpy.typing import ArrayLike

from .. import checks
from ..layer_base import KVCache
from . import ops, weights
from .base import TransformerModel
from .encoding import Encoding
from .hooks import NO_HOOKS, HookFn, HookPoints, NameFilter


@dataclass
class Generation(Encoding):
    """Hold the result of ``model.generate``: an :class:`Encoding` of prompt and new tokens.

    Every view and metric that takes attentions (L, H, n, n) and tokens takes it as it is.

    Parameters
    ----------
    tokens : list of str
        The n_total tokens, prompt first.
    input_ids : ndarray of int64, shape (n_total,)
        Their ids.
    attention_mask : ndarray of bool, shape (n_total,)
        All True.
    hidden_states : ndarray, shape (L + 1, n_total, d_model)
        As ``model(input_ids).hidden_states``.
    attentions : ndarray, shape (L, H, n_total, n_total), optional
        Lower-triangular, or None (``need_weights=False``). Row i is the attention of token i
        (the query) over tokens 0..i, computed when token i was fed to the model: rows
        [0, n_prompt) by the prefill, row n_prompt + t by the decode step of new token t.
        Every new token is fed once, the last one too, so every row is filled; each equals the
        row the full forward ``model(input_ids)`` computes.
    tokenized : None
        Generations carry no word boundaries.
    token_type_ids : ndarray of int64, shape (n_total,)
        All 0.
    logits : None
        Generations keep no logits.
    kept_weights : None
        Generations keep no partial maps.
    tape : None
        Generations keep no tape for a backward.
    n_prompt : int
        The number of prompt tokens.
    text : str
        The new tokens decoded to a str.

    Attributes
    ----------
    new_ids : ndarray of int64
        The generated ids.
    new_tokens : list of str
        The generated tokens.
    """
    n_prompt: int = 0
    text: str | None = None

    @property
    def new_ids(self):
        return self.input_ids[self.n_prompt:]

    @property
    def new_tokens(self):
        return None if self.tokens is None else self.tokens[self.n_prompt:]


if TYPE_CHECKING:          # a mixin of TransformerModel's subclasses: typed as one
    _Model = TransformerModel
else:
    _Model = object


class CausalLM(_Model):
    """What GPT-2 and the LLaMA family add to TransformerModel: logits and generation.

    A family sets ``_grad_layout`` (a :class:`mha.models.backward.DecoderLayout`: its parameters'
    names), which drives the one pre-norm decoder forward here (``_forward``, with ``cache=``:
    one `mha.KVCache` per layer, positions starting at their length) and the backward.

    A base-model folder (``LlamaModel``, ``Qwen2Model``, ``MistralModel`` saved by
    ``save_pretrained``: no ``model.`` prefix, no ``lm_head.weight``, untied embeddings) loads
    with ``has_lm_head`` False: every forward, hook and cache works, ``run_with_cache`` and
    ``run_with_hooks`` give no logits, and ``logits``, ``generate`` and what reads the LM head
    raise NotImplementedError saying so.
    """
    causal = True
    pre_norm = True
    #: False for a base-model folder, saved without its LM head
    has_lm_head = True

    def _new_cache(self, max_len, batch_size=1):
        """Empty KV caches, one per layer, for ``batch_size`` sequences of up to ``max_len``
        tokens."""
        return [KVCache(batch_size, self.n_kv_heads, max_len, self.d_head, self.dtype)
                for _ in range(self.n_layers)]

    def _vocab_stored(self) -> Any:
        """The LM head's weight as stored: the family's ``lm_head``, or its token table
        (``_grad_layout.embed``) when the two are tied (an array, or narrow)."""
        if not self.has_lm_head:
            raise self._no_lm_head()
        head = getattr(self, "lm_head", None)
        layout: Any = self._grad_layout             # type: ignore[attr-defined]
        return getattr(self, layout.embed) if head is None else head

    def _vocab_matrix(self) -> np.ndarray:
        """The LM head's weight (vocab, d_model) as an array (a narrow one widened, new)."""
        head = self._vocab_stored()
        if isinstance(head, ops.Packed):                # read as its transpose (d, vocab)
            return np.ascontiguousarray(head.unpack().T)
        return weights.as_array(head)

    def _final_norm(self, x: np.ndarray) -> np.ndarray:
        """The final norm (``_grad_layout.final``: LayerNorm, or RMSNorm without a bias) over
        the last axis of x (..., d_model)."""
        layout: Any = self._grad_layout             # type: ignore[attr-defined]
        params, (gain, bias) = self._stored(), layout.final
        rows = x.reshape(-1, x.shape[-1])
        eps = self.config.norm_eps
        out = (ops.rms_norm(rows, params[gain], eps) if bias is None
               else ops.layer_norm(rows, params[gain], params[bias], eps))
        return out.reshape(x.shape)

    def _forward(self, ids: np.ndarray, mask: np.ndarray, type_ids: np.ndarray,
                 need_weights: bool, head_mask: np.ndarray | None,
                 hooks: HookPoints = NO_HOOKS, resume: tuple[int, np.ndarray] | None = None,
                 cache: list[KVCache] | None = None) -> tuple[np.ndarray, np.ndarray | None]:
        """The forward of a pre-norm decoder, driven by the family's ``_grad_layout`` (the
        names of its embeddings, norms, attention and MLP weights, and the shape of its
        block); rotary families turn q and k with ``_rope``::

            x = tok_emb[ids] (* embed_scale) (+ pos_emb[positions])
            for each layer:
                x = x + post_1(attention(norm_1(x)))  # causal, padding, window, KV cache
                x = x + post_2(mlp(norm_2(x)))
            hidden_states = [x_0, ..., x_{L-1}, norm_f(x_L)]   (as transformers reports them)

        where a missing norm is the identity (OLMo-2 has post_1 and post_2 only, Gemma 2 all
        four, most families norm_1 and norm_2 only), and a parallel block (GPT-NeoX) is
        x = x + attention(norm_1(x)) + mlp(norm_2(x)).

        See :meth:`TransformerModel._forward` for the arguments; ``cache``: one KVCache per
        layer (positions start at their length)."""
        layout: Any = self._grad_layout             # type: ignore[attr-defined]
        params = self._stored()
        B, n = ids.shape
        L, H, d = self.n_layers, self.n_heads, self.d_model
        start = 0 if cache is None else cache[0].length
        first, x = (0, None) if resume is None else resume
        if x is None:
            x = ops.embedding(params[layout.embed], ids)                # (B*n, d)
            if self._embed_scale is not None:
                x *= self.dtype(self._embed_scale)
            if layout.positions is None:
                hooks(None, "hook_embed", x, (B, n, d))
            else:
                positions = np.broadcast_to(np.arange(start, start + n), (B, n))
                if hooks.wants(None, "hook_embed") or hooks.wants(None, "hook_pos_embed"):
                    hooks(None, "hook_embed", x, (B, n, d))
                    pos = ops.embedding(params[layout.positions], positions)
                    hooks(None, "hook_pos_embed", pos, (B, n, d), owned=True)
                    x += pos
                else:
                    ops.embedding(params[layout.positions], positions, out=x)
        hidden = self._hidden_buffer(B, n, first, hooks)
        attn = np.empty((B, L, H, n, start + n), dtype=self.dtype) if need_weights else None
        pad_mask = None if mask.all() else np.ascontiguousarray(mask, dtype=bool)

        def norm(i, name, names, x):
            if names is None:                   # no norm there: the input itself
                return x
            return self._norm(i, name, x, p[names[0]], p.get(names[1] or ""), B, n, hooks)

        for i, p in enumerate(self.layers[first:], first):
            hooks(i, "hook_resid_pre", x, (B, n, d))
            hidden[:, i] = x.reshape(B, n, d)
            h = norm(i, "ln1", layout.ln1, x)
            if layout.parallel:     # the MLP's input is taken before the attention adds to x
                h_mlp = norm(i, "ln2", layout.ln2, x) if layout.ln2 else x.copy()
            w_out = attn[:, i] if attn is not None else None
            weights = self._self_attention(
                i, h, p, B, n, pad_mask, need_weights, head_mask, hooks,
                rope=self._rope(start, start + n, i) if self.rotary else None,
                cache=cache, residual=x, weights_out=w_out, qk_norm=layout.qk_norm,
                qk_norm_heads=layout.qk_norm_heads,
                post_norm=layout.post_attention)                 # x += attention
            if attn is not None and weights is not w_out:
                attn[:, i] = weights
            if not layout.parallel:
                hooks(i, "hook_resid_mid", x, (B, n, d))
                h_mlp = norm(i, "ln2", layout.ln2, x)
            self._mlp(i, h_mlp, p, B, n, hooks, x, layout.mlp, gated=layout.gated,
                      post_norm=layout.post_mlp)                 # x += MLP
            hooks(i, "hook_resid_post", x, (B, n, d))
        if layout.final is None:            # no final norm (CLIP's vision tower)
            hooks.note(None, "ln_final.in", x)
            hooks.note(None, "ln_final.out", x)
        else:
            gain, bias = layout.final
            x = self._norm(None, "ln_final", x, params[gain], params.get(bias or ""), B, n,
                           hooks, inplace=True)
        hidden[:, L] = x.reshape(B, n, d)
        return hidden, attn

    #: the factor on the token embeddings (Gemma's sqrt(d_model)), or None
    _embed_scale: float | None = None

    def _init_rope(self) -> None:
        """The rotary embedding's frequencies (a rotary family's ``_load`` calls it): on the
        first ``rotary_fraction`` of each head, one set per base (Gemma 3's sliding layers
        have their own, ``rope_local_theta``), and the empty tables ``_rope`` grows."""
        cfg = self.config
        rotary = int(cfg.d_head * cfg.rotary_fraction)
        rotary -= rotary % 2
        self._frequencies = [ops.rope_frequencies(rotary, cfg.rope_theta, cfg.rope_scaling)]
        self._rope_kind = [0] * cfg.n_layers
        if cfg.rope_local_theta is not None:
            self._frequencies.append(ops.rope_frequencies(rotary, cfg.rope_local_theta))
            self._rope_kind = [int(w is not None) for w in cfg.sliding_windows]
        self._rope_cache = [ops.rope_table(0, 0, f, self.dtype) for f in self._frequencies]

    def _rope(self, start: int, stop: int, layer: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """cos, sin (stop - start, rotary dims / 2) for positions [start, stop) of ``layer``'s
        rotary base, from a table kept for the longest length seen (grown by doubling)."""
        kind = self._rope_kind[layer]
        cos, sin = self._rope_cache[kind]
        if len(cos) < stop:
            cos, sin = self._rope_cache[kind] = ops.rope_table(
                0, max(stop, 2 * len(cos)), self._frequencies[kind], self.dtype)
        return cos[start:stop], sin[start:stop]

    def _lm_head(self):
        """The LM head's weight packed for the GEMM (read as the (d, vocab) transpose)."""
        return self._dense("lm_head", self._vocab_stored(), trans=True)

    def _logits(self, hidden: np.ndarray) -> np.ndarray:
        """The logits (rows, vocab) of final hidden states (rows, d_model): hidden W_vocab^T,
        soft-capped to c tanh(z / c) when the family caps them (Gemma 2's
        ``final_logit_softcapping``)."""
        logits = ops.unembed(hidden, self._lm_head())
        cap = self.config.final_softcap
        if cap is not None:                 # in place: (rows, vocab) is the largest array here
            logits /= self.dtype(cap)
            np.tanh(logits, out=logits)
            logits *= self.dtype(cap)
        return logits

    def _no_lm_head(self) -> NotImplementedError:
        """The error of a base-model folder asked for what needs its LM head."""
        return NotImplementedError(
            f"{self.folder or self.name} holds a base model (saved without lm_head.weight, its "
            f"embeddings untied), so it has no LM head: logits, generate and what reads the "
            f"unembedding need the folder of the ...ForCausalLM model. Hidden states, "
            f"attentions, run_with_cache and run_with_hooks work.")

    def logits(self, text_or_ids: str | ArrayLike) -> np.ndarray:
        """Compute the next-token logits of one text or id sequence.

        The logits are the last hidden states times the LM head's weight (tied to the token
        embeddings when config.json says so).

        Parameters
        ----------
        text_or_ids : str or array_like of int, shape (n,)
            A text (tokenized with the model's special tokens) or its ids.

        Returns
        -------
        ndarray, shape (n, vocab_size)
            Row i scores the token after position i.

        Examples
        --------
        >>> model = mha.models.load("path/to/a/gpt2/folder")             # doctest: +SKIP
        >>> int(model.logits("The cat")[-1].argmax())                    # doctest: +SKIP
        """
        self._lm_head()                 # a base model raises before running
        enc = (self.encode(text_or_ids, need_weights=False) if isinstance(text_or_ids, str)
               else self(np.asarray(text_or_ids), need_weights=False))
        return self._logits(enc.last_hidden_state)

    def generate(self, text: str | ArrayLike, max_new_tokens: int = 20, *, greedy: bool = True,
                 temperature: float = 1.0, top_k: int | None = None, seed: int | None = None,
                 stop_at_eos: bool = True, need_weights: bool = True, progress: bool | None = None,
                 callback: Callable[[int], object] | None = None,
                 fwd_hooks: Sequence[tuple[NameFilter, HookFn]] = ()) -> Generation:
        """Continue a text token by token on a KV cache; keep every attention map.

        The prompt runs once (prefill), then each new token is one step that attends over the
        cache. The attention rows of all steps are assembled into one (L, H, n, n) array.

        Parameters
        ----------
        text : str or 1-D int array
            The prompt (tokenized with the model's special tokens, e.g. LLaMA's BOS), or its ids.
        max_new_tokens : int, default 20
            The most tokens to add (>= 1).
        greedy : bool
            True: the most likely token each step (transformers' ``do_sample=False``; ties go
            to the lowest id). False: sample from ``softmax(logits / temperature)``, restricted
            to the ``top_k`` most likely tokens when given, with ``numpy.random.default_rng(seed)``.
        temperature : float, default 1.0
            Divides the logits when sampling (> 0).
        top_k : int, optional
            Sample only among the ``top_k`` most likely tokens.
        seed : int, optional
            Seeds the sampling.
        stop_at_eos : bool
            Stop after a token of ``config.eos_token_ids`` (from generation_config.json when
            the folder has one); it is kept, as transformers keeps it.
        need_weights : bool
            Keep the attentions (L, H, n, n); False saves their memory and time.
        progress : bool, optional
            A progress bar over the new tokens (default: when there are more than 50).
        callback : callable, optional
            Called with each new token id (an int) as soon as it is chosen, before the model
            runs it: to print a stream, or to time the steps.
        fwd_hooks : list of (str or callable, callable), optional
            Hooks as in :meth:`run_with_hooks`, run on the prefill and on every step (a step's
            activations have one position; its keys and values hold the new token's only:
            ``hook_k`` and ``hook_v`` see what is appended to the KV cache).

        Returns
        -------
        Generation
            An Encoding of prompt + new tokens: tokens, input_ids, hidden_states, attentions
            (row i: token i's attention over tokens 0..i), n_prompt, new_ids, new_tokens, text.

        Raises
        ------
        ValueError
            An empty prompt, max_new_tokens < 1, a non-positive temperature, or more tokens
            than the model has positions.

        Examples
        --------
        >>> model = mha.models.load("path/to/a/gpt2/or/llama/folder")   # doctest: +SKIP
        >>> out = model.generate("The cat", max_new_tokens=5)            # doctest: +SKIP
        >>> out.attentions.shape    # (layers, heads, n_prompt + 5, n_prompt + 5)  # doctest: +SKIP
        >>> view = mha.viz.head_view(out.attentions, out.tokens)         # doctest: +SKIP
        """
        from tqdm.auto import tqdm

        self._lm_head()                 # a base model raises before running
        if isinstance(text, str):
            ids = np.asarray(self._need_tokenizer()(text).ids, dtype=np.int64)
        else:
            ids = np.asarray(text)
            if ids.dtype.kind not in "iu" or ids.ndim != 1:
                raise TypeError(f"text must be a str or a 1-D array of token ids, got "
                                f"{type(text).__name__} {getattr(ids, 'shape', '')}")
        max_new_tokens = checks.positive_int("max_new_tokens", max_new_tokens)
        if not greedy and not temperature > 0:
            raise ValueError(f"temperature must be > 0, got {temperature!r}")
        if not greedy and top_k is not None:
            top_k = checks.positive_int("top_k", top_k)
        ids = self._check_ids(ids[None], int(max_new_tokens))[0]
        n_prompt, total = len(ids), len(ids) + int(max_new_tokens)

        L, H, d = self.n_layers, self.n_heads, self.d_model
        hidden = np.empty((L + 1, total, d), self.dtype)
        attn = np.zeros((L, H, total, total), self.dtype) if need_weights else None
        cache = self._new_cache(total)
        rng = np.random.default_rng(seed)
        eos = set(self.config.eos_token_ids) if stop_at_eos else set()
        tokens = list(ids)
        hooks = HookPoints(self.hook_names(), None, fwd_hooks) if fwd_hooks else NO_HOOKS

        def feed(new_ids):          # run new tokens on the cache, keep their rows
            start, n = cache[0].length, len(new_ids)
            ones = np.ones((1, n), bool)
            h, a = self._forward(np.asarray(new_ids, np.int64)[None], ones,
                                 np.zeros((1, n), np.int64), need_weights, None, hooks,
                                 cache=cache)
            hidden[:, start:start + n] = h[0]
            if need_weights:
                attn[:, :, start:start + n, :start + n] = a[0]
            return h[0, L, -1]                                   # the last final hidden state

        last = feed(ids)
        show = max_new_tokens > 50 if progress is None else progress
        for _ in tqdm(range(max_new_tokens), desc="generate", disable=not show):
            logits = self._logits(last[None])[0]
            if greedy:
                next_id = int(np.argmax(logits))
            else:
                next_id = _sample(logits, temperature, top_k, rng)
            tokens.append(next_id)
            if callback is not None:
                callback(next_id)
            last = feed([next_id])
            if next_id in eos:
                break

        n = len(tokens)                       # < total when an EOS stopped the loop
        input_ids = np.asarray(tokens, dtype=np.int64)
        names = text_out = None
        if self.tokenizer is not None:
            names = [self.tokenizer.id_to_token(i) for i in input_ids]
            text_out = self.tokenizer.decode(input_ids[n_prompt:])
        return Generation(
            tokens=names, input_ids=input_ids, attention_mask=np.ones(n, bool),
            hidden_states=hidden if n == total else hidden[:, :n].copy(),
            attentions=attn if attn is None or n == total else attn[:, :, :n, :n].copy(),
            token_type_ids=np.zeros(n, np.int64), n_prompt=n_prompt, text=text_out)


def _sample(logits, temperature, top_k, rng):
    """One id drawn from softmax(logits / temperature) over the top_k largest logits."""
    z = np.asarray(logits, dtype=np.float64) / temperature
    if top_k is not None and top_k < len(z):
        cut = np.partition(z, len(z) - top_k)[len(z) - top_k]
        z = np.where(z >= cut, z, -np.inf)
    p = np.exp(z - z.max())
    return int(rng.choice(len(p), p=p / p.sum()))
