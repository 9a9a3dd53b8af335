"""Gradients through a whole pre-norm decoder (GPT-2, the LLaMA family) on the C core;
the BERT family's post-norm blocks are in :mod:`mha.models.encoder_backward`.

``model(ids, mask, backward=True)`` runs a forward that keeps, in one :class:`Record`
carved from one allocation, every activation the backward reads; ``model.backward(d_logits,
d_hidden, wrt)`` walks the layers in reverse, each step under the forward line it
differentiates, and adds (``+=``) every gradient into its array, so that the residual
branches sum without special cases. ``model.loss_and_grads`` is the next-token
cross-entropy on the C core's chunked softmax cross-entropy over the LM head (never the
whole (tokens, vocab) gradient at once).

The forward of one block, as recorded (B texts of n tokens, rows = B * n; d the width; H
query heads and H_kv key/value heads of d_head; f the MLP width, 2f columns of ``pre`` when
the MLP is gated)::

    ln1   = norm_1(resid_pre)                                  # LayerNorm or RMSNorm
    q, k, v = split(ln1 W_qkv + b_qkv)        (rope(q), rope(k) in the LLaMA family)
    att   = attention(q, k, v, causal, padding [, window])     # lse kept beside it
    heads = merge(att) * head_mask
    resid_mid = resid_pre + heads W_o + b_o
    ln2   = norm_2(resid_mid)
    pre   = ln2 W_in + b_in ;  post = act(pre)                 # act(gate) * up when gated
    resid_post = resid_mid + post W_out + b_out                 # the next block's resid_pre
"""
from __future__ import annotations

import mmap
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import numpy as np
from numpy.typing import ArrayLike

from mha import _core

from . import ops
from .hooks import run_hook_fns

__all__ = ["Differentiable", "DecoderLayout", "EncoderLayout", "Record", "LayerRecord"]


@dataclass(frozen=True)
class DecoderLayout:
    """The parameter names of a pre-norm decoder, as its ``parameters()`` and ``layers`` name
    them: what the generic backward needs to know of a family.

    ln1, ln2, final: (gain, bias or None) of the norms (bias None: RMSNorm); attention: the
    layer's (W_qkv, b_qkv, W_o, b_o); mlp: (W_in, b_in, W_out, b_out); gated: W_in holds
    [W_gate | W_up]; embed: the token table; positions: the learned position table or None.
    Absent biases are simply missing from the layer's dict.
    """
    ln1: tuple[str, str | None]
    ln2: tuple[str, str | None]
    final: tuple[str, str | None]
    attention: tuple[str, str, str, str]
    mlp: tuple[str, str, str, str]
    gated: bool
    embed: str
    positions: str | None


@dataclass(frozen=True)
class EncoderLayout:
    """The BERT family's post-norm blocks (:mod:`mha.models.encoder_backward`), with the
    names BertModel gives its weights."""


@dataclass
class LayerRecord:
    """What one block's backward reads, written by its forward (views of the Record's one
    buffer). rows = B * n tokens.

    resid_pre (rows, d): the block's input; ln1 (rows, d): norm_1's output; q (B, H, n,
    d_head), k, v (B, H_kv, n, d_head): C-contiguous, after the rotary embedding; att (B, H,
    n, d_head): the attention's output before head_mask; lse (B, H, n): its row log-sum-exp;
    heads (rows, H * d_head): att merged per token, times head_mask; resid_mid (rows, d);
    ln2 (rows, d); pre (rows, f or 2f): the MLP's first product with its bias; post (rows,
    f): its activation.
    """
    resid_pre: np.ndarray
    ln1: np.ndarray
    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    att: np.ndarray
    lse: np.ndarray
    heads: np.ndarray
    resid_mid: np.ndarray
    ln2: np.ndarray
    pre: np.ndarray
    post: np.ndarray


@dataclass
class Record:
    """Everything the backward of one forward reads: a :class:`LayerRecord` per block (an
    encoder's: :class:`mha.models.encoder_backward.EncoderLayerRecord`), ``norm_input``
    (rows, d): the input of the norm outside the blocks (a decoder's final norm: the last
    block's output; an encoder's embedding norm: the embeddings' sum), the model's last
    hidden state ``hidden`` (rows, d),
    all carved from ``buffer`` (one allocation); the forward's ids (B, n), padding mask (B,
    n) bool or None, head_mask (L, H) or None, whether the input was one text, and an
    encoder's token types (B, n) or None."""
    buffer: np.ndarray
    layers: list[Any]
    norm_input: np.ndarray
    hidden: np.ndarray
    ids: np.ndarray
    pad_mask: np.ndarray | None
    head_mask: np.ndarray | None
    single: bool
    type_ids: np.ndarray | None = None

    @property
    def nbytes(self) -> int:
        """The bytes the record holds."""
        return int(self.buffer.nbytes)


def _carve(dtype: Any, shapes: Sequence[tuple[str, tuple[int, ...]]]
           ) -> tuple[np.ndarray, list[dict[str, np.ndarray]]]:
    """One buffer for every (name, shape), and C-contiguous views of it -> (buffer, [views
    by name]) in the order given; a name repeats once per group (a new dict when the first
    name comes back)."""
    total = sum(int(np.prod(s)) for _, s in shapes)
    buffer = np.empty(total, dtype=dtype)
    groups: list[dict[str, np.ndarray]] = []
    start = 0
    first = shapes[0][0]
    for name, shape in shapes:
        if name == first:
            groups.append({})
        size = int(np.prod(shape))
        groups[-1][name] = buffer[start:start + size].reshape(shape)
        start += size
    return buffer, groups


#: activation gradients ``wrt`` may name, per block (TransformerLens's hook names)
BLOCK_POINTS = ("hook_resid_pre", "attn.hook_q", "attn.hook_k", "attn.hook_v",
                "attn.hook_rot_q", "attn.hook_rot_k", "attn.hook_attn_scores",
                "attn.hook_pattern", "attn.hook_z", "attn.hook_result", "hook_attn_out",
                "hook_resid_mid", "mlp.hook_pre", "mlp.hook_pre_linear", "mlp.hook_post",
                "hook_mlp_out", "hook_resid_post")


