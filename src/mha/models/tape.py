"""Gradients of a model, one tape per call: ``enc = model(ids, backward=True)`` keeps on
``enc.tape`` everything its backward reads (the forward's :class:`~mha.models.backward.Record`,
its own copy of the ids and masks, and which weights it ran with), and
``enc.backward(d_logits=..., d_hidden=..., wrt=...)`` walks it back.

A tape belongs to its call, never to the model: two threads running forwards and backwards
on one model get what the same calls made one after the other give, bit for bit. Each
backward borrows a packing workspace from the model's pool and carves its gradients from the
model's recycled gradient memory (:mod:`mha.models.memory`), both safe to share.
``model.backward(...)`` is the backward of the last ``model(..., backward=True)`` made *by the
calling thread* (as before, for code written against it), and ``model.loss_and_grads`` runs
on a tape of its own.

A tape checks, before walking back, that the model's weights are the ones it ran with (a
``writable_parameters()`` block, or an array replaced in ``model.layers``, makes it stale):
gradients of new weights at old activations would be silently wrong, so it raises.

Forward hooks on a tape (``model(ids, backward=True, fwd_hooks=...)``): the intervened
forward is what the backward differentiates. mha cannot see inside a NumPy hook, so it takes
what a hook changed in one of two ways (``hook_gradient``): "constant" (default): an element
the hook changed was replaced by a constant, so no gradient flows back through it to what
computed it (exact for ablations and patches from another run: torch autograd gives the same
for ``z[:, :, h] = 0`` or ``z[...] = other``); "identity": the hook added a constant (exact for
steering, ``x + v``), so the gradient flows through unchanged.
"""
from __future__ import annotations

import threading
import weakref
from typing import Any, Callable, Mapping, Sequence

import numpy as np
from numpy.typing import ArrayLike

from mha import _core

from .backward import (DecoderLayout, EncoderLayout, NoGrads, Record, Recorder,
                       decoder_backward, linear_backward, workspace_size)
from .encoder_backward import encoder_backward
from .hooks import HookFn, NameFilter, _resolve
from .memory import GradMemory, WeightsStamp, lazy_zeros

__all__ = ["Differentiable", "Tape", "last_tape", "grad_names"]

#: what ``hook_gradient`` may say of a forward hook's change (see the module's docstring)
HOOK_GRADIENTS = ("constant", "identity")

_last = threading.local()           # each thread's last tape of each model: model.backward


def _last_tapes() -> weakref.WeakKeyDictionary:
    tapes = getattr(_last, "tapes", None)
    if tapes is None:
        tapes = _last.tapes = weakref.WeakKeyDictionary()
    return tapes


def last_tape(model: Any) -> Tape | None:
    """The tape of the calling thread's last ``model(..., backward=True)`` that a
    ``model.backward`` has not used up, or None."""
    state = _last_tapes().get(model)
    return None if state is None or state.record is None else Tape._resume(model, state)


class _TapeState:
    """What a tape keeps, but the model: the thread's last tape of a model is held by a weak
    dictionary keyed by the model, whose values must not keep the model alive."""
    __slots__ = ("record", "changed", "hook_gradient", "stamp", "lock", "splices")

    def __init__(self, record: Record, changed: dict[str, np.ndarray], hook_gradient: str,
                 stamp: WeightsStamp) -> None:
        self.record: Record | None = record
        self.changed = changed
        self.hook_gradient = hook_gradient
        self.stamp = stamp
        self.lock = threading.Lock()
        self.splices: Any = None        # mha.sae.Splices: SAEs spliced into the forward


