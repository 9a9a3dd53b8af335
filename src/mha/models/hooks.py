"""Hook points: every activation of a model's forward by its TransformerLens name, the hooks
that read or replace them, and the ActivationCache that holds the ones asked for.

A forward visits its hook points in order (``hook_embed``, then for each block
``blocks.{l}.hook_resid_pre``, ``blocks.{l}.ln1.hook_normalized``, ``blocks.{l}.attn.hook_q``,
...). At each one it asks a :class:`HookPoints` whether the point is wanted (recorded or
hooked) before computing anything extra, so a forward with nothing asked costs what it cost
without hooks; a wanted point gets its activation as a view of the forward's own buffer
(batch first, TransformerLens's shapes), runs the hooks on it, writes a replacement back into
the buffer and records a copy of it, or the buffer itself when the forward made it for the
point and does not write it again.

What a hook receives stays what it was when the hook ran (value semantics): at a point the
forward writes again later (the residual stream, a norm's input), a hooked activation is a
copy, and what the hook leaves in it is written back into the forward's buffer; at a point
the forward made for it and never writes again, the hook gets that array itself. The cost of
a copy is paid only where a hook is.

The arrays a forward records are carved from a few large blocks (:class:`memory.Arena`)
rather than allocated one by one: the C library's allocator gives large freed arrays back to
the system, so separate arrays would be faulted in page by page on every call, while a large
block is backed by huge pages where the system allows them (NumPy asks for them).
"""
from __future__ import annotations

import difflib
import re
from collections.abc import (Callable, ItemsView, Iterator, KeysView, Mapping, Sequence,
                             ValuesView)
from typing import TYPE_CHECKING, Any, Union

import numpy as np

from .memory import Arena, BlockPool, WeightsStamp

if TYPE_CHECKING:
    from .base import TransformerModel

__all__ = ["ActivationCache", "HookPoints", "get_act_name", "ON_REQUEST"]

#: fn(activation, name) -> a replacement of the same shape and dtype, or None
HookFn = Callable[[np.ndarray, str], Union[np.ndarray, None]]
#: a hook point's name, or a predicate on names
NameFilter = Union[str, Callable[[str], bool]]
#: names=None (every point), a name, a list of names, or a predicate
Names = Union[None, str, Sequence[str], Callable[[str], bool]]
#: positions or texts to keep: an int (the axis dropped), a slice, (start, stop[, step]) or
#: a list of indices
PosSlice = Union[None, int, slice, tuple, Sequence[int], np.ndarray]
#: a token as a str, an id, or ids
TokenLike = Union[str, int, Sequence[int], np.ndarray]

#: points kept only when listed by name (each head's write to the residual: n_heads times
#: the residual's memory), as TransformerLens computes them only with use_attn_result
ON_REQUEST = ("attn.hook_result",)

_BLOCK = re.compile(r"blocks\.(\d+)\.(.+)")


def _split(name: str) -> tuple[int | None, str]:
    """'blocks.3.attn.hook_z' -> (3, 'attn.hook_z'); 'hook_embed' -> (None, 'hook_embed')."""
    m = _BLOCK.fullmatch(name)
    return (int(m.group(1)), m.group(2)) if m else (None, name)


def _join(layer: int | None, point: str) -> str:
    return point if layer is None else f"blocks.{layer}.{point}"


def unknown_name(name: object, valid: Sequence[str]) -> KeyError:
    """The KeyError for a name that is no hook point of the model, naming the nearest ones."""
    near = difflib.get_close_matches(str(name), valid, n=3, cutoff=0.5)
    hint = f"; nearest: {', '.join(near)}" if near else ""
    return KeyError(f"{name!r} is not a hook point of this model{hint} "
                    f"(model.hook_names() lists all {len(valid)})")


