"""Hook points: every activation of a model's forward by its TransformerLens name, the hooks
that read or replace them, and the ActivationCache that holds the ones asked for.

A forward visits its hook points in order (``hook_embed``, then for each block
``blocks.{l}.hook_resid_pre``, ``blocks.{l}.ln1.hook_normalized``, ``blocks.{l}.attn.hook_q``,
...). At each one it asks a :class:`HookPoints` whether the point is wanted (recorded or
hooked) before computing anything extra, so a forward with nothing asked costs what it cost
without hooks; a wanted point gets its activation as a view of the forward's own buffer
(batch first, TransformerLens's shapes), runs the hooks on it, writes a replacement back into
the buffer and records a copy.
"""
from __future__ import annotations

import difflib
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Union

import numpy as np

if TYPE_CHECKING:
    from .base import TransformerModel

__all__ = ["ActivationCache", "HookPoints", "get_act_name", "ON_REQUEST"]

#: fn(activation, name) -> a replacement of the same shape and dtype, or None
HookFn = Callable[[np.ndarray, str], Union[np.ndarray, None]]
#: a hook point's name, or a predicate on names
NameFilter = Union[str, Callable[[str], bool]]
#: names=None (every point), a name, a list of names, or a predicate
Names = Union[None, str, Sequence[str], Callable[[str], bool]]

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
        E.g. ``get_act_name("pattern", 3) == "blocks.3.attn.hook_pattern"``,
        ``get_act_name("normalized") == "ln_final.hook_normalized"``.
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

    Attributes
    ----------
    cache : dict of str to ndarray
        The recorded activations, copies (batch first), after the hooks ran.

    Raises
    ------
    KeyError
        A name that is no hook point (the message names the nearest).
    """
    __slots__ = ("cache", "_keep", "_hooks", "_wanted")

    def __init__(self, valid: Sequence[str], names: Names | Sequence[str] = None,
                 fwd_hooks: Sequence[tuple[NameFilter, HookFn]] = ()) -> None:
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

    def __bool__(self) -> bool:
        return bool(self._wanted)

    def wants(self, layer: int | None, point: str) -> bool:
        """Whether the forward should produce the activation at this point."""
        return (layer, point) in self._wanted

    def hooked(self, layer: int | None, point: str) -> bool:
        """Whether a hook may change the activation at this point."""
        return bool(self._hooks) and _join(layer, point) in self._hooks

    def __call__(self, layer: int | None, point: str, x: np.ndarray,
                 shape: tuple[int, ...] | None = None, owned: bool = False) -> None:
        """Run the hooks at a point on x (edited in place) and record it.

        x is the forward's own buffer (or a view of it) and what the forward reads next;
        ``shape``: the batch-first shape to show it in (a view: x.reshape(shape) must not
        copy); ``owned``: x is a fresh array (or a view of one) that the forward does not
        write again, kept without a copy. Nothing happens at a point that is not wanted.
        """
        if (layer, point) not in self._wanted:
            return
        if shape is not None:
            view = x.view()
            view.shape = shape              # raises rather than copy
            x = view
        name = _join(layer, point)
        for fn in self._hooks.get(name, ()):
            out = fn(x, name)
            if out is None or out is x:
                continue
            if not isinstance(out, np.ndarray):
                raise TypeError(f"the hook at {name} returned {type(out).__name__}; expected "
                                f"None or an array of shape {x.shape} and dtype {x.dtype}")
            if out.shape != x.shape or out.dtype != x.dtype:
                raise ValueError(f"the hook at {name} returned shape {out.shape} dtype "
                                 f"{out.dtype}; the activation has shape {x.shape} dtype "
                                 f"{x.dtype}")
            x[...] = out
        if name in self._keep:
            self.cache[name] = x if owned else x.copy()


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

    def __len__(self) -> int:
        return len(self._data)

    def __contains__(self, key: object) -> bool:
        try:
            return self._name(key) in self._data
        except (KeyError, TypeError):
            return False

    def __repr__(self) -> str:
        return f"ActivationCache with keys {list(self._data)}"