class Tape:
    """What one ``model(..., backward=True)`` keeps for its backward (``enc.tape``).

    Attributes
    ----------
    model : TransformerModel
        The model that ran.
    record : Record or None
        The forward's activations (one allocation, ``record.nbytes``); None once a backward
        without ``retain`` used it up.
    changed : dict of str to ndarray of bool
        Where the forward's hooks changed an activation, by hook name (batch first).
    hook_gradient : {"constant", "identity"}
        How the backward takes those changes (see :mod:`mha.models.tape`).
    """

    def __init__(self, model: Any, record: Record, changed: Mapping[str, np.ndarray],
                 hook_gradient: str) -> None:
        self.model = model
        self._state = _TapeState(record, dict(changed), hook_gradient, WeightsStamp(model))

    @classmethod
    def _resume(cls, model: Any, state: _TapeState) -> Tape:
        """The tape of ``state`` (shared: a backward through either uses it up)."""
        tape = cls.__new__(cls)
        tape.model, tape._state = model, state
        return tape

    @property
    def record(self) -> Record | None:
        return self._state.record

    @property
    def changed(self) -> dict[str, np.ndarray]:
        return self._state.changed

    @property
    def hook_gradient(self) -> str:
        return self._state.hook_gradient

    @property
    def nbytes(self) -> int:
        """The bytes the tape's record holds (0 once used up)."""
        record = self._state.record
        return 0 if record is None else record.nbytes

    def backward(self, d_logits: ArrayLike | None = None, d_hidden: ArrayLike | None = None,
                 wrt: Sequence[str] = (), *, retain: bool = False, parameters: bool = True,
                 bwd_hooks: Sequence[tuple[NameFilter, HookFn]] = ()) -> dict[str, np.ndarray]:
        """Back-propagate through this tape's forward (see :meth:`Differentiable.backward`)."""
        model, state = self.model, self._state
        with state.lock:                    # one backward at a time uses up a record
            record = state.record
            if record is None:
                raise RuntimeError(
                    "this forward's record was used up by an earlier backward (pass "
                    "retain=True to keep it for another, or run the forward again)")
            if not state.stamp.matches(model):
                raise RuntimeError(
                    "the model's weights changed since this forward (a writable_parameters() "
                    "block or an array replaced in model.layers): its gradients would mix "
                    "new weights with old activations; run the forward again")
            if not retain:
                state.record = None
        try:
            finish = None
            if state.splices is not None:   # the SAEs' names, and the gradient through them
                wrt, bwd_hooks, finish = state.splices.plan(wrt, bwd_hooks)
            grads = _walk_back(model, record, d_logits, d_hidden, wrt, parameters, bwd_hooks,
                               None if state.hook_gradient == "identity" else state.changed)
            if finish is not None:
                finish(grads)
            return grads
        except BaseException:
            if not retain:                  # a refused call leaves the record as it was
                with state.lock:
                    state.record = record
            raise


def _walk_back(model: Any, record: Record, d_logits: ArrayLike | None,
               d_hidden: ArrayLike | None, wrt: Sequence[str], parameters: bool,
               bwd_hooks: Sequence[tuple[NameFilter, HookFn]],
               changed: Mapping[str, np.ndarray] | None, lrp: bool = False
               ) -> dict[str, np.ndarray]:
    """The backward of one record: the arguments checked before anything is computed;
    ``lrp``: AttnLRP's rules (``mha.analysis.attn_lrp``), without parameter gradients."""
    layout = model._need_layout()
    wanted = _check_wrt(model, wrt)
    hooks = _check_hooks(model, bwd_hooks)
    arrays = _check_top(model, record, d_logits, d_hidden)
    grads = _zero_grads(model, "d_logits" in arrays) if parameters else NoGrads()
    top = _top_gradient(model, layout, record, arrays, grads)
    _run_backward(model, layout, record, top, wanted, grads, hooks, changed, lrp)
    return dict(grads)


def _run_backward(model: Any, layout: DecoderLayout | EncoderLayout, record: Record,
                  top: np.ndarray, wanted: list[str], grads: dict[str, np.ndarray],
                  hooks: Mapping[str, list[HookFn]], changed: Mapping[str, np.ndarray] | None,
                  lrp: bool = False) -> None:
    """The family's backward on a workspace borrowed from the model's pool."""
    pool = model._memory.workspaces
    ws = pool.take(model.dtype, workspace_size(model))
    try:
        walk: Any = encoder_backward if isinstance(layout, EncoderLayout) else decoder_backward
        walk(model, layout, record, top, wanted, grads, hooks, changed, ws, lrp=lrp)
    finally:
        pool.give_back(ws)


