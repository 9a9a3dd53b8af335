"""TransformerModel: what every family shares: loading and packing the weights, tokenizing and
batching, the forward's entry points (``encode``, ``model(ids)``), the weights' accessors and
``writable_parameters``. The hook points (:mod:`.hooked`), the readouts (:mod:`.readouts`)
and the pieces of a block (:mod:`.blocks`) are its mixins; the Encoding is :mod:`.encoding`'s."""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, Mapping, Sequence, TypeVar

import numpy as np
from numpy.typing import ArrayLike

from . import ops, weights
from .blocks import Blocks, _AttentionReads
from .encoding import Encoding, _unbatch
from .hooked import Hooked
from .hooks import NO_HOOKS, HookPoints
from .memory import ModelMemory, trim_heap
from .readouts import Readouts


#: the sections every family's class docstring shares (added by :func:`family_doc`)
FAMILY_SECTIONS = """
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
    weights : {None, "bfloat16", "float16", "q8_0"}, optional
        The format the dense weights are kept in (None: ``dtype``); see
        :func:`mha.models.load`.

    Raises
    ------
    CheckpointError
        A missing or wrongly shaped tensor (the message names the file and the tensor).

    See Also
    --------
    mha.models.load : Builds the right class from a folder.
"""


_Class = TypeVar("_Class", bound=type)


def _weight_format(weights_: str | None, dtype: np.dtype) -> str | None:
    """The narrow format of ``load(..., weights=)`` (None: the compute dtype's own)."""
    if weights_ is None or weights_ == dtype.name:
        return None
    known = ("float32", "float64") + weights.NARROW
    if weights_ not in known:
        raise ValueError(f"weights must be None or one of {known}, got {weights_!r}")
    if weights_ in ("float32", "float64"):
        raise ValueError(f"weights={weights_!r} with dtype={dtype.name}: a float model keeps "
                         f"its weights in the dtype it computes in (pass dtype={weights_})")
    if dtype != np.float32:
        raise ValueError(f"weights={weights_!r} computes in float32: dtype must be float32, "
                         f"got {dtype.name}")
    from mha import _core

    if weights_ not in _core.WEIGHT_FORMATS:
        raise NotImplementedError(f"weights={weights_!r}: this build of mha's core reads "
                                  f"{sorted(_core.WEIGHT_FORMATS)}")
    return weights_


def family_doc(cls: _Class) -> _Class:
    """Give a family's class (decorated) the sections all families share: its docstring
    holds its summary and what is its own; Parameters, Raises and See Also come from
    :data:`FAMILY_SECTIONS`, before its Examples when it has some."""
    doc = (cls.__doc__ or "").rstrip() + "\n"
    at = doc.find("\n    Examples\n")
    cls.__doc__ = (doc + FAMILY_SECTIONS if at < 0 else
                   doc[:at] + FAMILY_SECTIONS + doc[at:])
    return cls