class Differentiable:
    """What a model adds for gradients: ``model(..., backward=True)``, :meth:`backward` and
    :meth:`loss_and_grads` (causal models). A family sets ``_grad_layout``
    (:class:`DecoderLayout` for a pre-norm decoder, :class:`EncoderLayout` for the BERT
    family); without one, ``backward=True`` raises NotImplementedError."""
    _grad_layout: DecoderLayout | EncoderLayout | None = None
    _record: Record | None = None

    def __getstate__(self) -> dict[str, Any]:
        state: dict[str, Any] = super().__getstate__()  # type: ignore[misc]
        state.pop("_record", None)          # a forward's activations are not the model's
        state.pop("_grad_workspace", None)
        state.pop("_grad_memory", None)     # recycled gradient memory
        return state

    def __call__(self, input_ids: ArrayLike, attention_mask: ArrayLike | None = None,
                 token_type_ids: ArrayLike | None = None, *, need_weights: bool = True,
                 head_mask: ArrayLike | None = None,
                 keep_weights: Mapping[int, Any] | None = None, backward: bool = False) -> Any:
        """Run the model on token ids (see ``TransformerModel.__call__``).

        Parameters
        ----------
        input_ids : array_like of int, shape (n,) or (B, n)
            Token ids in [0, vocab_size).
        attention_mask : array_like of bool, shape of ``input_ids``, optional
            True / 1 = real token, False / 0 = padding.
        token_type_ids : array_like of int, shape of ``input_ids``, optional
            BERT segment ids.
        need_weights : bool, default True
            Compute and keep the attention weights.
        head_mask : array_like, shape (n_layers, n_heads), optional
            Multipliers on each head's output.
        keep_weights : dict, optional
            {layer: heads} or {layer: (heads, rows)}: keep only that part of the weights (see
            ``TransformerModel.__call__``); not with ``backward``.
        backward : bool, default False
            Keep what :meth:`backward` needs (the model's ``_record``, replaced by each such
            call); causal models then also fill the Encoding's ``logits``.

        Returns
        -------
        Encoding
            Tokens, ids, hidden states, attentions (and logits with ``backward``).
        """
        if not backward:
            return super().__call__(input_ids, attention_mask,  # type: ignore[misc]
                                    token_type_ids, need_weights=need_weights,
                                    head_mask=head_mask, keep_weights=keep_weights)
        if keep_weights is not None:
            raise TypeError("keep_weights is not taken with backward=True (the backward keeps "
                            "the whole forward's record)")
        return self._run_recorded(input_ids, attention_mask, head_mask, need_weights, True,
                                  token_type_ids)

    def _run_recorded(self, input_ids: ArrayLike, attention_mask: ArrayLike | None,
                      head_mask: ArrayLike | None, need_weights: bool, logits: bool,
                      token_type_ids: ArrayLike | None = None,
                      token_embeddings: np.ndarray | None = None) -> Any:
        """The forward that keeps its Record (``self._record``) -> an Encoding (with logits
        for a causal model when ``logits``). ``token_embeddings`` (B, n, d_model), when
        given, replaces the token table's rows (``hook_embed``): integrated gradients run the
        model on interpolated embeddings."""
        layout = self._need_layout()
        model: Any = self
        ids = np.asarray(input_ids)
        single = ids.ndim == 1
        ids = model._check_ids(np.atleast_2d(ids))
        B, n = ids.shape
        mask = (np.ones((B, n), bool) if attention_mask is None
                else np.asarray(attention_mask).astype(bool).reshape(B, n))
        if head_mask is not None:
            head_mask = np.asarray(head_mask, dtype=model.dtype)
            if head_mask.shape != (model.n_layers, model.n_heads):
                raise ValueError(f"head_mask must have shape (n_layers, n_heads) = "
                                 f"{(model.n_layers, model.n_heads)}, got {head_mask.shape}")
        type_ids = (np.zeros((B, n), np.int64) if token_type_ids is None
                    else np.asarray(token_type_ids).astype(np.int64).reshape(B, n))
        if isinstance(layout, EncoderLayout):
            from . import encoder_backward
            record, attn = encoder_backward.forward_record(model, ids, mask, type_ids,
                                                           head_mask, need_weights,
                                                           token_embeddings)
        else:
            record, attn = _forward_record(model, layout, ids, mask, head_mask, need_weights,
                                           token_embeddings)
        record.single = single
        self._record = record
        from .base import Encoding, _unbatch
        hidden = np.empty((B, model.n_layers + 1, n, model.d_model), dtype=model.dtype)
        for i, r in enumerate(record.layers):
            hidden[:, i] = r.resid_pre.reshape(B, n, -1)
        hidden[:, -1] = record.hidden.reshape(B, n, -1)
        tokens = None
        if model.tokenizer is not None:
            tokens = [[model.tokenizer.id_to_token(i) for i in row[m]]
                      for row, m in zip(ids, mask)]
        enc = Encoding(tokens=tokens, input_ids=ids, attention_mask=mask, hidden_states=hidden,
                       attentions=attn, token_type_ids=type_ids)
        if model.has_lm_head and logits:
            enc.logits = ops.unembed(record.hidden, model._lm_head()).reshape(B, n, -1)
        if single:
            enc = _unbatch(enc)
            if enc.logits is not None:
                enc.logits = enc.logits[0]
        return enc

    def _need_layout(self) -> DecoderLayout | EncoderLayout:
        if self._grad_layout is None:
            raise NotImplementedError(
                f"backward=True is built for GPT-2, the LLaMA and the BERT families, not "
                f"for {type(self).__name__}")
        return self._grad_layout

    def backward(self, d_logits: ArrayLike | None = None, d_hidden: ArrayLike | None = None,
                 wrt: Sequence[str] = (), *, retain: bool = False,
                 parameters: bool = True,
                 bwd_hooks: Sequence[tuple[Any, Callable[[np.ndarray, str], Any]]] = ()
                 ) -> dict[str, np.ndarray]:
        """Back-propagate through the last ``model(..., backward=True)``.

        Parameters
        ----------
        d_logits : array_like, shape (B, n, vocab) or (n, vocab), optional
            The gradient of the output with respect to the logits (causal models).
        d_hidden : array_like, shape (B, n, d_model) or (n, d_model), optional
            The gradient with respect to the last hidden state (after the final norm); added
            to the one from ``d_logits`` when both are given.
        wrt : sequence of str, optional
            Activations to return the gradient of, by hook name (``hook_embed``,
            ``hook_pos_embed``, ``blocks.{l}.hook_resid_pre``, ``blocks.{l}.attn.hook_pattern``,
            ``blocks.{l}.attn.hook_z``, ... see ``BLOCK_POINTS``), and ``head_mask`` (the
            gradient with respect to the multipliers on each head's output, (L, H), at the
            forward's head_mask or at ones).
        retain : bool, default False
            Keep the forward's record for another backward (as torch's ``retain_graph``).
        parameters : bool, default True
            Compute the parameters' gradients; False returns only those of ``wrt``, about
            half the backward's products fewer (as ``torch.autograd.grad`` for inputs only).
        bwd_hooks : sequence of (str or callable, callable), optional
            ``(name_or_predicate, fn)`` at the points ``wrt`` takes (not ``head_mask``; a
            predicate skips ``attn.hook_result`` unless named, as forward hooks do):
            ``fn(grad, name)`` gets the gradient arriving at that point, batch first with the
            activation cache's shape, and returns a replacement (same shape and dtype) or
            None (it may also edit grad in place); what it leaves flows on to every earlier
            point and parameter, as TransformerLens's ``run_with_hooks(bwd_hooks=...)``.
            Several hooks at one point run in list order; ``wrt`` gets the gradient after
            them.

        Returns
        -------
        dict of str to ndarray
            The gradient of every parameter by the names of ``parameters()`` (same shapes;
            none with ``parameters=False``), then one entry per name of ``wrt``, batch first
            as the activation cache holds it ((1, ...) for one text).

        Raises
        ------
        RuntimeError
            No forward with ``backward=True`` since the last backward.
        ValueError
            Neither gradient given, or one of the wrong shape.
        KeyError
            A name of ``wrt`` or ``bwd_hooks`` that is no differentiable hook point of the
            model.
        TypeError, ValueError
            A backward hook that returns something else than None or an array of the
            gradient's shape and dtype (the error names the point; the record stays).
        """
        layout = self._need_layout()
        model: Any = self
        record = self._record
        if record is None:
            raise RuntimeError("backward needs the state of a forward: run "
                               "model(ids, attention_mask, backward=True) first (each "
                               "backward uses it up unless retain=True)")
        wanted = _check_wrt(model, wrt)
        hooks = _check_hooks(model, bwd_hooks)
        arrays = _check_top(model, record, d_logits, d_hidden)
        grads = _zero_grads(model, "d_logits" in arrays) if parameters else NoGrads()
        top = _top_gradient(model, layout, record, arrays, grads)
        if isinstance(layout, EncoderLayout):
            from . import encoder_backward
            encoder_backward.backward(model, record, top, wanted, grads, hooks)
        else:
            _backward(model, layout, record, top, wanted, grads, hooks)
        if not retain:
            self._record = None
        return dict(grads)

    def loss_and_grads(self, ids: ArrayLike, labels: ArrayLike | None = None,
                       attention_mask: ArrayLike | None = None, *, wrt: Sequence[str] = (),
                       head_mask: ArrayLike | None = None,
                       bwd_hooks: Sequence[tuple[Any, Callable[[np.ndarray, str], Any]]] = ()
                       ) -> tuple[float, dict[str, np.ndarray]]:
        """The next-token cross-entropy of a causal LM and its gradients.

        Logits at position i are scored against labels[i + 1] (shifted as transformers'
        ``*ForCausalLM`` does), mean over the labels that are not -100, on the C core's
        chunked cross-entropy (the (tokens, vocab) logits are never held whole).

        Parameters
        ----------
        ids : array_like of int, shape (n,) or (B, n)
            Token ids.
        labels : array_like of int, shape of ``ids``, optional
            The targets (-100: ignored); default the ids, with padding (attention_mask 0)
            ignored. transformers counts padding unless its labels say -100 there.
        attention_mask : array_like of bool, shape of ``ids``, optional
            True / 1 = real token, False / 0 = padding.
        wrt : sequence of str, optional
            Activations to return the gradient of, as in :meth:`backward`.
        head_mask : array_like, shape (n_layers, n_heads), optional
            Multipliers on each head's output (a pruned model's loss and gradients).
        bwd_hooks : sequence of (str or callable, callable), optional
            Hooks on the gradients on the way back, as in :meth:`backward`.

        Returns
        -------
        loss : float
            The mean cross-entropy.
        grads : dict of str to ndarray
            The gradient of every parameter (by the names of ``parameters()``) and of each
            name of ``wrt``.

        Raises
        ------
        TypeError
            An encoder (no next-token loss).
        ValueError
            Labels of another shape than the ids, or out of the vocabulary.
        """
        layout = self._need_layout()
        model: Any = self
        if not model.causal or not isinstance(layout, DecoderLayout):
            raise TypeError(f"{type(self).__name__} is no causal LM: use backward(d_hidden=...)")
        ids_2d = np.atleast_2d(np.asarray(ids))
        if labels is None:
            targets = ids_2d.astype(np.int64).copy()
            if attention_mask is not None:
                targets[~np.asarray(attention_mask).astype(bool).reshape(ids_2d.shape)] = -100
        else:
            targets = np.atleast_2d(np.asarray(labels)).astype(np.int64)
            if targets.shape != ids_2d.shape:
                raise ValueError(f"labels has shape {np.shape(labels)} but ids has "
                                 f"{np.shape(ids)}")
        vocab = model.config.vocab_size
        if not np.all((targets == -100) | ((targets >= 0) & (targets < vocab))):
            raise ValueError(f"labels must lie in [0, {vocab}) or be -100 (ignored)")
        shifted = np.full(targets.shape, -100, dtype=np.int64)      # position i -> label i+1
        shifted[:, :-1] = targets[:, 1:]
        wanted = _check_wrt(model, wrt)
        hooks = _check_hooks(model, bwd_hooks)
        kept = self._record                 # a record of the user's own forward stays
        try:
            self._run_recorded(ids_2d, attention_mask, head_mask, False, False)
            record = self._record
        finally:
            self._record = kept
        assert record is not None
        grads = _zero_grads(model, True)
        top = np.zeros_like(record.hidden)
        # forward: loss = cross_entropy(hidden W_vocab^T, labels shifted by one)
        loss, _, _ = _core.cross_entropy(record.hidden, model._vocab_matrix(),
                                         shifted.reshape(-1), trans_w=True, d_hidden=top,
                                         d_w=grads[_vocab_name(model, layout)])
        _backward(model, layout, record, top, wanted, grads, hooks)
        return float(loss), grads