class Differentiable:
    """What a model adds for gradients: ``model(..., backward=True)`` (an Encoding with its
    :class:`Tape`), :meth:`backward` and :meth:`loss_and_grads` (causal models). A family
    sets ``_grad_layout`` (:class:`DecoderLayout` for a pre-norm decoder,
    :class:`EncoderLayout` for the BERT family); without one, ``backward=True`` raises
    NotImplementedError."""
    _grad_layout: DecoderLayout | EncoderLayout | None = None

    def __call__(self, input_ids: ArrayLike, attention_mask: ArrayLike | None = None,
                 token_type_ids: ArrayLike | None = None, *, need_weights: bool = True,
                 head_mask: ArrayLike | None = None,
                 keep_weights: Mapping[int, Any] | None = None, backward: bool = False,
                 fwd_hooks: Sequence[tuple[NameFilter, HookFn]] = (),
                 hook_gradient: str = "constant") -> Any:
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
            Keep what the backward needs on the Encoding's ``tape`` (``enc.backward(...)``;
            ``model.backward(...)`` takes this thread's last one); causal models then also
            fill the Encoding's ``logits``.
        fwd_hooks : list of (str or callable, callable), optional
            With ``backward``: hooks that change the forward, as in ``run_with_hooks``, at
            the points the backward passes (``hook_embed``, ``hook_pos_embed``,
            ``hook_resid_pre``, ``attn.hook_q``/``k``/``v``, ``attn.hook_rot_q``/``k``,
            ``attn.hook_z``, ``hook_attn_out``, ``hook_resid_mid``, ``mlp.hook_pre``,
            ``mlp.hook_pre_linear``, ``mlp.hook_post``, ``hook_mlp_out``,
            ``hook_resid_post``; an encoder's ``embed.*``, ``hook_full_embed`` and
            ``hook_normalized_resid_post``); the backward differentiates the intervened
            forward.
        hook_gradient : {"constant", "identity"}, default "constant"
            How the backward takes what a forward hook changed: "constant" (no gradient
            flows back through a changed element: ablations, patches), "identity" (the
            gradient flows through unchanged: added steering vectors).

        Returns
        -------
        Encoding
            Tokens, ids, hidden states, attentions (and logits and ``tape`` with
            ``backward``).

        Raises
        ------
        TypeError
            ``keep_weights`` with ``backward``, or ``fwd_hooks`` without it (use
            ``run_with_hooks``).
        KeyError
            A hook point the recorded forward does not offer (the message lists them).
        ValueError
            An unknown ``hook_gradient``.
        """
        if not backward:
            if fwd_hooks:
                raise TypeError("fwd_hooks on model(...) are for backward=True; without it "
                                "use model.run_with_hooks(ids, fwd_hooks=...)")
            return super().__call__(input_ids, attention_mask,  # type: ignore[misc]
                                    token_type_ids, need_weights=need_weights,
                                    head_mask=head_mask, keep_weights=keep_weights)
        if keep_weights is not None:
            raise TypeError("keep_weights is not taken with backward=True (the backward keeps "
                            "the whole forward's record)")
        enc = self._run_recorded(input_ids, attention_mask, head_mask, need_weights, True,
                                 token_type_ids, fwd_hooks=fwd_hooks,
                                 hook_gradient=hook_gradient)
        _last_tapes()[self] = enc.tape._state
        return enc

    def _run_recorded(self, input_ids: ArrayLike, attention_mask: ArrayLike | None,
                      head_mask: ArrayLike | None, need_weights: bool, logits: bool,
                      token_type_ids: ArrayLike | None = None,
                      token_embeddings: np.ndarray | None = None,
                      fwd_hooks: Sequence[tuple[NameFilter, HookFn]] = (),
                      hook_gradient: str = "constant") -> Any:
        """The forward that keeps its record -> an Encoding with its ``tape`` (with logits for
        a causal model when ``logits``). ``token_embeddings`` (B, n, d_model), when given,
        replaces the token table's rows (``hook_embed``): integrated gradients run the model
        on interpolated embeddings."""
        from .encoding import Encoding, _unbatch
        layout = self._need_layout()
        model: Any = self
        if hook_gradient not in HOOK_GRADIENTS:
            raise ValueError(f"hook_gradient must be 'constant' or 'identity', got "
                             f"{hook_gradient!r}")
        valid = _record_points(model, fwd_hooks)
        ids, mask, type_ids, single = model._id_inputs(input_ids, attention_mask,
                                                       token_type_ids)
        multipliers = model._check_head_mask(head_mask)
        B, n = ids.shape
        rows = None                             # the token table's rows, replaced (an input)
        if token_embeddings is not None:
            rows = np.asarray(token_embeddings, dtype=model.dtype).reshape(B, n, -1)
        recorder = Recorder(model, ids, mask, multipliers, type_ids, valid, fwd_hooks,
                            track_changes=hook_gradient == "constant", token_rows=rows,
                            token_point="embed.hook_embed" if isinstance(layout, EncoderLayout)
                            else "hook_embed")
        hidden, attn = model._forward(ids, mask, type_ids, need_weights, multipliers, recorder)
        record = recorder.record
        record.single = single
        tokens = None
        if model.tokenizer is not None:
            tokens = [[model.tokenizer.id_to_token(i) for i in row[m]]
                      for row, m in zip(ids, mask)]
        enc = Encoding(tokens=tokens, input_ids=ids.copy(), attention_mask=mask.copy(),
                       hidden_states=hidden, attentions=attn, token_type_ids=type_ids.copy())
        if model.has_lm_head and logits:
            enc.logits = model._logits(record.hidden).reshape(B, n, -1)
        enc.tape = Tape(model, record, recorder.changed, hook_gradient)
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
                 bwd_hooks: Sequence[tuple[NameFilter, HookFn]] = ()
                 ) -> dict[str, np.ndarray]:
        """Back-propagate through the last ``model(..., backward=True)`` of this thread.

        ``enc.backward(...)`` on the Encoding that forward returned is the same, for any
        forward (not only the last one).

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
            ``blocks.{l}.attn.hook_z``, ... every hook name but the norms' insides:
            :meth:`grad_names`), and ``head_mask`` (the
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
            activation cache's shape (its own array: what it keeps stays as it was), and
            returns a replacement (same shape and dtype) or None (it may also edit grad in
            place); what it leaves flows on to every earlier point and parameter, as
            TransformerLens's ``run_with_hooks(bwd_hooks=...)``. Several hooks at one point
            run in list order; ``wrt`` gets the gradient after them.

        Returns
        -------
        dict of str to ndarray
            The gradient of every parameter by the names of ``parameters()`` (same shapes;
            none with ``parameters=False``), then one entry per name of ``wrt``, batch first
            as the activation cache holds it ((1, ...) for one text).

        Raises
        ------
        RuntimeError
            No forward with ``backward=True`` in this thread since the last backward, or
            weights changed since that forward.
        ValueError
            Neither gradient given, or one of the wrong shape.
        KeyError
            A name of ``wrt`` or ``bwd_hooks`` that is no differentiable hook point of the
            model.
        TypeError, ValueError
            A backward hook that returns something else than None or an array of the
            gradient's shape and dtype (the error names the point; the record stays).
        """
        self._need_layout()
        tape = last_tape(self)
        if tape is None:
            raise RuntimeError("backward needs the state of a forward: run "
                               "model(ids, attention_mask, backward=True) first in this thread "
                               "(each backward uses it up unless retain=True)")
        grads = tape.backward(d_logits, d_hidden, wrt, retain=retain, parameters=parameters,
                              bwd_hooks=bwd_hooks)
        if not retain:
            _last_tapes().pop(self, None)
        return grads

    def grad_names(self) -> list[str]:
        """List the names ``backward``'s ``wrt`` and ``bwd_hooks`` take.

        Returns
        -------
        list of str
            The hook names of :meth:`hook_names`, in forward order, but the norms'
            ``hook_scale`` and ``hook_normalized``, then ``head_mask``.
        """
        return grad_names(self)

    def loss_and_grads(self, ids: ArrayLike, labels: ArrayLike | None = None,
                       attention_mask: ArrayLike | None = None, *, wrt: Sequence[str] = (),
                       head_mask: ArrayLike | None = None,
                       bwd_hooks: Sequence[tuple[NameFilter, HookFn]] = (),
                       fwd_hooks: Sequence[tuple[NameFilter, HookFn]] = (),
                       hook_gradient: str = "constant"
                       ) -> tuple[float, dict[str, np.ndarray]]:
        """The next-token cross-entropy of a causal LM and its gradients.

        Logits at position i are scored against labels[i + 1] (shifted as transformers'
        ``*ForCausalLM`` does), mean over the labels that are not -100, on the C core's
        chunked cross-entropy (the (tokens, vocab) logits are never held whole). The call
        runs on a tape of its own (the thread's last ``model(..., backward=True)`` stays).

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
        fwd_hooks : sequence of (str or callable, callable), optional
            Hooks that change the forward, as in ``model(ids, backward=True, fwd_hooks=...)``.
        hook_gradient : {"constant", "identity"}, default "constant"
            How the backward takes what a forward hook changed.

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
        enc = self._run_recorded(ids_2d, attention_mask, head_mask, False, False,
                                 fwd_hooks=fwd_hooks, hook_gradient=hook_gradient)
        tape: Tape = enc.tape
        record = tape.record
        assert record is not None
        grads = _zero_grads(model, True)
        top = np.zeros_like(record.hidden)
        # forward: loss = cross_entropy(hidden W_vocab^T, labels shifted by one)
        if model.config.final_softcap is None:
            loss, _, _ = _core.cross_entropy(record.hidden, model._vocab_matrix(),
                                             shifted.reshape(-1), trans_w=True, d_hidden=top,
                                             d_w=grads[_vocab_name(model, layout)])
        else:
            loss = _capped_cross_entropy(model, record.hidden, shifted.reshape(-1), top,
                                         grads[_vocab_name(model, layout)])
        _run_backward(model, layout, record, top, wanted, grads, hooks,
                      None if hook_gradient == "identity" else tape.changed)
        return float(loss), grads


def _record_points(model: Any, fwd_hooks: Sequence[tuple[NameFilter, HookFn]]) -> list[str]:
    """The hook points a recorded forward offers its hooks, in forward order: those the backward passes (:func:`grad_names`) but the fused
    attention kernel's insides (scores, pattern, per-head results). A hook named at a point
    that is not among them raises a KeyError that says why (an unknown name gets the usual
    one from HookPoints)."""
    inputs = ("head_mask", *getattr(model, "_input_gradients", ()))
    valid = [name for name in grad_names(model)
             if name not in inputs and not name.endswith(KERNEL_INSIDES)]
    for selector, _ in fwd_hooks:
        if isinstance(selector, str) and selector not in valid and \
                selector in model.hook_names():
            raise KeyError(
                f"{selector!r}: a backward=True forward takes hooks only where its backward "
                f"passes, not at the attention's scores, pattern or per-head results (the "
                f"fused kernel's insides) nor a norm's scale or normalized input; hook the "
                f"q, k, v or z around them, or use run_with_hooks")
    return valid


#: the points inside the fused attention kernel (a recorded forward offers no hook there)
KERNEL_INSIDES = ("hook_attn_scores", "hook_pattern", "hook_result")


#: the hook points no gradient is taken at: a norm's insides (its scale and normalized input)
NOT_DIFFERENTIATED = ("hook_scale", "hook_normalized")


def grad_names(model: Any) -> list[str]:
    """The names ``wrt=`` and ``bwd_hooks=`` take, in forward order: the model's hook names
    (declared once, by its ``_hook_layout``) but the norms' ``hook_scale`` and
    ``hook_normalized``, then the model's inputs that have a gradient (an image model's
    ``pixel_values``), then ``head_mask``."""
    return ([name for name in model.hook_names()
             if name.rsplit(".", 1)[-1] not in NOT_DIFFERENTIATED]
            + list(getattr(model, "_input_gradients", ())) + ["head_mask"])


def _grad_points(model: Any) -> tuple[set[str], str]:
    """Every name ``wrt`` may take for the model, and how the error of an unknown one lists
    them."""
    names = grad_names(model)
    outside = [n for n in names if not n.startswith("blocks.")]
    block = [n[len("blocks.0."):] for n in names if n.startswith("blocks.0.")]
    return set(names), f"one of {outside} or blocks.{{l}}.<one of {block}>"


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
    if "lm_head" in model._stored() or not isinstance(layout, DecoderLayout):
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
        d_logits = arrays["d_logits"]
        cap = model.config.final_softcap
        if cap is not None:         # forward: logits = c tanh(z / c): dz = d_logits (1 - t^2)
            slope = model._logits(record.hidden)
            slope /= model.dtype(cap)
            np.square(slope, out=slope)
            np.subtract(1, slope, out=slope)
            d_logits = d_logits * slope
        # forward: z = hidden W_vocab^T
        linear_backward(d_logits, record.hidden, model._vocab_matrix(), None,
                        grads[_vocab_name(model, layout)], None, da=top, trans_b=True)
    return top


def _capped_cross_entropy(model: Any, hidden: np.ndarray, labels: np.ndarray,
                          d_hidden: np.ndarray, d_w: np.ndarray | None) -> float:
    """The mean next-token cross-entropy of soft-capped logits c tanh(hidden W^T / c)
    (Gemma 2's final_logit_softcapping) over the labels that are not -100, as many rows of
    logits at a time as hold about 4M values (16 rows of Gemma 2's 256,000 words); its gradient added into d_hidden (rows, d) and d_w (vocab, d) (None:
    not computed). The C core's fused cross-entropy has no cap; this one runs on NumPy's
    softmax with mha's products."""
    cap = model.dtype(model.config.final_softcap)
    w = model._vocab_matrix()
    valid = labels != -100
    count = max(int(valid.sum()), 1)
    chunk = max(1, (1 << 22) // len(w))
    total = 0.0
    for start in range(0, len(hidden), chunk):
        rows = slice(start, start + chunk)
        logits = model._logits(hidden[rows])                    # (r, vocab), capped
        top = logits.max(axis=1, keepdims=True)
        p = np.exp(logits - top)
        sums = p.sum(axis=1, keepdims=True)
        ok = valid[rows]
        at = np.flatnonzero(ok)
        total += float(np.sum(np.log(sums[at, 0]) + top[at, 0]
                              - logits[at, labels[rows][at]]))
        p /= sums
        p[at, labels[rows][at]] -= 1
        p[~ok] = 0
        logits /= cap                                           # tanh(z / c), in place
        p *= (1 - logits * logits) / count                      # d loss / d(hidden W^T)
        d_hidden[rows] += _core.matmul(p, w)
        if d_w is not None:
            d_w += _core.matmul(p, hidden[rows], trans_a=True)
    return total / count


def _zero_grads(model: Any, lm_head: bool) -> dict[str, np.ndarray]:
    """A zero array per parameter, by name, each gradient added into its own.

    Every gradient but the embedding tables' is carved from one block of the model's
    :class:`~mha.models.memory.GradMemory`, which a call takes back from the last one once
    that call's gradients are all gone, and filled with zeros here, on one thread: a recycled
    block's pages are resident, so a training loop takes no page faults for its gradients
    whatever malloc did with the memory freed in between (MiniLM's backward after a torch
    step in the same process took 11,000 faults a step for them), and the first call's
    faults are taken by one thread rather than by the products' several at once, which cost
    more than the products.

    An embedding table's gradient gets only the batch's rows: it has pages of its own that
    the system zeroes as they are first written (:func:`~mha.models.memory.lazy_zeros`), so
    the rest costs nothing (MiniLM's 47 MB word table). ``lm_head``: the LM head gets a
    gradient (a tied token table, then written whole, goes in the block)."""
    layout = model._grad_layout
    if isinstance(layout, DecoderLayout):
        tables = {layout.embed, layout.positions}
    else:
        tables = {"word_embeddings", "position_embeddings", "token_type_embeddings"}
    if lm_head:
        tables.discard(_vocab_name(model, layout))
    if model._format is not None:
        raise TypeError(f"parameter gradients (loss_and_grads, backward with parameters=True, "
                        f"training) need a float32 or float64 model; this one keeps its "
                        f"weights in {model._format}. Gradients with respect to activations "
                        f"need none: enc.backward(wrt=..., parameters=False)")
    shapes = {name: (tuple(a.shape), np.dtype(model.dtype))
              for name, a in model._stored().items()}
    spans, size = {}, 0
    for name, (shape, dtype) in shapes.items():
        if name not in tables:
            spans[name] = size
            size += -(-int(np.prod(shape)) * dtype.itemsize // GradMemory.ALIGN) * GradMemory.ALIGN
    block = model._memory.gradients.take(tuple((k, shapes[k][0], shapes[k][1].str) for k in spans), size)
    block.fill(0)
    return {name: lazy_zeros(shape, dtype) if name in tables else
            block[spans[name]:spans[name] + int(np.prod(shape)) * dtype.itemsize].view(
                dtype).reshape(shape)
            for name, (shape, dtype) in shapes.items()}