def get_act_name(name: str, layer: int | None = None, layer_type: str | None = None) -> str:
    """Expand TransformerLens's shorthand for an activation into its hook name.

    Parameters
    ----------
    name : str
        A full name (returned as it is), or a short one: ``"pattern"``, ``"resid_pre"``,
        ``"q"``, ``"normalized"`` ..., optionally with the layer and type glued on
        (``"k6"``, ``"scale4ln1"``). ``"attn"`` means the pattern, ``"attn_logits"`` the
        scores, ``"key"``/``"query"``/``"value"`` k/q/v.
    layer : int, optional
        The block.
    layer_type : str, optional
        ``"ln1"``, ``"ln2"``, ``"attn"`` (``"a"``), ``"mlp"`` (``"m"``); inferred for the
        attention and MLP points.

    Returns
    -------
    str
        The hook name.

    Examples
    --------
    >>> get_act_name("pattern", 3)
    'blocks.3.attn.hook_pattern'
    >>> get_act_name("scale4ln1"), get_act_name("normalized")
    ('blocks.4.ln1.hook_scale', 'ln_final.hook_normalized')
    """
    if ("." in name or name.startswith("hook_")) and layer is None and layer_type is None:
        return name
    glued = re.fullmatch(r"([a-z_]+?)(\d+)([a-z]?.*)", name)
    if glued is not None:
        name, layer, layer_type = glued.group(1), int(glued.group(2)), glued.group(3) or None
    name = {"attn": "pattern", "attn_logits": "attn_scores", "key": "k", "query": "q",
            "value": "v", "mlp_pre": "pre", "mlp_mid": "mid", "mlp_post": "post"}.get(name, name)
    if name in ("k", "v", "q", "z", "rot_k", "rot_q", "result", "pattern", "attn_scores"):
        layer_type = "attn"
    elif name in ("pre", "post", "mid", "pre_linear"):
        layer_type = "mlp"
    elif layer_type is not None:
        layer_type = {"a": "attn", "m": "mlp", "b": "", "block": "", "blocks": "",
                      "attention": "attn"}.get(layer_type, layer_type)
    full = f"hook_{name}"
    if layer_type:
        full = f"{layer_type}.{full}"
    if layer is not None:
        full = f"blocks.{layer}.{full}"
    elif name in ("scale", "normalized"):
        full = f"ln_final.{full}"
    return full


def run_hook_fns(fns: Sequence[HookFn], x: np.ndarray, name: str, kind: str = "hook",
                 holds: str = "the activation has") -> None:
    """Call each ``fn(x, name)`` in turn; an array one returns replaces x's values (in place,
    so the caller's buffer carries it on). A return of another type (TypeError) or another
    shape or dtype (ValueError) is refused with the point's name and both shapes. Shared by
    the forward's hook points and the backward's (``kind``, ``holds`` word the message)."""
    for fn in fns:
        out = fn(x, name)
        if out is None or out is x:
            continue
        if not isinstance(out, np.ndarray):
            raise TypeError(f"the {kind} at {name} returned {type(out).__name__}; expected "
                            f"None or an array of shape {x.shape} and dtype {x.dtype}")
        if out.shape != x.shape or out.dtype != x.dtype:
            raise ValueError(f"the {kind} at {name} returned shape {out.shape} dtype "
                             f"{out.dtype}; {holds} shape {x.shape} dtype {x.dtype}")
        x[...] = out


def _resolve(selector: NameFilter, valid: Sequence[str]) -> list[str]:
    """The valid names a name or predicate selects (a predicate skips ON_REQUEST points)."""
    if isinstance(selector, str):
        if selector not in valid:
            raise unknown_name(selector, valid)
        return [selector]
    if callable(selector):
        return [n for n in valid if _split(n)[1] not in ON_REQUEST and selector(n)]
    raise TypeError(f"a hook point must be a name or a predicate on names, got "
                    f"{type(selector).__name__}")