def _zero_grads(model: Any, lm_head: bool) -> dict[str, np.ndarray]:
    """A zero array per parameter, by name, each gradient added into its own.

    Every gradient but the embedding tables' is carved from one block of the model's
    :class:`GradMemory`, which a call takes back from the last one once that call's gradients
    are all gone, and filled with zeros here, on one thread: a recycled block's pages are
    resident, so a training loop takes no page faults for its gradients whatever malloc did
    with the memory freed in between (MiniLM's backward after a torch step in the same process
    took 11,000 faults a step for them), and the first call's faults are taken by one thread
    rather than by the products' several at once, which cost more than the products.

    An embedding table's gradient gets only the batch's rows: it has pages of its own that
    the system zeroes as they are first written (:func:`_lazy_zeros`), so the rest costs
    nothing (MiniLM's 47 MB word table). ``lm_head``: the LM head gets a gradient (a tied
    token table, then written whole, goes in the block)."""
    layout = model._grad_layout
    if isinstance(layout, DecoderLayout):
        tables = {layout.embed, layout.positions}
    else:
        tables = {"word_embeddings", "position_embeddings", "token_type_embeddings"}
    if lm_head:
        tables.discard(_vocab_name(model, layout))
    params = model.parameters()
    spans, size = {}, 0
    for name, a in params.items():
        if name not in tables:
            spans[name] = size
            size += -(-a.nbytes // GradMemory.ALIGN) * GradMemory.ALIGN
    memory = model.__dict__.get("_grad_memory")
    if memory is None:
        memory = model.__dict__["_grad_memory"] = GradMemory()
    block = memory.take(tuple((k, params[k].shape, params[k].dtype.str) for k in spans), size)
    block.fill(0)
    return {name: _lazy_zeros(a.shape, a.dtype) if name in tables else
            block[spans[name]:spans[name] + a.nbytes].view(a.dtype).reshape(a.shape)
            for name, a in params.items()}


class GradMemory:
    """The memory a model's parameter gradients are carved from, used again by later calls.

    :meth:`take` hands out a block (an anonymous memory map) as a new uint8 array that only
    that call's gradients view: NumPy points a view's ``base`` at the first array that owns
    its data or whose base is no array, which is this one (its base is the map's buffer), so
    it lives exactly as long as the last of them. Its finalizer then puts the map back as the
    spare, which the next call of the same layout takes instead of a new map. One spare at
    most: a training loop holding its last step's gradients while it computes the next
    alternates between two blocks, as many as it held before. Memory a caller still holds is
    never handed out again; the spare stays with the model (unpickled models start without).
    """
    #: bytes each gradient's start is aligned to (a cache line, an AVX-512 vector)
    ALIGN = 64

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._spare: tuple[Any, mmap.mmap] | None = None

    def take(self, key: Any, nbytes: int) -> np.ndarray:
        """A block of at least ``nbytes`` (uint8, contents undefined): the spare if it was
        taken under the same ``key``, else a new one."""
        with self._lock:
            spare, self._spare = self._spare, None
        if spare is not None and spare[0] == key:
            memory = spare[1]
        else:
            memory = _anonymous_map(nbytes)
        del spare                                   # a spare of another layout is unmapped
        block = np.frombuffer(memory, np.uint8)
        weakref.finalize(block, self._give_back, key, memory).atexit = False
        return block

    def _give_back(self, key: Any, memory: mmap.mmap) -> None:
        with self._lock:
            self._spare = (key, memory)


def _anonymous_map(nbytes: int) -> mmap.mmap:
    """Zeroed memory of this process alone, on 4 KiB pages the system zeroes as they are first
    touched: private (a forked child gets its own copy; Python's default would share it), and
    without the advice to use huge pages that NumPy gives its large arrays: each first touch
    of a huge page zeroes 2 MiB, and the kernel may compact memory to find it (the rows of
    128 ids in MiniLM's word table: 2.1 ms on huge pages, 0.5 ms on small ones; its first
    block 0.25 s against 0.10 s, and recycled blocks no faster)."""
    flags = getattr(mmap, "MAP_PRIVATE", None)
    if flags is None:                               # Windows: anonymous maps are private
        return mmap.mmap(-1, max(nbytes, 1))
    return mmap.mmap(-1, max(nbytes, 1), flags=flags | mmap.MAP_ANONYMOUS)


def _lazy_zeros(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """A zero array on pages of its own (:func:`_anonymous_map`), whatever malloc holds: the
    gradient of a table a call writes a few rows of."""
    nbytes = int(np.prod(shape)) * dtype.itemsize
    return np.frombuffer(_anonymous_map(nbytes), dtype, count=int(np.prod(shape))).reshape(shape)


def _grad_points(model: Any) -> tuple[set[str], str]:
    """Every name ``wrt`` may take for the model, and how the error of an unknown one lists
    them."""
    if isinstance(model._grad_layout, EncoderLayout):
        from .encoder_backward import encoder_points
        valid = encoder_points(model)
        return valid, (f"one of {sorted(p for p in valid if 'blocks.' not in p)} "
                       f"or blocks.{{l}}.<a block's point>")
    points = {"hook_embed", "head_mask"}
    if model._grad_layout.positions is not None:
        points.add("hook_pos_embed")
    block = [p for p in BLOCK_POINTS if (model.rotary or "rot_" not in p)
             and (model._grad_layout.gated or p != "mlp.hook_pre_linear")]
    points.update(f"blocks.{l}.{p}" for l in range(model.n_layers) for p in block)
    return points, f"head_mask, hook_embed or blocks.{{l}}.<one of {block}>"


def _check_wrt(model: Any, wrt: Sequence[str]) -> list[str]:
    """The names of ``wrt`` after checking them against the model's differentiable points."""
    if isinstance(wrt, str):
        wrt = [wrt]
    points, expected = _grad_points(model)
    for name in wrt:
        if name not in points:
            raise KeyError(f"{name!r} is no hook point the backward reaches; expected "
                           f"{expected}")
    return list(wrt)


def _check_hooks(model: Any, bwd_hooks: Sequence[tuple[Any, Any]]
                 ) -> dict[str, list[Callable[[np.ndarray, str], Any]]]:
    """{point: [fn, ...]} of ``bwd_hooks`` ((name or predicate, fn) pairs), in list order,
    after checking every name and fn; a predicate selects among the points ``wrt`` takes
    (``head_mask`` is no activation, ``attn.hook_result`` only by its name, as forward)."""
    from .hooks import _resolve
    points, _ = _grad_points(model)
    valid = sorted(points - {"head_mask"})
    hooks: dict[str, list[Callable[[np.ndarray, str], Any]]] = {}
    for selector, fn in bwd_hooks:
        if not callable(fn):
            raise TypeError(f"the backward hook at {selector!r} is not callable: {fn!r}")
        for name in _resolve(selector, valid):
            hooks.setdefault(name, []).append(fn)
    return hooks


def _vocab_name(model: Any, layout: DecoderLayout | EncoderLayout) -> str:
    """The parameter name of the LM head's weight: its own, or the tied token table's."""
    if "lm_head" in model.parameters() or not isinstance(layout, DecoderLayout):
        return "lm_head"
    return layout.embed


def _check_top(model: Any, record: Record, d_logits: ArrayLike | None,
               d_hidden: ArrayLike | None) -> dict[str, np.ndarray]:
    """d_logits (rows, vocab) and d_hidden (rows, d) of the model's dtype, by name, after
    checking their shapes against the forward's (nothing is written before)."""
    B, n = record.ids.shape
    rows, d = record.hidden.shape
    lead = (n,) if record.single else (B, n)
    arrays = {}
    for name, value, width in (("d_logits", d_logits, model.config.vocab_size),
                               ("d_hidden", d_hidden, d)):
        if value is None:
            continue
        if name == "d_logits" and not model.has_lm_head:
            raise ValueError(f"{type(model).__name__} has no logits: give d_hidden")
        a = np.asarray(value)
        if a.shape != (*lead, width):
            raise ValueError(f"{name} must have shape {(*lead, width)} (the forward's), "
                             f"got {a.shape}")
        arrays[name] = np.ascontiguousarray(a, dtype=model.dtype).reshape(rows, width)
    if not arrays:
        raise ValueError("give d_logits or d_hidden (the gradient of the output)")
    return arrays


def _top_gradient(model: Any, layout: DecoderLayout | EncoderLayout, record: Record,
                  arrays: dict[str, np.ndarray], grads: dict[str, np.ndarray]) -> np.ndarray:
    """The gradient with respect to the final norm's output (rows, d): d_hidden plus the LM
    head's chain rule on d_logits, whose weight gradient is added into grads."""
    top = arrays["d_hidden"].copy() if "d_hidden" in arrays else np.zeros_like(record.hidden)
    if "d_logits" in arrays:
        # forward: logits = hidden W_vocab^T
        linear_backward(arrays["d_logits"], record.hidden, model._vocab_matrix(), None,
                        grads[_vocab_name(model, layout)], None, da=top, trans_b=True)
    return top


def _norm(x: np.ndarray, gain: np.ndarray, bias: np.ndarray | None, eps: float,
          out: np.ndarray) -> None:
    """out = LayerNorm (bias given) or RMSNorm (bias None) of x (rows, d)."""
    if bias is None:
        _core.rms_norm(x, gain=gain, eps=eps, out=out)
    else:
        _core.layer_norm(x, gain=gain, bias=bias, eps=eps, out=out)


def _norm_backward(d_y: np.ndarray, x: np.ndarray, gain: np.ndarray, eps: float,
                   dx: np.ndarray, grads: dict[str, np.ndarray], names: tuple[str, str | None]
                   ) -> None:
    """dx += the norm's input gradient; the gain's (and bias') gradients added into grads."""
    if names[1] is None:
        _core.rms_norm_backward(d_y, x, gain=gain, eps=eps, dx=dx, dgain=grads[names[0]])
    else:
        _core.layer_norm_backward(d_y, x, gain=gain, eps=eps, dx=dx, dgain=grads[names[0]],
                                  dbias=grads[names[1]])


def _attention_options(model: Any, layer: int, B: int, H: int, n: int) -> dict[str, Any]:
    """The attention kernel's mask options of one layer (sliding window), causal and scale."""
    band = model._band(layer, n, n)
    return dict(mask=None if band is None else np.broadcast_to(band, (B, H, n, n)),
                causal=model.causal, scale=model.attention_scale(layer))


def _forward_record(model: Any, layout: DecoderLayout, ids: np.ndarray, mask: np.ndarray,
                    head_mask: np.ndarray | None, need_weights: bool,
                    token_embeddings: np.ndarray | None = None
                    ) -> tuple[Record, np.ndarray | None]:
    """The forward of a pre-norm decoder on the C kernels, writing every activation the
    backward reads into one Record -> (record, attentions (B, L, H, n, n) or None);
    ``token_embeddings`` (B, n, d) in place of the token table's rows when given."""
    B, n = ids.shape
    rows = B * n
    L, H, H_kv, dh, d = (model.n_layers, model.n_heads, model.n_kv_heads, model.d_head,
                         model.d_model)
    W_in = model.layers[0][layout.mlp[0]]
    f_in = W_in.shape[1]
    f = f_in // 2 if layout.gated else f_in
    shapes: list[tuple[str, tuple[int, ...]]] = []
    for _ in range(L):
        shapes += [("resid_pre", (rows, d)), ("ln1", (rows, d)), ("q", (B, H, n, dh)),
                   ("k", (B, H_kv, n, dh)), ("v", (B, H_kv, n, dh)), ("att", (B, H, n, dh)),
                   ("lse", (B, H, n)), ("heads", (rows, H * dh)), ("resid_mid", (rows, d)),
                   ("ln2", (rows, d)), ("pre", (rows, f_in)), ("post", (rows, f))]
    buffer, groups = _carve(model.dtype, shapes + [("resid_pre", (rows, d)),
                                                   ("hidden", (rows, d))])
    layers = [LayerRecord(**g) for g in groups[:L]]
    norm_input, hidden = groups[L]["resid_pre"], groups[L]["hidden"]
    pad_mask = None if mask.all() else np.ascontiguousarray(mask, dtype=bool)
    params = model.parameters()
    eps = model.config.norm_eps
    rope = model._rope(0, n) if model.rotary else None
    attn = np.empty((B, L, H, n, n), dtype=model.dtype) if need_weights else None

    # forward: x = tok_emb[ids] (+ pos_emb[0..n))
    x = layers[0].resid_pre if L else norm_input
    x[...] = (ops.embedding(params[layout.embed], ids) if token_embeddings is None
              else token_embeddings.reshape(rows, d))
    if layout.positions is not None:
        ops.embedding(params[layout.positions], np.broadcast_to(np.arange(n), (B, n)), out=x)
    for i, (p, r) in enumerate(zip(model.layers, layers)):
        W_qkv, b_qkv, W_o, b_o = layout.attention
        _norm(r.resid_pre, p[layout.ln1[0]], p.get(layout.ln1[1] or ""), eps, out=r.ln1)
        qkv = ops.linear(r.ln1, model._dense((i, W_qkv), p[W_qkv]), p.get(b_qkv))
        if rope is not None:
            ops.rope_(qkv, H + H_kv, dh, *rope)
        for dst, src in zip((r.q, r.k, r.v), ops.split_heads(qkv, B, n, (H, H_kv, H_kv), dh)):
            np.copyto(dst, src)
        _attend(model, i, r, pad_mask, head_mask, attn)
        np.copyto(r.resid_mid, r.resid_pre)
        ops.linear(r.heads, model._dense((i, W_o), p[W_o]), p.get(b_o), out=r.resid_mid)
        _norm(r.resid_mid, p[layout.ln2[0]], p.get(layout.ln2[1] or ""), eps, out=r.ln2)
        w_in, b_in, w_out, b_out = layout.mlp
        np.copyto(r.pre, ops.linear(r.ln2, model._dense((i, w_in), p[w_in]), p.get(b_in)))
        _core.activation(r.pre, act=model._act | (ops.GATED if layout.gated else 0),
                         out=r.post)
        nxt = layers[i + 1].resid_pre if i + 1 < L else norm_input
        np.copyto(nxt, r.resid_mid)
        ops.linear(r.post, model._dense((i, w_out), p[w_out]), p.get(b_out), out=nxt)
    gain, bias = layout.final
    _norm(norm_input, params[gain], params.get(bias or ""), eps, out=hidden)
    record = Record(buffer=buffer, layers=layers, norm_input=norm_input, hidden=hidden,
                    ids=ids, pad_mask=pad_mask, head_mask=head_mask, single=False)
    return record, attn


def _attend(model: Any, i: int, r: Any, pad_mask: np.ndarray | None,
            head_mask: np.ndarray | None, attn: np.ndarray | None) -> None:
    """Layer i's attention on the record r's q, k, v: r.att and r.lse, then r.heads (the
    heads merged per token, times head_mask); the weights into attn[:, i] when given."""
    B, H, n, dh = r.q.shape
    _, weights, lse = _core.attention_forward(
        r.q, r.k, r.v, key_padding_mask=pad_mask, need_weights=attn is not None,
        return_lse=True, out=r.att, **_attention_options(model, i, B, H, n))
    np.copyto(r.lse, lse)
    if attn is not None:
        attn[:, i] = weights
    merged = r.heads.reshape(B, n, H, dh)
    np.copyto(merged, r.att.transpose(0, 2, 1, 3))
    if head_mask is not None:
        merged *= head_mask[i][None, None, :, None]


def _attend_backward(model: Any, i: int, r: Any, record: Record, d_heads: np.ndarray,
                     d_head_mask: np.ndarray, keep: Any) -> np.ndarray:
    """The backward of :func:`_attend` and of the rotary embedding before it: d_heads (rows,
    H * d_head) -> d_qkv (rows, (H + 2 H_kv) d_head), the gradient of the fused q/k/v
    product's output; d_head_mask[i] set; keep(layer, point, value, shape) offered the
    activation gradients on the way."""
    B, H, n, dh = r.q.shape
    H_kv = r.k.shape[1]
    keep(i, "attn.hook_z", d_heads, (B, n, H, dh))
    # forward: heads = merge(att) * head_mask
    d_att = np.ascontiguousarray(d_heads.reshape(B, n, H, dh).transpose(0, 2, 1, 3))
    d_head_mask[i] = np.einsum("bhnd,bhnd->h", d_att, r.att)
    if record.head_mask is not None:
        d_att *= record.head_mask[i][None, :, None, None]
    d_scores = None
    if keep.wants(i, "attn.hook_pattern") or keep.wants(i, "attn.hook_attn_scores"):
        d_scores = _pattern_gradients(model, i, r, record, d_att, keep)
    # forward: att = attention(q, k, v)
    dq, dk, dv = _core.attention_backward(
        d_att, r.q, r.k, r.v, key_padding_mask=record.pad_mask, out=r.att, lse=r.lse,
        **_attention_options(model, i, B, H, n))
    if d_scores is not None:
        dq, dk = _score_input_gradients(model.attention_scale(i), r.q, r.k, d_scores)
    d_qkv = np.empty((B * n, (H + 2 * H_kv) * dh), dtype=model.dtype)
    for dst, src in zip(ops.split_heads(d_qkv, B, n, (H, H_kv, H_kv), dh), (dq, dk, dv)):
        np.copyto(dst, src)
    parts = d_qkv.reshape(B, n, H + 2 * H_kv, dh)
    if model.rotary:
        keep(i, "attn.hook_rot_q", parts[:, :, :H], (B, n, H, dh))
        keep(i, "attn.hook_rot_k", parts[:, :, H:H + H_kv], (B, n, H_kv, dh))
        # forward: q, k = rope(q), rope(k)
        cos, sin = model._rope(0, n)
        _core.rope_backward(d_qkv, heads=H + H_kv, d_head=dh, cos=cos, sin=sin)
    keep(i, "attn.hook_q", parts[:, :, :H], (B, n, H, dh))
    keep(i, "attn.hook_k", parts[:, :, H:H + H_kv], (B, n, H_kv, dh))
    keep(i, "attn.hook_v", parts[:, :, H + H_kv:], (B, n, H_kv, dh))
    return d_qkv


def _pattern_gradients(model: Any, i: int, r: Any, record: Record, d_att: np.ndarray,
                       keep: Any) -> np.ndarray | None:
    """The gradients of layer i's pattern P and scores S, each (B, H, n, n), offered to keep:
    dP = d_att v^T at every entry (masked keys included), dS = P * (dP - rowsum(dP * P)), 0
    at masked keys; P recomputed from q, k and the kept log-sum-exp. -> dS when a backward
    hook is at either point (what q and k then get their gradients from), else None."""
    from .base import _grouped_products
    B, H, n, _ = r.q.shape
    hooked = keep.hooked(i, "attn.hook_pattern") or keep.hooked(i, "attn.hook_attn_scores")
    d_pattern = _grouped_products(d_att, r.v, trans_b=True).reshape(B, H, n, n)
    keep(i, "attn.hook_pattern", d_pattern, (B, H, n, n))
    if not hooked and not keep.wants(i, "attn.hook_attn_scores"):
        return None
    # forward: P = softmax(S), S = scale q k^T (-inf at masked keys)
    scores = _grouped_products(r.q, r.k, trans_b=True).reshape(B, H, n, n)
    pattern = np.exp(scores * model.attention_scale(i) - r.lse[..., None])
    allowed = model._allowed(i, n, n, record.pad_mask)
    if allowed is not None:
        pattern = np.where(allowed, pattern, 0)
    d_scores = pattern * (d_pattern - np.sum(d_pattern * pattern, axis=-1, keepdims=True))
    keep(i, "attn.hook_attn_scores", d_scores, (B, H, n, n))
    return d_scores if hooked else None


def _output_backward(keep: Any, i: int, shape: tuple[int, int, int, int],
                     d_attn_out: np.ndarray, heads: np.ndarray, W_o: np.ndarray,
                     b_o: np.ndarray | None, dW_o: np.ndarray | None,
                     db_o: np.ndarray | None, workspace: np.ndarray | None = None
                     ) -> np.ndarray:
    """The backward of the attention's output product ``attn_out = heads W_o + b_o`` (heads
    (rows, H d_head), d_attn_out (rows, d)) -> d_heads, W_o's and b_o's gradients added into
    dW_o, db_o (None: not computed); shape = (B, n, H, d_head); workspace: as
    :func:`linear_backward`'s.

    attn.hook_result (B, n, H, d) is each head's z_h W_o^(h), summed (plus b_o) into the
    attention's output, so each head's gradient is the output's; with hooks there, each head
    goes back through its own rows of W_o with its own (hooked) gradient."""
    B, n, H, dh = shape
    d = d_attn_out.shape[1]
    if not keep.hooked(i, "attn.hook_result"):
        if keep.wants(i, "attn.hook_result"):          # asked, not hooked: keep copies it
            keep(i, "attn.hook_result", np.broadcast_to(d_attn_out.reshape(B, n, 1, d),
                                                         (B, n, H, d)), (B, n, H, d))
        return linear_backward(d_attn_out, heads, W_o, b_o, dW_o, db_o, workspace=workspace)
    d_result = np.ascontiguousarray(np.broadcast_to(d_attn_out.reshape(B, n, 1, d),
                                                    (B, n, H, d)))
    keep(i, "attn.hook_result", d_result, (B, n, H, d))
    # forward: result_h = z_h W_o^(h);  attn_out = sum_h result_h + b_o
    W_heads = W_o.reshape(H, dh, d)
    d_heads = np.einsum("bnhe,hde->bnhd", d_result, W_heads).reshape(B * n, H * dh)
    if dW_o is not None:
        dW_o += np.einsum("bnhd,bnhe->hde", heads.reshape(B, n, H, dh),
                          d_result).reshape(H * dh, d)
    if db_o is not None:
        db_o += d_attn_out.sum(axis=0)
    return d_heads


def _score_input_gradients(scale: float, q: np.ndarray, k: np.ndarray, d_scores: np.ndarray
                           ) -> tuple[np.ndarray, np.ndarray]:
    """(dq, dk) of ``S = scale q k^T`` from dS (B, H, n, n): q (B, H, n, d_head), k (B, H_kv,
    n, d_head), each key head shared by H / H_kv query heads (its gradient their sum). The
    attention kernel's dq, dk give the same from the output's gradient; this one runs when a
    backward hook may have changed the pattern's or the scores' gradient."""
    B, H, n, dh = q.shape
    H_kv = k.shape[1]
    group = H // H_kv
    dq = scale * np.matmul(d_scores, np.repeat(k, group, axis=1))
    dk = scale * np.matmul(d_scores.transpose(0, 1, 3, 2), q)
    dk = dk.reshape(B, H_kv, group, n, dh).sum(axis=2)
    return dq.astype(q.dtype, copy=False), dk.astype(k.dtype, copy=False)


class Keeper:
    """The activation gradients asked for and the backward hooks: ``keep(layer, point, value,
    shape)`` runs the hooks of that point on value seen with ``shape`` (batch first), writes
    a replacement into value (the backward's own array, which flows on from there), and then
    copies value into ``out`` under its hook name when that name was asked."""

    def __init__(self, names: Sequence[str],
                 hooks: Mapping[str, list[Callable[[np.ndarray, str], Any]]] | None = None
                 ) -> None:
        self.names = set(names)
        self.hooks = dict(hooks or {})
        self.out: dict[str, np.ndarray] = {}

    def wants(self, layer: int | None, point: str) -> bool:
        name = point if layer is None else f"blocks.{layer}.{point}"
        return name in self.names or name in self.hooks

    def hooked(self, layer: int | None, point: str) -> bool:
        return (point if layer is None else f"blocks.{layer}.{point}") in self.hooks

    def branch(self, layer: int | None, point: str, value: np.ndarray,
               shape: tuple[int, ...]) -> np.ndarray:
        """The gradient of a point that is one branch of a sum (``hook_attn_out``,
        ``hook_mlp_out``, the embeddings): value itself, or a copy of it, hooked, when the
        point has hooks (the other branch keeps value)."""
        if self.hooked(layer, point):
            value = value.copy()
        self(layer, point, value, shape)
        return value

    def __call__(self, layer: int | None, point: str, value: np.ndarray,
                 shape: tuple[int, ...]) -> None:
        name = point if layer is None else f"blocks.{layer}.{point}"
        if name not in self.names and name not in self.hooks:
            return
        view = value.view()
        view.shape = shape                          # raises rather than copy
        run_hook_fns(self.hooks.get(name, ()), view, name, "backward hook",
                     "the gradient there has")
        if name in self.names:
            self.out[name] = np.array(view)


class NoGrads(dict):
    """The parameter gradients of a backward that computes none (``parameters=False``): every
    name reads None, which each step takes as "skip this parameter's gradient"."""

    def __missing__(self, key: str) -> None:
        return None


def layer_grads(grads: dict[str, np.ndarray], i: int) -> dict[str, np.ndarray]:
    """Layer i's parameter gradients by their names inside the layer."""
    if isinstance(grads, NoGrads):
        return NoGrads()
    prefix = f"layers.{i}."
    return {k[len(prefix):]: v for k, v in grads.items() if k.startswith(prefix)}


def linear_backward(d_out: np.ndarray, a: np.ndarray, w: np.ndarray, bias: np.ndarray | None,
                    dw: np.ndarray | None, dbias: np.ndarray | None,
                    da: np.ndarray | None = None, trans_b: bool = False,
                    workspace: np.ndarray | None = None) -> np.ndarray:
    """The gradient of ``a @ op(w) + bias``'s input a (added into da when given), and of w and
    the bias added into dw and dbias; with dw None only a's, one product instead of two, on
    op(w) read transposed (the GEMM packs it a slice of the shared axis at a time). With dw,
    ``_core.linear_backward`` packs op(w)'s transpose whole first, into ``workspace`` when
    given (see :func:`grad_workspace`). On a quiet machine the two ran a's product equally
    fast (2 threads, MiniLM's and GPT-2's weights, 128 to 2,048 rows, AVX-512 and AVX2), and
    the separate packing pass of the dw=None case cost gradient_relevance a sixth of its
    time; the whole packing is the core's choice for a loaded machine (block_impl.h)."""
    if dw is not None:
        return _core.linear_backward(d_out, a, w, bias=bias, trans_b=trans_b, da=da, db=dw,
                                     dbias=dbias, workspace=workspace)[0]
    return _core.linear(d_out, w, trans_b=not trans_b, out=da)


def grad_workspace(model: Any) -> np.ndarray:
    """The buffer where every dense product of a backward packs its weight's transpose
    (``_core.linear_backward``'s workspace), as large as the largest of the layers' dense
    weights packed (2.4 MB for MiniLM, 9.4 MB for GPT-2 small in float32) and kept on the
    model. An allocation per product would be released and taken again, and its first-touch
    page faults, taken by the product's threads at once, cost MiniLM's backward on 2 threads
    a third of its time."""
    width = _core.pack_weight(np.zeros((1, 1), model.dtype)).shape[2]
    need = max((-(-w.shape[0] // width) * width * w.shape[1]
                for p in model.layers for k, w in p.items() if k.startswith("W_")), default=0)
    ws = model.__dict__.get("_grad_workspace")
    if ws is None or ws.dtype != model.dtype or ws.size < need:
        ws = model.__dict__["_grad_workspace"] = np.empty(need, model.dtype)
    return ws


def _backward(model: Any, layout: DecoderLayout, record: Record, top: np.ndarray,
              wanted: list[str], grads: dict[str, np.ndarray],
              hooks: Mapping[str, list[Callable[[np.ndarray, str], Any]]] | None = None
              ) -> None:
    """Add every parameter's gradient into ``grads`` (which holds the LM head's already) and
    put those of ``wanted`` there, from the gradient ``top`` (rows, d) of the final norm's
    output; ``hooks`` {point: [fn]} run on the gradients on the way (:class:`Keeper`)."""
    B, n = record.ids.shape
    rows = B * n
    L, H, d = model.n_layers, model.n_heads, model.d_model
    eps = model.config.norm_eps
    params = model.parameters()
    keep = Keeper(wanted, hooks)
    ws = grad_workspace(model)
    d_head_mask = np.zeros((L, H), dtype=model.dtype)
    # forward: hidden = norm_f(norm_input)
    dx = np.zeros((rows, d), dtype=model.dtype)
    gain, bias = layout.final
    _norm_backward(top, record.norm_input, params[gain], eps, dx, grads, layout.final)
    for i in reversed(range(L)):
        p, r = model.layers[i], record.layers[i]
        lg = layer_grads(grads, i)
        w_in, b_in, w_out, b_out = layout.mlp
        keep(i, "hook_resid_post", dx, (B, n, d))
        d_mlp_out = keep.branch(i, "hook_mlp_out", dx, (B, n, d))
        # forward: resid_post = resid_mid + post W_out + b_out
        d_post = linear_backward(d_mlp_out, r.post, p[w_out], p.get(b_out), lg[w_out],
                                 lg.get(b_out), workspace=ws)
        keep(i, "mlp.hook_post", d_post, (B, n, -1))
        # forward: post = act(pre)   (act(gate) * up when gated)
        act = model._act | (ops.GATED if layout.gated else 0)
        d_pre = _core.activation_backward(d_post, r.pre, act=act)
        f = d_post.shape[1]
        keep(i, "mlp.hook_pre", d_pre[:, :f], (B, n, f))
        keep(i, "mlp.hook_pre_linear", d_pre[:, f:], (B, n, f))
        # forward: pre = ln2 W_in + b_in
        d_ln2 = linear_backward(d_pre, r.ln2, p[w_in], p.get(b_in), lg[w_in], lg.get(b_in),
                                workspace=ws)
        # forward: ln2 = norm_2(resid_mid)   (dx already holds the residual branch)
        _norm_backward(d_ln2, r.resid_mid, p[layout.ln2[0]], eps, dx, lg, layout.ln2)
        keep(i, "hook_resid_mid", dx, (B, n, d))
        d_attn_out = keep.branch(i, "hook_attn_out", dx, (B, n, d))
        # forward: resid_mid = resid_pre + heads W_o + b_o
        W_qkv, b_qkv, W_o, b_o = layout.attention
        d_heads = _output_backward(keep, i, (B, n, H, model.d_head), d_attn_out, r.heads,
                                   p[W_o], p.get(b_o), lg[W_o], lg.get(b_o), ws)
        d_qkv = _attend_backward(model, i, r, record, d_heads, d_head_mask, keep)
        # forward: q, k, v = split(ln1 W_qkv + b_qkv)
        d_ln1 = linear_backward(d_qkv, r.ln1, p[W_qkv], p.get(b_qkv), lg[W_qkv],
                                lg.get(b_qkv), workspace=ws)
        # forward: ln1 = norm_1(resid_pre)
        _norm_backward(d_ln1, r.resid_pre, p[layout.ln1[0]], eps, dx, lg, layout.ln1)
        keep(i, "hook_resid_pre", dx, (B, n, d))
    # forward: x = tok_emb[ids] (+ pos_emb[0..n))
    d_embed = keep.branch(None, "hook_embed", dx, (B, n, d))
    if grads[layout.embed] is not None:
        _core.embedding_backward(d_embed, record.ids.reshape(-1),
                                 vocab=model.config.vocab_size, d_table=grads[layout.embed])
    if layout.positions is not None:
        d_pos = keep.branch(None, "hook_pos_embed", dx, (B, n, d))
        if grads[layout.positions] is not None:
            grads[layout.positions][:n] += d_pos.reshape(B, n, d).sum(axis=0)
    keep(None, "head_mask", d_head_mask, (L, H))
    grads.update((name, keep.out[name]) for name in wanted)
