"""TransformerModel: what every family shares (tokenize, batch, encode, read attentions, the
q/k/v and output projection that each attention layer used)."""
from dataclasses import dataclass

import numpy as np

import mha
from mha import _C

from . import ops
from .words import aggregate_to_words, group_words


@dataclass
class Encoding:
    """The result of a forward pass.

    One text (``model.encode("...")``), with n tokens, L layers, H heads, width d:
      tokens: list of n str; input_ids: (n,) int64; attention_mask: (n,) bool (all True);
      token_type_ids: (n,) int64 (BERT segments: 1 on the second text of a pair);
      hidden_states: (L + 1, n, d), the embeddings then the output of each layer
      (exactly ``output_hidden_states`` of transformers); attentions: (L, H, n, n) softmax
      weights, rows = queries, or None with ``need_weights=False``.
    A list of B texts: the same with a leading batch axis, padded on the right to the longest
    text; ``attention_mask`` is False on padding and ``tokens`` lists each text's real tokens.
    ``tokenized`` holds the TokenizedText(s) (word boundaries, offsets), or None when the
    model was called on ids.
    """
    tokens: list
    input_ids: np.ndarray
    attention_mask: np.ndarray
    hidden_states: np.ndarray
    attentions: np.ndarray = None
    tokenized: object = None
    token_type_ids: np.ndarray = None

    @property
    def last_hidden_state(self):
        """(n, d) or (B, n, d): the last entry of hidden_states."""
        return self.hidden_states[..., -1, :, :]

    @property
    def n_tokens(self):
        return self.input_ids.shape[-1]

    def words(self, index=None):
        """(word strings, token-index groups) of the text (or of text ``index`` in a batch)."""
        tokenized = self.tokenized if index is None else self.tokenized[index]
        if tokenized is None or isinstance(tokenized, list):
            raise ValueError("word boundaries need a tokenized text: use model.encode(text)"
                             + ("" if tokenized is None else " and pass index="))
        groups = group_words(tokenized)
        return [w for w, _ in groups], [g for _, g in groups]

    def word_attentions(self, index=None):
        """(words, weights (L, H, W, W)): attentions aggregated to words (Clark et al. 2019)."""
        if self.attentions is None:
            raise ValueError("this encoding has no attentions (need_weights=False)")
        words, groups = self.words(index)
        weights = self.attentions if index is None else self.attentions[index]
        n = len(self.tokenized.ids if index is None else self.tokenized[index].ids)
        return words, aggregate_to_words(weights[..., :n, :n], groups)