class HookPoints:
    """What one forward records and changes (built by ``model.run_with_cache`` and
    ``model.run_with_hooks``; the model's methods use it for what they read).

    Parameters
    ----------
    valid : sequence of str
        The model's hook names (``model.hook_names()``).
    names : None, str, list of str or callable, optional
        The points to record: None records nothing, a predicate the names it accepts
        (not ``attn.hook_result``, which is kept only when listed by name).
    fwd_hooks : sequence of (str or callable, callable)
        ``(name_or_predicate, fn)``: ``fn(activation, name)`` runs at every selected point,
        in list order, and returns a replacement (same shape and dtype) or None; it may
        also edit the activation in place.
    blocks : BlockPool, optional
        Where the kept arrays' blocks come from (the model's, recycled); None: new ones.

    Attributes
    ----------
    cache : dict of str to ndarray
        The recorded activations, copies (batch first), after the hooks ran.

    Raises
    ------
    KeyError
        A name that is no hook point (the message names the nearest).
    """
    __slots__ = ("cache", "_keep", "_hooks", "_wanted", "_arena")

    def __init__(self, valid: Sequence[str], names: Names | Sequence[str] = None,
                 fwd_hooks: Sequence[tuple[NameFilter, HookFn]] = (),
                 blocks: BlockPool | None = None) -> None:
        self.cache: dict[str, np.ndarray] = {}
        if names is None:
            keep: list[str] = []
        elif isinstance(names, str) or callable(names):
            keep = _resolve(names, valid)
        else:
            keep = [n for name in names for n in _resolve(name, valid)]
        self._keep = set(keep)
        self._hooks: dict[str, list[HookFn]] = {}
        for selector, fn in fwd_hooks:
            if not callable(fn):
                raise TypeError(f"the hook at {selector!r} is not callable: {fn!r}")
            for name in _resolve(selector, valid):
                self._hooks.setdefault(name, []).append(fn)
        self._wanted = {_split(n) for n in self._keep | set(self._hooks)}
        self._arena = Arena(blocks)

    def __bool__(self) -> bool:
        return bool(self._wanted)

    def wants(self, layer: int | None, point: str) -> bool:
        """Whether the forward should produce the activation at this point."""
        return (layer, point) in self._wanted

    def hooked(self, layer: int | None, point: str) -> bool:
        """Whether a hook may change the activation at this point."""
        return bool(self._hooks) and _join(layer, point) in self._hooks

    def keeps(self, layer: int | None, point: str) -> bool:
        """Whether the activation at this point goes into the cache."""
        return _join(layer, point) in self._keep

    def note(self, layer: int | None, tag: str, x: np.ndarray) -> None:
        """An intermediate that has no hook name (a norm's input ``{name}.in`` and output
        ``{name}.out``), offered to an observer that keeps it (a backward's record,
        :class:`mha.models.backward.Recorder`); nothing here."""

    def attention_record(self, layer: int | None) -> Any:
        """Where a layer's attention writes q, k, v, its output and its row log-sum-exp for a
        backward (a :class:`mha.models.backward.LayerRecord`), or None: nothing here."""
        return None

    def empty(self, layer: int | None, point: str, shape: tuple[int, ...],
              dtype: np.dtype | type) -> np.ndarray:
        """A new C-contiguous array for the activation at a point, to be recorded with
        ``owned=True``: carved from the forward's blocks when the point is kept."""
        if self.keeps(layer, point):
            return self._arena.empty(shape, dtype)
        return np.empty(shape, dtype)

    def __call__(self, layer: int | None, point: str, x: np.ndarray,
                 shape: tuple[int, ...] | None = None, owned: bool = False) -> None:
        """Run the hooks at a point on x (edited in place) and record it.

        x is the forward's own buffer (or a view of it) and what the forward reads next;
        ``shape``: the batch-first shape to show it in (a view: x.reshape(shape) must not
        copy); ``owned``: x is a fresh array (or a view of one) that the forward does not
        write again, given to the hooks and kept without a copy. Otherwise the hooks get a
        copy (what they hold stays as it was when they ran), whose final values are written
        back into x, and the cache keeps that copy. Nothing happens at a point that is not
        wanted.
        """
        if (layer, point) not in self._wanted:
            return
        if shape is not None:
            view = x.view()
            view.shape = shape              # raises rather than copy
            x = view
        name = _join(layer, point)
        fns = self._hooks.get(name)
        if not owned and (fns or name in self._keep):      # the forward writes x again
            seen = self._arena.copy(x) if name in self._keep else x.copy()
            if fns:
                run_hook_fns(fns, seen, name)
                np.copyto(x, seen)          # what the hooks left goes on in the forward
        else:
            seen = x
            if fns:
                run_hook_fns(fns, x, name)
        if name in self._keep:
            self.cache[name] = seen