class TransformerModel(Hooked, Readouts, Blocks):
    """Run a pretrained transformer in NumPy, with mha's C kernels in every attention layer.

    Build one with :func:`mha.models.load`. A family implements ``_load(read)``,
    ``parameters()``, ``_hook_layout()`` and ``_forward(ids, mask, type_ids, need_weights,
    head_mask, hooks)``, running its blocks with ``_norm``, ``_self_attention`` and ``_mlp``,
    which visit the hook points (:mod:`mha.models.hooks`).

    Parameters
    ----------
    config : ModelConfig
        The sizes and options read from config.json.
    checkpoint : mapping of str to array
        The tensors of the safetensors files, by name.
    tokenizer : Tokenizer, optional
        Without one the model runs on ids only.
    dtype : {numpy.float32, numpy.float64}, default numpy.float32
        What the model computes in (the weights are converted once).
    name : str, optional
        A name for ``repr``.
    folder : path, optional
        Where the model was read from.
    weights : {None, "bfloat16", "float16", "q8_0"}, optional
        The format the dense weights are kept in (None: ``dtype``); see
        :func:`mha.models.load`.

    Attributes
    ----------
    config : ModelConfig
        ``config.raw`` is the config.json.
    layers : list of LayerWeights
        One mapping of weights per layer, dense weights read as (in, out) arrays; its ``W_o``
        and ``b_o`` are the attention's output projection. The dense weights (``W_*``) are
        kept once, packed for the GEMM in ``weight_format`` (``layers[i].packed(name)``):
        reading one unpacks a copy (until ``parameters()`` makes the arrays the model's own),
        assigning an array packs it. Every weight is read-only (change them in
        ``writable_parameters``).
    weight_format : str
        "float32", "float64", or the narrow format the dense weights are kept in.
    n_layers, n_heads, n_kv_heads, d_model, d_head : int
        The sizes.

    Raises
    ------
    TypeError
        A dtype other than float32 or float64.

    Examples
    --------
    >>> model = mha.models.load("minilm")
    >>> model
    BertModel(name='minilm', n_layers=6, n_heads=12, d_model=384, dtype=float32)
    """
    causal = False
    has_lm_head = False             # logits and generate: causal models with an LM head
    #: the C core's activation code of the MLP (ops.activation), set by ``_load``
    _act: int
    #: one dict of weights per layer (set by ``_load``)
    layers: list[weights.LayerWeights]
    #: rotary positions: q and k are turned between the projection and the attention
    rotary = False
    #: the norms sit before each block's attention and MLP (the residual stream is a sum of
    #: the components' outputs), not after the residual adds (the BERT family)
    pre_norm = False
    #: the norms are RMSNorm (no centring, no bias), not LayerNorm
    rms_norm = False
    #: the checkpoint name that locates the head-model prefix ("bert.", "model.", ...)
    anchor: str | None = None

    def __init__(self, config, checkpoint, tokenizer=None, *, dtype=np.float32, name=None,
                 folder=None, weights=None):
        from .hub import TensorReader

        dtype = np.dtype(dtype)
        if dtype not in (np.float32, np.float64):
            raise TypeError(f"dtype must be float32 or float64, got {dtype}")
        self._format = _weight_format(weights, dtype)
        self.config = config
        self.tokenizer = tokenizer
        self.dtype = dtype.type
        self.name = name
        self.folder = folder
        self._load(TensorReader(checkpoint, self.anchor, self.dtype, type(self).__name__))
        self._packs = {}
        self._memory = ModelMemory()        # recycled between calls, never a call's state
        self._seal_weights()
        trim_heap()                         # the load's transients back to the system

    # --- the weights: dense ones packed for the GEMM ---------------------------------------------
    #: raised by each ``writable_parameters`` block: what a tape or a cache was computed with
    _weights_version = 0
    #: the narrow weight format the dense weights are kept in (None: the compute dtype)
    _format: str | None = None

    @property
    def weight_format(self) -> str:
        """The format the dense weights are kept in: "float32", "float64" (the compute dtype),
        "bfloat16", "float16" or "q8_0" (narrow: computed in float32)."""
        return self._format or np.dtype(self.dtype).name

    def _keep(self, layer: dict[str, Any]) -> weights.LayerWeights:
        """A layer's weights as the model keeps them: its dense weights packed for the GEMM
        in the weight format, at once (a loader's float arrays of the layer are dropped)."""
        return weights.LayerWeights(layer, self._format)

    def _table(self, table: np.ndarray) -> Any:
        """A token table as the model keeps it: the array, or narrow (:class:`NarrowTable`)."""
        return table if self._format is None else weights.NarrowTable(table, self._format)

    def _head(self, table: np.ndarray) -> Any:
        """An untied LM head's (vocab, d) weight as the model keeps it: the array (packed for
        the GEMM on first use), or packed narrow at once (read as its transpose)."""
        return table if self._format is None else weights.Packed(table, trans=True,
                                                                 format=self._format)

    def _seal_weights(self) -> None:
        """Make every stored parameter array read-only (the packed weights are): weights
        change only inside ``writable_parameters``, which tapes and caches can see; the LM
        head is packed."""
        for array in self._stored().values():
            if isinstance(array, np.ndarray):
                array.flags.writeable = False
        if self.has_lm_head:
            self._lm_head()

    def _packed(self, layer: int, name: str) -> ops.Packed:
        """Layer ``layer``'s dense weight ``name`` as the GEMM reads it."""
        return self.layers[layer].packed(name)

    def _dense(self, key, weight, trans=False):
        """An array weight (the LM head: a (vocab, d) table read as its transpose) packed for
        the GEMM (:class:`ops.Packed`), from a cache keyed by ``key``: packed once, and again
        when the array under that key was replaced. A narrow table or a packed weight is
        returned packed as it is."""
        if isinstance(weight, ops.Packed):
            return weight
        source, packed = self._packs.get(key, (None, None))
        if source is not weight:
            packed = (weight.packed() if isinstance(weight, weights.NarrowTable)
                      else ops.Packed(weight, trans))
            self._packs[key] = (weight, packed)
        return packed

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_packs"] = {}       # packed for this process's SIMD path: packed again on use
        del state["_memory"]       # this process's memory: the unpickled model makes its own
        return state

    def release_memory(self) -> int:
        """Give back the memory the model keeps between calls.

        That is the blocks of dropped activation caches (up to 1 GiB), and, for a model with
        gradients, the spare gradient block (as large as the parameters: 497 MB for GPT-2
        small in float32) and the backward's packing workspaces; later calls make them again.
        Memory a caller still holds (a cache, gradients) is never part of it.

        Returns
        -------
        int
            The bytes released.
        """
        return self._memory.release()

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._memory = ModelMemory()
        self._seal_weights()

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

    def num_parameters(self) -> int:
        """Count the weights (embeddings included).

        Returns
        -------
        int
            The total size of ``parameters()``.
        """
        return int(sum(np.prod(a.shape) for a in self._stored().values()))

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

    def tokenize(self, text: str, pair: str | None = None, *, truncation: bool = False
                 ) -> list[str]:
        """Tokenize a text, special tokens included.

        Parameters
        ----------
        text : str
            The text.
        pair : str, optional
            The second text of a sentence pair (BERT segments).
        truncation : bool, default False
            Cut a text longer than the model's positions instead of raising.

        Returns
        -------
        list of str
            E.g. ``['[CLS]', 'the', ..., '[SEP]']``.

        Raises
        ------
        ValueError
            A model without tokenizer, or a text longer than the model's positions without
            ``truncation``.

        Examples
        --------
        >>> mha.models.load("minilm").tokenize("Attention!")
        ['[CLS]', 'attention', '!', '[SEP]']
        """
        return self._need_tokenizer()(text, pair, truncation=truncation).tokens

    def encode(self, text: str | Sequence[str], pair: str | Sequence[str] | None = None, *,
               need_weights: bool = True, truncation: bool = False,
               head_mask: ArrayLike | None = None,
               keep_weights: Mapping[int, Any] | None = None) -> Encoding:
        """Tokenize and run the model.

        Parameters
        ----------
        text : str or list of str
            A text, or a batch (padded on the right).
        pair : str or list of str, optional
            The second text of a sentence pair (a list matching ``text``).
        need_weights : bool, default True
            Compute and keep the attention weights (L, H, n, n) of every layer.
        truncation : bool, default False
            Cut texts longer than the model's positions instead of raising.
        head_mask : array_like, shape (n_layers, n_heads), optional
            Multipliers on each head's output (1 keep, 0 prune), for ablation studies.
        keep_weights : dict, optional
            Keep only part of some layers' weights, ``{layer: heads}`` or ``{layer: (heads,
            rows)}`` (heads and query rows: None for all, an int, a slice or a list of ints;
            negative ones count from the end; a tuple is (heads, rows)), e.g. ``{5: (3,
            slice(-16, None))}`` for the last 16 rows of layer 5, head 3. They land in
            ``kept_weights`` (the ``attentions`` stay None): memory in proportion to what is
            kept.

        Returns
        -------
        Encoding
            Tokens, ids, hidden states and attentions (a leading batch axis for a list).

        Raises
        ------
        ValueError
            No tokenizer, an empty list, a ``pair`` list of another length, a text too long without
            ``truncation``, or a ``head_mask`` of the wrong shape.
        IndexError
            A layer, head or row of ``keep_weights`` out of range.

        Examples
        --------
        >>> model = mha.models.load("minilm")
        >>> enc = model.encode(["A short text", "A slightly longer text"])
        >>> enc.attention_mask.tolist()
        [[True, True, True, True, True, False], [True, True, True, True, True, True]]
        """
        hooks = NO_HOOKS if keep_weights is None else _AttentionReads(
            (), keep=self._keep_spec(keep_weights))
        return self._encode_texts(text, pair, need_weights and keep_weights is None, truncation,
                                  head_mask, hooks)

    def _encode_texts(self, text: str | Sequence[str], pair: str | Sequence[str] | None,
                      need_weights: bool, truncation: bool, head_mask: ArrayLike | None,
                      hooks: HookPoints) -> Encoding:
        """encode, with the hook points of the forward."""
        tokenized, ids, type_ids, mask = self._tokenize_batch(text, pair, truncation)
        enc = self._encode_ids(ids, mask, type_ids, need_weights, head_mask, hooks)
        enc.tokens = [t.tokens for t in tokenized]
        enc.tokenized = tokenized
        if isinstance(text, str):
            enc = _unbatch(enc)
        return enc

    def _tokenize_batch(self, text: str | Sequence[str], pair: str | Sequence[str] | None,
                        truncation: bool) -> tuple[list[Any], np.ndarray, np.ndarray, np.ndarray]:
        """Texts (and pairs) -> (TokenizedText of each, ids, type ids, mask (B, n)), padded
        on the right with the model's pad id."""
        tok = self._need_tokenizer()
        texts: list[str] = [text] if isinstance(text, str) else list(text)
        pairs: list[str | None]
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
        return tokenized, ids, type_ids, mask

    def __call__(self, input_ids: ArrayLike, attention_mask: ArrayLike | None = None,
                 token_type_ids: ArrayLike | None = None, *, need_weights: bool = True,
                 head_mask: ArrayLike | None = None,
                 keep_weights: Mapping[int, Any] | None = None) -> Encoding:
        """Run the model on token ids.

        Parameters
        ----------
        input_ids : array_like of int, shape (n,) or (B, n)
            Token ids in [0, vocab_size).
        attention_mask : array_like of bool, shape of ``input_ids``, optional
            True / 1 = real token, False / 0 = padding (padding keys get no attention).
        token_type_ids : array_like of int, shape of ``input_ids``, optional
            BERT segment ids.
        need_weights : bool, default True
            Compute and keep the attention weights.
        head_mask : array_like, shape (n_layers, n_heads), optional
            Multipliers on each head's output.
        keep_weights : dict, optional
            Keep only part of some layers' weights, ``{layer: heads}`` or ``{layer: (heads,
            rows)}`` (heads and query rows: None for all, an int, a slice or a list of ints;
            negative ones count from the end; a tuple is (heads, rows)), e.g. ``{5: (3,
            slice(-16, None))}`` for the last 16 rows of layer 5, head 3. They land in
            ``kept_weights`` (the ``attentions`` stay None): memory in proportion to what is
            kept.

        Returns
        -------
        Encoding
            Its ``tokens`` are read from the vocabulary.

        Raises
        ------
        TypeError
            Ids that are not integers.
        ValueError
            Ids out of range, more tokens than positions, or a ``head_mask`` of the wrong shape.
        IndexError
            A layer, head or row of ``keep_weights`` out of range.
        """
        hooks = NO_HOOKS if keep_weights is None else _AttentionReads(
            (), keep=self._keep_spec(keep_weights))
        return self._encode_ids(input_ids, attention_mask, token_type_ids,
                                need_weights and keep_weights is None, head_mask, hooks)

    def _encode_ids(self, input_ids: ArrayLike, attention_mask: ArrayLike | None,
                    token_type_ids: ArrayLike | None, need_weights: bool,
                    head_mask: ArrayLike | None, hooks: HookPoints) -> Encoding:
        """__call__, with the hook points of the forward."""
        ids, mask, type_ids, single = self._id_inputs(input_ids, attention_mask, token_type_ids)
        head_mask = self._check_head_mask(head_mask)
        hidden, attn = self._forward(ids, mask, type_ids, need_weights, head_mask, hooks)
        tokens = None
        if self.tokenizer is not None:
            tokens = [[self.tokenizer.id_to_token(i) for i in row[m]] for row, m in zip(ids, mask)]
        enc = Encoding(tokens=tokens, input_ids=ids, attention_mask=mask, hidden_states=hidden,
                       attentions=attn, token_type_ids=type_ids)
        if isinstance(hooks, _AttentionReads) and hooks.keep:
            enc.kept_weights = hooks.kept
        return _unbatch(enc) if single else enc

    def _check_head_mask(self, head_mask: ArrayLike | None) -> np.ndarray | None:
        """head_mask as the model's own (n_layers, n_heads) array of its dtype, or None."""
        if head_mask is None:
            return None
        mask = np.array(head_mask, dtype=self.dtype)
        if mask.shape != (self.n_layers, self.n_heads):
            raise ValueError(f"head_mask must have shape (n_layers, n_heads) = "
                             f"{(self.n_layers, self.n_heads)}, got {mask.shape}")
        return mask

    def _id_inputs(self, input_ids: ArrayLike, attention_mask: ArrayLike | None,
                   token_type_ids: ArrayLike | None
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray, bool]:
        """Checked ids, mask (True = real) and type ids, each (B, n) and the forward's own
        (copies: the caller may change its arrays), and whether the ids were one text (n,)."""
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
        return ids, mask, type_ids, single


    #: a gated MLP (act(x W_gate) * x W_up): its up projection is ``mlp.hook_pre_linear``
    _gated = False
    #: learned positions added to the token embeddings (``hook_pos_embed``)
    _pos_embed = False


    def output_projection(self, layer: int) -> tuple[np.ndarray, np.ndarray | None]:
        """Return one layer's attention output projection.

        Parameters
        ----------
        layer : int
            The layer (negative counts from the end).

        Returns
        -------
        W_o : ndarray, shape (n_heads * d_head, d_model)
            Stored (in, out): the attention's output is ``heads @ W_o + b_o`` with the heads side
            by side per token.
        b_o : ndarray, shape (d_model,), or None
            None when the model has no such bias.

        Raises
        ------
        IndexError
            A layer out of range.
        """
        p = self.layers[self._layer_index(layer)]
        return p["W_o"], p.get("b_o")

    def attention_scale(self, layer: int) -> float:
        """Return the factor on q k^T in a layer.

        1 / sqrt(d_head), or config.json's ``query_pre_attn_scalar ** -0.5`` (Gemma 2 and 3),
        unless the family says else.

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
        self._layer_index(layer)
        scale = self.config.query_scale
        return 1.0 / np.sqrt(self.d_head) if scale is None else scale

    def attention_mask(self, layer: int, n: int) -> np.ndarray:
        """Return which keys each query may attend in a layer, on n tokens without padding.

        All True for an encoder, j <= i for a causal model, and i - W < j <= i in a layer with a
        sliding window of W tokens.

        Parameters
        ----------
        layer : int
            The layer (negative counts from the end).
        n : int
            The number of tokens.

        Returns
        -------
        ndarray of bool, shape (n, n)
            True where query i may attend key j.

        Raises
        ------
        IndexError
            A layer out of range.
        """
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
        return ids.astype(np.int64)                 # the forward's own copy

    def _layer_index(self, layer):
        if not isinstance(layer, (int, np.integer)) or not -self.n_layers <= layer < self.n_layers:
            raise IndexError(f"layer must be an int in [0, {self.n_layers}), got {layer!r}")
        return int(layer) % self.n_layers

    # --- to implement -----------------------------------------------------------------------------
    def _load(self, read):
        raise NotImplementedError

    def _stored(self) -> dict[str, Any]:
        """Every weight by the names of ``parameters()``, as stored: arrays, and the dense
        weights packed (:class:`ops.Packed`; narrow tables :class:`weights.NarrowTable`),
        with no copy."""
        raise NotImplementedError

    def parameters(self) -> dict[str, np.ndarray]:
        """Return every weight by name, as arrays.

        A loaded model keeps its dense weights (the layers' ``W_*``) only packed for its GEMM;
        the first call of a float32 or float64 model unpacks them into arrays of their own,
        which the model keeps (and packs again after ``writable_parameters``): what an
        optimizer updates in place. A narrow model (``weight_format`` "bfloat16",
        "float16", "q8_0") gives float32 copies of its weights, read-only, and keeps none.

        Returns
        -------
        dict of str to ndarray
            Dense weights stored (in, out).
        """
        stored = self._stored()
        if self._format is None:
            for value in stored.values():
                if isinstance(value, ops.Packed) and value.source is None:
                    value.source = value.unpack()
                    value.source.flags.writeable = False
        params = {name: weights.as_array(value) for name, value in stored.items()}
        if self._format is not None:
            for array in params.values():
                array.flags.writeable = False
        return params

    def _forward(self, ids: np.ndarray, mask: np.ndarray, type_ids: np.ndarray,
                 need_weights: bool, head_mask: np.ndarray | None,
                 hooks: HookPoints = NO_HOOKS, resume: tuple[int, np.ndarray] | None = None
                 ) -> tuple[np.ndarray, np.ndarray | None]:
        """ids, mask, type_ids: (B, n) -> hidden (B, L+1, n, d), attentions (B, L, H, n, n)
        or None. ``hooks``: the HookPoints the forward visits (records and changes).
        ``resume``: (layer, x) starts the forward at that layer's ``hook_resid_pre`` with x
        (B*n, d) C-contiguous, the residual there (written in place): the embeddings and the
        layers before it are skipped (their hidden states are NaN)."""
        raise NotImplementedError


    def _final_norm(self, x: np.ndarray) -> np.ndarray:
        """Pre-norm decoders: the final norm (gain and bias) over the last axis of x."""
        raise NotImplementedError(f"{type(self).__name__} has no final norm")

    def _vocab_matrix(self) -> np.ndarray:
        """Causal models: the LM head's weight (vocab, d_model)."""
        raise NotImplementedError(f"{type(self).__name__} has no LM head")

    def _lm_head(self) -> ops.Packed:
        """Causal models: the LM head's weight packed for the GEMM."""
        raise NotImplementedError(f"{type(self).__name__} has no LM head")


    # --- changing the weights in place ---------------------------------------------------------
    @contextlib.contextmanager
    def writable_parameters(self) -> Iterator[dict[str, np.ndarray]]:
        """Change the weights in place, as an optimizer step does, inside a ``with`` block.

        The block gets the arrays of ``parameters()``, writable; they are packed again for
        the GEMM when it ends. Outside the block every weight is read-only: the forward reads
        each dense weight packed for the GEMM (see ``layers``), and the tapes of
        ``backward=True`` forwards and the activation caches know which weights they were
        computed with: after the block, their backward and their weight-reading methods
        raise instead of mixing new weights with old activations. Inside it the packed
        copies are dropped (every forward would pack them again).

        Yields
        ------
        dict of str to ndarray
            ``parameters()``: the model's own arrays, by name, writable.

        Raises
        ------
        TypeError
            A model kept in a narrow format (``weight_format`` "bfloat16", "float16",
            "q8_0"): it does not train.

        See Also
        --------
        mha.train.AdamW : Updates them (``mha.train.fit`` does this every step).

        Examples
        --------
        >>> model = mha.models.from_config({"model_type": "gpt2", "n_embd": 32, "n_layer": 1,
        ...     "n_head": 4, "vocab_size": 50, "n_positions": 16}, seed=0)
        >>> with model.writable_parameters() as params:
        ...     params["layers.0.W_qkv"] *= 0.5
        >>> model.layers[0]["W_qkv"].flags.writeable
        False
        """
        if self._format is not None:
            raise TypeError(
                f"the weights of a {self._format} model cannot change: training and parameter "
                f"gradients need a float32 or float64 model (load it with weights=None)")
        params = self.parameters()
        self._packs.clear()
        self._weights_version += 1          # the tapes and caches of earlier forwards go stale
        for array in params.values():
            array.flags.writeable = True
        try:
            yield params
        finally:
            self._weights_version += 1
            for layer in self.layers:       # the changed arrays packed again, kept
                for name, value in layer.stored().items():
                    if isinstance(value, ops.Packed) and value.source is not None:
                        layer[name] = weights.Packed(value.source, keep=True)
            self._seal_weights()