class TransformerModel:
    """A pretrained transformer run in NumPy, with mha's C kernels in every attention layer.

    Build one with :func:`mha.models.load`. Attributes: ``config`` (a ModelConfig; the
    config.json is ``config.raw``), ``tokenizer``, ``dtype``, ``n_layers``, ``n_heads``,
    ``n_kv_heads``, ``d_model``, ``d_head``, ``name``, ``folder``, ``layers`` (one dict of
    weights per layer, dense weights stored (in, out); its ``W_o`` and ``b_o`` are the
    attention's output projection).

    A family implements ``_load(read)`` (read: a :class:`~mha.models.hub.TensorReader`),
    ``parameters()`` and ``_forward(ids, mask, type_ids, need_weights, head_mask, capture)``,
    calling :meth:`_attention` for the attention of every layer.
    """
    causal = False
    #: the checkpoint name that locates the head-model prefix ("bert.", "model.", ...)
    anchor = None

    def __init__(self, config, checkpoint, tokenizer=None, *, dtype=np.float32, name=None,
                 folder=None):
        from .hub import TensorReader

        dtype = np.dtype(dtype)
        if dtype not in (np.float32, np.float64):
            raise TypeError(f"dtype must be float32 or float64, got {dtype}")
        self.config = config
        self.tokenizer = tokenizer
        self.dtype = dtype.type
        self.name = name
        self.folder = folder
        self._load(TensorReader(checkpoint, self.anchor, self.dtype, type(self).__name__))

    # --- shape --------------------------------------------------------------------------------
    @property
    def n_layers(self):
        return self.config.n_layers

    @property
    def n_heads(self):
        return self.config.n_heads

    @property
    def n_kv_heads(self):
        return self.config.n_kv_heads

    @property
    def d_model(self):
        return self.config.d_model

    @property
    def d_head(self):
        return self.config.d_head

    def num_parameters(self):
        """Number of weights (embeddings included)."""
        return int(sum(a.size for a in self.parameters().values()))

    def __repr__(self):
        kv = f", n_kv_heads={self.n_kv_heads}" if self.n_kv_heads != self.n_heads else ""
        return (f"{type(self).__name__}(name={self.name!r}, n_layers={self.n_layers}, "
                f"n_heads={self.n_heads}{kv}, d_model={self.d_model}, "
                f"dtype={np.dtype(self.dtype).name})")

    # --- text ---------------------------------------------------------------------------------
    def _need_tokenizer(self):
        if self.tokenizer is None:
            raise ValueError(f"{self.name or 'this model'} has no tokenizer; call it on ids")
        return self.tokenizer

    def tokenize(self, text, pair=None, *, truncation=False):
        """The tokens of ``text`` (special tokens included), e.g. ['[CLS]', 'the', ..., '[SEP]']."""
        return self._need_tokenizer()(text, pair, truncation=truncation).tokens

    def encode(self, text, pair=None, *, need_weights=True, truncation=False, head_mask=None):
        """Tokenize and run the model -> :class:`Encoding`.

        text: a str, or a list of str (a batch, padded on the right).
        pair: the second text of a BERT sentence pair (str, or list matching ``text``).
        need_weights: compute and keep the attention weights (L, H, n, n) of every layer.
        truncation: cut texts longer than the model's positions instead of raising.
        head_mask: optional (n_layers, n_heads) multipliers on each head's output (1 keep,
        0 prune), for ablation studies.
        """
        tok = self._need_tokenizer()
        single = isinstance(text, str)
        texts = [text] if single else list(text)
        if pair is None:
            pairs = [None] * len(texts)
        else:
            pairs = [pair] if isinstance(pair, str) else list(pair)
            if len(pairs) != len(texts):
                raise ValueError(f"pair has {len(pairs)} texts but text has {len(texts)}")
        if not texts:
            raise ValueError("text is an empty list")
        tokenized = [tok(t, p, truncation=truncation) for t, p in zip(texts, pairs)]
        n = max(len(t) for t in tokenized)
        ids = np.full((len(texts), n), self.config.pad_token_id, dtype=np.int64)
        type_ids = np.zeros((len(texts), n), dtype=np.int64)
        mask = np.zeros((len(texts), n), dtype=bool)
        for b, t in enumerate(tokenized):
            ids[b, :len(t)] = t.ids
            type_ids[b, :len(t)] = t.type_ids
            mask[b, :len(t)] = True
        enc = self(ids, mask, type_ids, need_weights=need_weights, head_mask=head_mask)
        enc.tokens = [t.tokens for t in tokenized]
        enc.tokenized = tokenized
        if single:
            enc = _unbatch(enc)
        return enc

    def __call__(self, input_ids, attention_mask=None, token_type_ids=None, *, need_weights=True,
                 head_mask=None):
        """Run the model on token ids -> :class:`Encoding` (its ``tokens`` from the vocabulary).

        input_ids: (n,) or (B, n) integers. attention_mask: same shape, True / 1 = real token,
        False / 0 = padding (padding keys get no attention). token_type_ids: BERT segment ids.
        """
        ids = np.asarray(input_ids)
        single = ids.ndim == 1
        ids = self._check_ids(np.atleast_2d(ids))
        B, n = ids.shape
        if attention_mask is None:
            mask = np.ones((B, n), dtype=bool)
        else:
            mask = np.asarray(attention_mask).astype(bool).reshape(B, n)
        if token_type_ids is None:
            type_ids = np.zeros((B, n), dtype=np.int64)
        else:
            type_ids = np.asarray(token_type_ids).astype(np.int64).reshape(B, n)
        if head_mask is not None:
            head_mask = np.asarray(head_mask, dtype=self.dtype)
            if head_mask.shape != (self.n_layers, self.n_heads):
                raise ValueError(f"head_mask must have shape (n_layers, n_heads) = "
                                 f"{(self.n_layers, self.n_heads)}, got {head_mask.shape}")
        hidden, attn = self._forward(ids, mask, type_ids, need_weights, head_mask)
        tokens = None
        if self.tokenizer is not None:
            tokens = [[self.tokenizer.id_to_token(i) for i in row[m]] for row, m in zip(ids, mask)]
        enc = Encoding(tokens=tokens, input_ids=ids, attention_mask=mask, hidden_states=hidden,
                       attentions=attn, token_type_ids=type_ids)
        return _unbatch(enc) if single else enc

    # --- shortcuts for notebooks ----------------------------------------------------------------
    def attentions(self, text, pair=None, *, words=False, truncation=False):
        """(tokens, weights): weights (n_layers, n_heads, n, n), rows = queries.

        words=True aggregates subword tokens to words (sum of the attention to a word, mean of
        the attention from it) and returns (words, weights (n_layers, n_heads, W, W)).
        """
        enc = self.encode(text, pair, truncation=truncation)
        if words:
            return enc.word_attentions()
        return enc.tokens, enc.attentions

    def attention_norms(self, text, pair=None, *, summed=False, truncation=False):
        """(tokens, norms): Kobayashi et al. (2020)'s norm-based attention of every layer.

        norms[l, h, i, j] = ||alpha_ij f_h(x_j)||, the length of what key j adds to query i's
        output through head h (value vector times the head's rows of W_o, output bias left
        out), (n_layers, n_heads, n, n); with ``summed=True`` the length of the sum over the
        heads, (n_layers, n, n). The sibling of :meth:`attentions`; see
        :func:`mha.analysis.value_norms` for the formulas.
        """
        from ..analysis import value_norms

        tokens, _, _, v = self.qkv(text, pair, truncation=truncation)
        _, weights = self.attentions(text, pair, truncation=truncation)
        norms = np.stack([value_norms(weights[l], v[l], self.output_projection(l)[0],
                                      summed=summed) for l in range(self.n_layers)])
        return tokens, norms

    def hidden_states(self, text, pair=None, *, truncation=False):
        """(tokens, hidden states (n_layers + 1, n, d_model))."""
        enc = self.encode(text, pair, need_weights=False, truncation=truncation)
        return enc.tokens, enc.hidden_states

    def embed(self, texts, *, normalize=True, pooling="mean", truncation=True):
        """Sentence embeddings: the last hidden states pooled over real tokens.

        pooling "mean" (what all-MiniLM-L6-v2 is trained for, with normalize=True) or "first"
        (the [CLS] vector). Returns (d_model,) for a str, (B, d_model) for a list.
        """
        single = isinstance(texts, str)
        enc = self.encode([texts] if single else list(texts), need_weights=False,
                          truncation=truncation)
        last = enc.last_hidden_state                                # (B, n, d)
        if pooling == "mean":
            m = enc.attention_mask[..., None].astype(last.dtype)
            out = (last * m).sum(axis=1) / np.maximum(m.sum(axis=1), 1e-9)
        elif pooling == "first":
            out = last[:, 0].copy()
        else:
            raise ValueError(f"pooling must be 'mean' or 'first', got {pooling!r}")
        if normalize:
            out /= np.maximum(np.linalg.norm(out, axis=-1, keepdims=True), 1e-12)
        return out[0] if single else out

    # --- what each attention layer computed ------------------------------------------------------
    def qkv(self, text, pair=None, *, truncation=False):
        """The queries, keys and values that each layer's attention kernel received.

        Parameters
        ----------
        text : str
        pair : str, optional
            The second text of a BERT sentence pair.
        truncation : bool
            Cut a text longer than the model's positions instead of raising.

        Returns
        -------
        tokens : list of n str
        q : (n_layers, n_heads, n, d_head) array of the model's dtype
        k, v : (n_layers, n_kv_heads, n, d_head) arrays of the model's dtype
            Exactly what ``mha.attention`` got: after the rotary embedding for the LLaMA
            family, before the ``attention_scale(layer)`` factor. With grouped-query attention
            query head h reads key/value head ``h // (n_heads // n_kv_heads)``, so that
            ``softmax(q k^T * attention_scale(layer) + log attention_mask(layer, n))`` is
            ``model.attentions(text)[1]``.

        Examples
        --------
        >>> model = mha.models.load("minilm")
        >>> tokens, q, k, v = model.qkv("The cat sat on the mat")
        >>> q.shape                               # (layers, heads, n, d_head)
        (6, 12, 8, 32)
        """
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        tokenized = self._need_tokenizer()(text, pair, truncation=truncation)
        ids = np.asarray(tokenized.ids, dtype=np.int64)[None]
        type_ids = np.asarray(tokenized.type_ids, dtype=np.int64)[None]
        captured = []
        self._forward(ids, np.ones(ids.shape, bool), type_ids, False, None, capture=captured)
        q, k, v = (np.stack([c[part][0] for c in captured]) for part in range(3))
        return tokenized.tokens, q, k, v

    def output_projection(self, layer):
        """(W_o, b_o) of one layer's attention: ``W_o`` (n_heads * d_head, d_model) stored
        (in, out), so that the attention's output is ``heads @ W_o + b_o`` with the heads side
        by side per token; ``b_o`` (d_model,) or None when the model has no such bias."""
        p = self.layers[self._layer_index(layer)]
        return p["W_o"], p.get("b_o")

    def attention_scale(self, layer):
        """The factor on q k^T in ``layer`` (1 / sqrt(d_head) unless the family says else)."""
        self._layer_index(layer)
        return 1.0 / np.sqrt(self.d_head)

    def attention_mask(self, layer, n):
        """(n, n) bool, True where query i may attend key j in ``layer`` on n tokens without
        padding: all True for an encoder, j <= i for a causal model, and i - W < j <= i in a
        layer with a sliding window of W tokens."""
        self._layer_index(layer)
        i, j = np.arange(n)[:, None], np.arange(n)[None, :]
        allowed = np.ones((n, n), bool) if not self.causal else j <= i
        window = self._band(layer, n, n)
        return allowed if window is None else allowed & window

    def _check_ids(self, ids, new_tokens=0):
        """ids as int64 (B, n) after checking their dtype, shape and range, and that n tokens
        (plus ``new_tokens`` to generate) fit the model's positions."""
        if ids.dtype.kind not in "iu":
            raise TypeError(f"input_ids must be integers, got dtype {ids.dtype}")
        if ids.ndim != 2:
            raise ValueError(f"input_ids must have shape (n,) or (B, n), got {ids.shape}")
        n = ids.shape[1]
        if n == 0:
            raise ValueError("input_ids is empty")
        if n + new_tokens > self.config.max_positions:
            extra = f" + max_new_tokens={new_tokens}" if new_tokens else ""
            raise ValueError(f"input_ids has {n} tokens{extra} but the model has "
                             f"{self.config.max_positions} positions")
        if ids.min() < 0 or ids.max() >= self.config.vocab_size:
            raise ValueError(f"input_ids must lie in [0, {self.config.vocab_size}), got "
                             f"[{ids.min()}, {ids.max()}]")
        return ids.astype(np.int64, copy=False)

    def _layer_index(self, layer):
        if not isinstance(layer, (int, np.integer)) or not -self.n_layers <= layer < self.n_layers:
            raise IndexError(f"layer must be an int in [0, {self.n_layers}), got {layer!r}")
        return int(layer) % self.n_layers

    # --- to implement -----------------------------------------------------------------------------
    def _load(self, read):
        raise NotImplementedError

    def parameters(self):
        """dict name -> array of every weight, stored (in, out) for dense layers."""
        raise NotImplementedError

    def _forward(self, ids, mask, type_ids, need_weights, head_mask, capture=None):
        """ids, mask, type_ids: (B, n) -> hidden (B, L+1, n, d), attentions (B, L, H, n, n)
        or None. ``capture``: a list to which each layer appends the (q, k, v) it attended."""
        raise NotImplementedError

    # --- shared by the families -------------------------------------------------------------------
    def _band(self, layer, n_q, n_k):
        """(n_q, n_k) bool of the keys inside ``layer``'s sliding window (the queries are the
        last n_q of the n_k positions), or None when the layer has none or it covers them all."""
        window = self.config.sliding_windows[layer]
        if window is None or n_k <= window:
            return None
        i = np.arange(n_k - n_q, n_k)[:, None]
        return np.arange(n_k)[None, :] > i - window

    def _self_attention(self, layer, h, p, B, n, pad_mask, need_weights, head_mask, capture,
                        rope=None, cache=None, residual=None, weights_out=None):
        """The attention of one block: h (B*n, d_model), the block's input (normalized in a
        pre-norm model) -> (the attention's output projected, (B*n, d_model); weights).

        p: the layer's weights (W_qkv, b_qkv, W_o, b_o; the biases optional). rope: (cos, sin)
        of the tokens' positions, applied to q and k (LLaMA family); cache: a KVCache the new
        keys and values are appended to, attended with all earlier ones (causal models).
        residual: (B*n, d_model) C-contiguous, or None: the projected output is added to it in
        place (inside the product) and it is returned. weights_out: where the kernel may
        write the weights (B, H, n, n_k) when it is C-contiguous (the layer's slice of the
        model's attentions), or None.
        """
        H, H_kv = self.n_heads, self.n_kv_heads
        qkv = ops.linear(h, p["W_qkv"], p.get("b_qkv"))         # (B*n, (H + 2 H_kv) d_head)
        if rope is not None:                                     # q and k turned in place
            ops.rope_(qkv, H + H_kv, self.d_head, *rope)
        q, k, v = ops.split_heads(qkv, B, n, (H, H_kv, H_kv), self.d_head)
        if cache is not None:
            k, v = cache.append(layer, k, v)
        heads, weights = self._attention(layer, q, k, v, pad_mask, need_weights, head_mask,
                                         capture, weights_out)
        return ops.linear(heads, p["W_o"], p.get("b_o"), out=residual), weights

    def _attention(self, layer, q, k, v, pad_mask, need_weights, head_mask, capture,
                   weights_out=None):
        """One layer's multi-head attention on the C kernels -> (heads (B*n_q, H*d_head),
        weights (B, H, n_q, n_k) or None).

        q: (B, H, n_q, d_head); k, v: (B, H_kv, n_k, d_head): views with a contiguous last
        axis, of the model's dtype (the kernel reads them as they are). pad_mask: (B, n_k)
        bool, True = real key, or None. Causal models attend bottom-right aligned (a KV-cache
        step sees every earlier key); sliding windows and head_mask[layer] (multipliers on
        each head's output) are applied here. The kernel is called directly, without
        mha.attention's checks (the model made these arrays) and writes the heads side by
        side per token, as the output projection reads them.
        """
        B, H, n_q, d_head = q.shape
        n_k = k.shape[2]
        band = self._band(layer, n_q, n_k)
        mask = None if band is None else np.broadcast_to(band, (B, H, n_q, n_k))
        heads = np.empty((B * n_q, H * d_head), dtype=self.dtype)
        out = heads.reshape(B, n_q, H, d_head).transpose(0, 2, 1, 3)     # a view: no merging
        if weights_out is not None and not weights_out.flags.c_contiguous:
            weights_out = None
        _, weights = _C.attention_forward(q, k, v, mask, pad_mask, self.causal,
                                          self.attention_scale(layer), 0.0, 0, need_weights,
                                          False, out, weights_out)
        if capture is not None:
            capture.append((q, k, v))
        if head_mask is not None:
            out *= head_mask[layer][None, :, None, None]
        return heads, weights


def _unbatch(enc):
    enc.input_ids = enc.input_ids[0]
    enc.attention_mask = enc.attention_mask[0]
    enc.token_type_ids = enc.token_type_ids[0]
    enc.hidden_states = enc.hidden_states[0]
    if enc.attentions is not None:
        enc.attentions = enc.attentions[0]
    if enc.tokens is not None:
        enc.tokens = enc.tokens[0]
    if isinstance(enc.tokenized, list):
        enc.tokenized = enc.tokenized[0]
    return enc