#: the HookPoints of a forward that records and changes nothing
NO_HOOKS = HookPoints(())


class ActivationCache(Mapping):
    """The activations one forward recorded, by hook name (a read-only mapping).

    Every array is batch first, in the model's dtype, with TransformerLens's shapes (see
    docs/models.md). ``cache["pattern", 3]`` is ``cache["blocks.3.attn.hook_pattern"]``
    (``get_act_name``'s shorthand, negative layers counting from the end); ``cache["k6"]``
    and ``cache["embed"]`` work as in TransformerLens.

    Parameters
    ----------
    activations : dict of str to ndarray
        The recorded activations.
    model : TransformerModel
        The model that ran (its hook names, norms and unembedding).

    Raises
    ------
    KeyError
        An unknown name (naming the nearest valid ones), or a valid one that the run did not
        keep.

    Examples
    --------
    >>> model = mha.models.load("minilm")
    >>> enc, cache = model.run_with_cache("The cat sat", names=lambda n: "pattern" in n)
    >>> cache["pattern", 0].shape               # (batch, head, query, key)
    (1, 12, 5, 5)
    """

    def __init__(self, activations: dict[str, np.ndarray], model: TransformerModel) -> None:
        self._data = activations
        self.model = model
        self._stamp = WeightsStamp(model)

    def _model_weights(self, what: str) -> TransformerModel:
        """The model, for a method that reads its weights: they must be the ones the cache
        was computed with."""
        if not self._stamp.matches(self.model):
            raise RuntimeError(
                f"{what} reads the model's weights, which changed since this cache was "
                f"computed (a writable_parameters() block or an array replaced in "
                f"model.layers): run the model again for a cache of the new weights")
        return self.model

    def _name(self, key: Any) -> str:
        if isinstance(key, str):
            return key if key in self._data else get_act_name(key)
        if isinstance(key, tuple) and key:
            name, layer, *rest = (*key, None) if len(key) == 1 else key
            if layer is not None and layer < 0:
                layer += self.model.n_layers
            return get_act_name(name, layer, *rest)
        raise KeyError(key)

    def __getitem__(self, key: Any) -> np.ndarray:
        name = self._name(key)
        try:
            return self._data[name]
        except KeyError:
            valid = self.model.hook_names()
            if name not in valid:
                raise unknown_name(name, valid) from None
            raise KeyError(f"{name!r} was not kept by this run (it kept {len(self._data)} "
                           f"names; ask for it with run_with_cache(names=...))") from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)

    def keys(self) -> KeysView[str]:
        """Return the names kept, in the order the forward visited them.

        Returns
        -------
        KeysView of str
            The hook names.
        """
        return self._data.keys()

    def values(self) -> ValuesView[np.ndarray]:
        """Return the activations kept, in the order of :meth:`keys`.

        Returns
        -------
        ValuesView of ndarray
            The activations.
        """
        return self._data.values()

    def items(self) -> ItemsView[str, np.ndarray]:
        """Return (name, activation) pairs, in the order of :meth:`keys`.

        Returns
        -------
        ItemsView of (str, ndarray)
            The pairs.
        """
        return self._data.items()

    def get(self, key: Any, default: Any = None) -> Any:
        """Return ``self[key]`` (a name or shorthand), or ``default`` when it was not kept.

        Parameters
        ----------
        key : str or tuple
            A hook name, or shorthand as for ``cache[key]``.
        default : object, optional
            What to return when the run did not keep it.

        Returns
        -------
        ndarray or object
            The activation, or ``default``.
        """
        return self[key] if key in self else default

    def __len__(self) -> int:
        return len(self._data)

    def __contains__(self, key: object) -> bool:
        try:
            return self._name(key) in self._data
        except (KeyError, TypeError):
            return False

    def __repr__(self) -> str:
        return f"ActivationCache with keys {list(self._data)}"

    # --- the residual stream, decomposed (TransformerLens's methods, same arguments) -----------
    def _pre_norm(self, what: str) -> None:
        if not self.model.pre_norm:
            raise NotImplementedError(
                f"{what} needs a pre-norm model (GPT-2, the LLaMA family): in a post-norm "
                f"encoder a LayerNorm sits between the blocks, so the residual stream is no sum "
                f"of the components")

    def accumulated_resid(self, layer: int | None = None, incl_mid: bool = False,
                          apply_ln: bool = False, pos_slice: PosSlice = None,
                          mlp_input: bool = False, return_labels: bool = False
                          ) -> np.ndarray | tuple[np.ndarray, list[str]]:
        """Stack the residual stream as it stands before each layer (the logit lens's input).

        Parameters
        ----------
        layer : int, optional
            Stack the inputs of layers 0 .. layer - 1 and layer's own; None, -1 or n_layers:
            every layer's input and the final residual (``"final_post"``).
        incl_mid : bool, default False
            Also each layer's ``hook_resid_mid`` (before ``layer``).
        apply_ln : bool, default False
            Apply the norm that reads the stack (:meth:`apply_ln_to_stack`); for the final
            residual the final norm is recomputed on each component, gain and bias included,
            so that ``stack @ W_U`` are logits.
        pos_slice : int, slice, (start, stop[, step]) or list of int, optional
            The positions to keep (an int drops the axis).
        mlp_input : bool, default False
            Also layer's ``hook_resid_mid`` (the MLP's input).
        return_labels : bool, default False
            Also return labels ``"{l}_pre"``, ``"{l}_mid"``, ``"final_post"``.

        Returns
        -------
        ndarray, shape (components, B, n, d_model)
            (and the labels).
        """
        L = self.model.n_layers
        layer = L if layer is None or layer == -1 else layer
        parts, labels = [], []
        for l in range(layer + 1):
            if l == L:
                parts.append(self["resid_post", L - 1])
                labels.append("final_post")
                continue
            parts.append(self["resid_pre", l])
            labels.append(f"{l}_pre")
            if (incl_mid and l < layer) or (mlp_input and l == layer):
                parts.append(self["resid_mid", l])
                labels.append(f"{l}_mid")
        stack = np.stack([_slice(c, pos_slice, -2) for c in parts])
        if apply_ln:
            stack = self.apply_ln_to_stack(stack, layer, mlp_input=mlp_input,
                                           pos_slice=pos_slice, recompute_ln=layer == L)
        return (stack, labels) if return_labels else stack

    def decompose_resid(self, layer: int | None = None, mlp_input: bool = False,
                        mode: str = "all", apply_ln: bool = False, pos_slice: PosSlice = None,
                        incl_embeds: bool = True, return_labels: bool = False
                        ) -> np.ndarray | tuple[np.ndarray, list[str]]:
        """Stack what each component wrote into the residual stream before ``layer``.

        The embeddings, then each layer's attention and MLP outputs: they sum to layer's
        input.

        Parameters
        ----------
        layer : int, optional
            Components before this layer; None, -1 or n_layers: all of them (they sum to the
            last ``hook_resid_post``).
        mlp_input : bool, default False
            Also layer's attention output (the components of the MLP's input).
        mode : {"all", "attn", "mlp"}
            Which outputs to stack.
        apply_ln : bool, default False
            Scale the stack by the norm that reads it (:meth:`apply_ln_to_stack`).
        pos_slice : int, slice, (start, stop[, step]) or list of int, optional
            The positions to keep.
        incl_embeds : bool, default True
            Include ``hook_embed`` and ``hook_pos_embed``.
        return_labels : bool, default False
            Also return labels ``"embed"``, ``"pos_embed"``, ``"{l}_attn_out"``,
            ``"{l}_mlp_out"``.

        Returns
        -------
        ndarray, shape (components, B, n, d_model)
            (and the labels).

        Raises
        ------
        NotImplementedError
            A post-norm encoder (its residual stream is no sum of components).
        """
        self._pre_norm("decompose_resid")
        L = self.model.n_layers
        layer = L if layer is None or layer == -1 else layer
        parts, labels = [], []
        if incl_embeds:
            parts.append(self["hook_embed"])
            labels.append("embed")
            if "hook_pos_embed" in self.model.hook_names():
                parts.append(self["hook_pos_embed"])
                labels.append("pos_embed")
        for l in range(layer):
            if mode != "mlp":
                parts.append(self["attn_out", l])
                labels.append(f"{l}_attn_out")
            if mode != "attn":
                parts.append(self["mlp_out", l])
                labels.append(f"{l}_mlp_out")
        if mlp_input and mode != "mlp":
            parts.append(self["attn_out", layer])
            labels.append(f"{layer}_attn_out")
        stack = np.stack([_slice(c, pos_slice, -2) for c in parts])
        if apply_ln:
            stack = self.apply_ln_to_stack(stack, layer, mlp_input=mlp_input,
                                           pos_slice=pos_slice)
        return (stack, labels) if return_labels else stack

    def _head_results(self, layer: int) -> np.ndarray:
        """(B, n, H, d_model): the layer's ``attn.hook_result``, or computed from its hook_z
        and W_o when the run did not keep it."""
        name = f"blocks.{layer}.attn.hook_result"
        if name in self._data:
            return self._data[name]
        z = self["z", layer]
        W_o = self._model_weights("stack_head_results").output_projection(layer)[0]
        H, d_head = z.shape[2], z.shape[3]
        return np.einsum("bnhk,hkd->bnhd", z, W_o.reshape(H, d_head, -1))

    def stack_head_results(self, layer: int = -1, return_labels: bool = False,
                           incl_remainder: bool = False, pos_slice: PosSlice = None,
                           apply_ln: bool = False) -> np.ndarray | tuple[np.ndarray, list[str]]:
        """Stack each head's write into the residual stream for the layers before ``layer``.

        A head's write is z_h W_o^(h), without the output bias. A family that norms the
        attention's output before the residual adds it (Gemma 2 and 3, OLMo-2: ``ln1_post``)
        has no such sum: there this raises.

        Parameters
        ----------
        layer : int, default -1
            Heads of layers 0 .. layer - 1; -1, None or n_layers: every head.
        return_labels : bool, default False
            Also return labels ``"L{l}H{h}"``.
        incl_remainder : bool, default False
            Add the rest of ``hook_resid_post`` of layer - 1 (``"remainder"``).
        pos_slice : int, slice, (start, stop[, step]) or list of int, optional
            The positions to keep.
        apply_ln : bool, default False
            Scale the stack by the norm that reads it (:meth:`apply_ln_to_stack`).

        Returns
        -------
        ndarray, shape (layer * n_heads [+ 1], B, n, d_model)
            From the cached ``attn.hook_result``, or from ``attn.hook_z`` and W_o.
        """
        L, H = self.model.n_layers, self.model.n_heads
        layer = L if layer is None or layer == -1 else layer
        if getattr(getattr(self.model, "_grad_layout", None), "post_attention", None):
            raise NotImplementedError(
                f"{type(self.model).__name__} norms each attention output (ln1_post) before "
                f"the residual adds it, so the heads' writes z_h W_o^(h) do not sum into the "
                f"residual stream; decompose_resid (hook_attn_out, after the norm) does")
        parts: list[np.ndarray] = []
        labels: list[str] = []
        for l in range(layer):
            parts.append(_slice(self._head_results(l), pos_slice, -3))
            labels.extend(f"L{l}H{h}" for h in range(H))
        if parts:
            stack = np.moveaxis(np.concatenate(parts, axis=-2), -2, 0)
        else:
            shape = _slice(self["resid_pre", 0], pos_slice, -2).shape
            stack = np.zeros((0, *shape), self["resid_pre", 0].dtype)
        if incl_remainder:
            post = _slice(self["resid_post", layer - 1], pos_slice, -2)
            stack = np.concatenate([stack, (post - stack.sum(axis=0))[None]])
            labels.append("remainder")
        if apply_ln:
            stack = self.apply_ln_to_stack(stack, layer, pos_slice=pos_slice)
        return (stack, labels) if return_labels else stack

    def apply_ln_to_stack(self, residual_stack: np.ndarray, layer: int | None = None,
                          mlp_input: bool = False, pos_slice: PosSlice = None,
                          batch_slice: PosSlice = None, has_batch_dim: bool = True,
                          recompute_ln: bool = False) -> np.ndarray:
        """Scale components of the residual stream by the norm that reads their sum.

        Each component is centred (LayerNorm; not RMSNorm) and divided by the cached scale of
        the norm at the input of ``layer`` (``ln1``; ``ln2`` with ``mlp_input``; the final
        norm for layer n_layers), as that norm treats it in the sum; the gain and bias are
        not applied (TransformerLens without weight folding). With ``recompute_ln`` at the
        final layer, the final norm, gain and bias included, is computed on each component.

        Parameters
        ----------
        residual_stack : ndarray, shape (components, B, n, d_model)
            Already sliced by ``pos_slice`` (and without the batch axis when
            ``has_batch_dim`` is False).
        layer : int, optional
            The layer whose input it is; None or -1: the final norm.
        mlp_input : bool, default False
            The norm before the MLP (ln2) rather than before the attention (ln1).
        pos_slice, batch_slice : int, slice, (start, stop[, step]) or list of int, optional
            Applied to the cached scale (batch_slice also to the stack's batch axis).
        has_batch_dim : bool, default True
            Whether the stack has its batch axis.
        recompute_ln : bool, default False
            Normalize each component with its own statistics (the logit lens).

        Returns
        -------
        ndarray
            The scaled stack.
        """
        self._pre_norm("apply_ln_to_stack")
        L = self.model.n_layers
        layer = L if layer is None or layer == -1 else layer
        if has_batch_dim and batch_slice is not None:
            residual_stack = _slice(residual_stack, batch_slice, 1)
        rms = self.model.rms_norm            # the LLaMA family: no centring
        if recompute_ln and layer == L:
            return self._model_weights("apply_ln_to_stack(recompute_ln=True)")._final_norm(
                residual_stack)
        if not rms:
            residual_stack = residual_stack - residual_stack.mean(axis=-1, keepdims=True)
        key = ("ln_final.hook_scale" if layer == L
               else f"blocks.{layer}.ln{2 if mlp_input else 1}.hook_scale")
        if key not in self.model.hook_names():
            raise ValueError(f"{type(self.model).__name__} has no norm before that block's "
                             f"{'MLP' if mlp_input else 'attention'} ({key}): only the final "
                             f"norm (layer=None) scales a stack")
        scale = _slice(self[key], pos_slice, -2)
        if batch_slice is not None:
            scale = _slice(scale, batch_slice, 0)
        if not has_batch_dim:
            scale = scale[0]
        return residual_stack / scale

    def logit_attrs(self, residual_stack: np.ndarray, tokens: TokenLike,
                    incorrect_tokens: TokenLike | None = None, pos_slice: PosSlice = None,
                    batch_slice: PosSlice = None, has_batch_dim: bool = True) -> np.ndarray:
        """Attribute logits to components of the residual stream (direct logit attribution).

        Each component, scaled by the final norm, is dotted with the unembedding direction of
        ``tokens`` (minus that of ``incorrect_tokens``).

        Parameters
        ----------
        residual_stack : ndarray, shape (components, B, n, d_model)
            E.g. :meth:`decompose_resid` or :meth:`stack_head_results`.
        tokens : str, int or array_like of int
            One token (a str must be one token), one per text (B,), or (B, n).
        incorrect_tokens : same as tokens, optional
            Attribute the logit difference ``tokens - incorrect_tokens``.
        pos_slice, batch_slice : int, slice, (start, stop[, step]) or list of int, optional
            As for :meth:`apply_ln_to_stack`.
        has_batch_dim : bool, default True
            Whether the stack has its batch axis.

        Returns
        -------
        ndarray, shape (components, B, n) (or as sliced)
            The components' shares: ``apply_ln_to_stack(stack) . W_U[:, tokens]``. The final
            norm's gain is not folded into W_U (TransformerLens without weight processing), so
            the shares of ``decompose_resid()`` sum to ``ln_final.hook_normalized . W_U[:, t]``.

        Raises
        ------
        ValueError
            ``tokens`` and ``incorrect_tokens`` of different shapes, or a str that is not one
            token.
        """
        directions = self._directions(tokens)
        if incorrect_tokens is not None:
            wrong = self._directions(incorrect_tokens)
            if wrong.shape != directions.shape:
                raise ValueError(f"tokens and incorrect_tokens must have the same shape, got "
                                 f"{directions.shape[:-1]} and {wrong.shape[:-1]}")
            directions = directions - wrong
        scaled = self.apply_ln_to_stack(residual_stack, -1, pos_slice=pos_slice,
                                        batch_slice=batch_slice, has_batch_dim=has_batch_dim)
        if (has_batch_dim and not isinstance(batch_slice, int) and scaled.ndim == 4
                and directions.ndim == 2 and directions.shape[0] == scaled.shape[1]):
            directions = directions[:, None, :]          # one token per text, every position
        return (scaled * directions).sum(axis=-1)

    def _directions(self, tokens: TokenLike) -> np.ndarray:
        """The unembedding vectors W_U[:, tokens] -> tokens' shape + (d_model,)."""
        if not self.model.causal:
            raise NotImplementedError("logit_attrs needs a causal model's LM head")
        if isinstance(tokens, str):
            ids = self.model._need_tokenizer()(tokens, add_special_tokens=False).ids
            if len(ids) != 1:
                raise ValueError(f"{tokens!r} is {len(ids)} tokens, not one")
            tokens = ids[0]
        return self._model_weights("logit_attrs")._vocab_matrix()[
            np.asarray(tokens, dtype=np.int64)]



def _slice(x: np.ndarray, which: PosSlice, axis: int) -> np.ndarray:
    """x along ``axis`` as TransformerLens's Slice takes it: None all, an int that index (the
    axis dropped), a tuple the slice(*tuple), a slice, or a list of indices."""
    if which is None:
        return x
    if isinstance(which, (int, np.integer)):
        return np.take(x, int(which), axis=axis)
    if isinstance(which, tuple):
        which = slice(*which)
    if isinstance(which, slice):
        index = [slice(None)] * x.ndim
        index[axis] = which
        return x[tuple(index)]
    return np.take(x, np.asarray(which, dtype=np.int64), axis=axis)
