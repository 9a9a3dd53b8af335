"""Adam and AdamW, gradient clipping and learning-rate schedules, on dicts of NumPy arrays.

Each follows PyTorch's arithmetic step for step (``torch.optim.Adam`` / ``AdamW``,
``torch.nn.utils.clip_grad_norm_``) and transformers' schedules
(``get_cosine_schedule_with_warmup``, ``get_linear_schedule_with_warmup``,
``get_constant_schedule_with_warmup``), so that a run here and the same run in torch give the
same weights up to rounding.
"""
from __future__ import annotations

import math
from typing import Callable, Mapping

import numpy as np

from .. import _core
from ..reference.block import adam_step as reference_step

__all__ = ["Adam", "AdamW", "clip_grad_norm", "global_norm", "lr_schedule", "SCHEDULES"]


class Adam:
    """Optimise with Adam (Kingma & Ba), step for step the arithmetic of ``torch.optim.Adam``.

    Each step computes ``m = b1 m + (1 - b1) g``, ``v = b2 v + (1 - b2) g^2`` and
    ``p -= lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)``. The weight decay is an
    L2 term added to the gradient (``g += weight_decay * p``, as ``torch.optim.Adam``), or,
    with ``decoupled_weight_decay=True``, a shrinking of the weights before the step
    (``p *= 1 - lr * weight_decay``, as ``torch.optim.AdamW``; see :class:`AdamW`).
    Each parameter's step is one pass of the C core over it and its gradient and moments,
    on mha's threads, for float32 and float64 arrays that are C-contiguous (other float
    arrays take the same steps in NumPy). A step checks every array before it writes one, so
    a step that raises (e.g. on a read-only weight) changes nothing.

    Parameters
    ----------
    params : dict of str to ndarray
        The arrays to update in place (e.g. ``model.params``; a TransformerModel's
        ``parameters()``, updated inside ``model.writable_parameters()``).
    lr : float, default 1e-3
        The learning rate (``lr`` may be changed between steps, as a schedule does).
    betas : tuple of float, default (0.9, 0.999)
        The decay rates of the first and second moments.
    eps : float, default 1e-8
        Added to the denominator.
    weight_decay : float, default 0.0
        The L2 coefficient (or the decoupled decay rate).
    decoupled_weight_decay : bool, default False
        Decay the weights directly (AdamW) instead of adding to the gradient.

    Attributes
    ----------
    m, v : dict of str to ndarray
        The first and second moments, by parameter name.
    t : int
        The number of steps taken.

    Raises
    ------
    ValueError
        A learning rate that is not positive.

    References
    ----------
    D. P. Kingma and J. Ba, "Adam: A Method for Stochastic Optimization", ICLR 2015,
    https://arxiv.org/abs/1412.6980.

    Examples
    --------
    >>> p = {"w": np.array([1.0, -1.0])}
    >>> opt = Adam(p, lr=0.1)
    >>> opt.step({"w": np.array([0.5, -2.0])})
    >>> p["w"]                                     # each moved by lr against its gradient's sign
    array([ 0.9, -0.9])
    """

    def __init__(self, params: Mapping[str, np.ndarray], lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, *, decoupled_weight_decay: bool = False) -> None:
        if lr <= 0:
            raise ValueError(f"lr must be positive, got {lr}")
        self.params = dict(params)
        self.lr, self.betas = float(lr), (float(betas[0]), float(betas[1]))
        self.eps, self.weight_decay = float(eps), float(weight_decay)
        self.decoupled_weight_decay = bool(decoupled_weight_decay)
        self.m = {name: np.zeros_like(p) for name, p in self.params.items()}
        self.v = {name: np.zeros_like(p) for name, p in self.params.items()}
        self.t = 0

    def step(self, grads: Mapping[str, np.ndarray]) -> None:
        """Update the parameters in place by one step, or raise having changed nothing.

        Every array is checked before the first write: a step that raises leaves the
        parameters, ``m``, ``v`` and ``t`` as they were.

        Parameters
        ----------
        grads : dict of str to ndarray
            The gradients, with at least the keys of ``params``, each of its parameter's
            shape (no broadcasting) and of a real dtype, float, integer or bool (converted to
            the parameter's, e.g. float64 to float32); not modified.

        Raises
        ------
        ValueError
            A parameter or moment that is read-only (a TransformerModel's dense weights
            outside ``with model.writable_parameters():``), a gradient of another shape, or
            arrays of one parameter's step overlapping in memory.
        TypeError
            A parameter or moment that is not a float ndarray of the parameter's shape and
            dtype, a gradient of another kind (e.g. complex), or settings (``lr``, ``betas``,
            ``eps``, ``weight_decay``) that are not numbers.
        KeyError
            A parameter without a gradient.
        """
        lr, eps, weight_decay = _number(self.lr, "lr"), _number(self.eps, "eps"), _number(
            self.weight_decay, "weight_decay")
        betas = (_number(self.betas[0], "betas[0]"), _number(self.betas[1], "betas[1]"))
        plan = [self._checked(name, p, grads) for name, p in self.params.items()]
        self.t += 1
        for p, g, m, v, core in plan:
            if core:
                _core.adam_step(p, g, m, v, lr=lr, betas=betas, eps=eps,
                                weight_decay=weight_decay,
                                decoupled=self.decoupled_weight_decay, step=self.t)
            else:
                reference_step(p, g, m, v, lr, betas, eps, weight_decay,
                               self.decoupled_weight_decay, self.t)

    def _checked(self, name: str, p: np.ndarray, grads: Mapping[str, np.ndarray]
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, bool]:
        """Parameter ``name``'s step, checked: (p, its gradient in p's dtype, m, v, whether
        the C core takes them), or the error that step would raise before writing."""
        where = f"{type(self).__name__}.step"
        m, v = self.m.get(name), self.v.get(name)
        for what, a in (("parameter", p), ("m of", m), ("v of", v)):
            if not (isinstance(a, np.ndarray) and a.dtype.kind == "f"):
                kind = a.dtype if isinstance(a, np.ndarray) else type(a).__name__
                raise TypeError(f"{where}: {what} {name!r} is not a float ndarray ({kind}); "
                                f"nothing was updated")
            if a is not p and (a.shape != p.shape or a.dtype != p.dtype):
                raise TypeError(f"{where}: {what} {name!r} is {a.dtype} {a.shape}, its "
                                f"parameter {p.dtype} {p.shape}; nothing was updated")
            if not a.flags.writeable:
                raise ValueError(
                    f"{where}: {what} {name!r} is read-only, so nothing was updated. A "
                    f"TransformerModel's weights are writable inside `with "
                    f"model.writable_parameters():`: take the step there (or train with "
                    f"mha.train.fit, which does)")
        assert m is not None and v is not None
        if name not in grads:
            raise KeyError(f"{where}: grads has no gradient for {name!r}; nothing was updated")
        g = np.asarray(grads[name])
        if g.shape != p.shape:
            raise ValueError(f"{where}: the gradient of {name!r} has shape {g.shape}, its "
                             f"parameter {p.shape}; nothing was updated")
        if g.dtype.kind not in "biuf":
            raise TypeError(f"{where}: the gradient of {name!r} is {g.dtype}, not a real "
                            f"number dtype; nothing was updated")
        core = _core_can_step(p, m, v)
        g = np.ascontiguousarray(g, dtype=p.dtype) if core else np.asarray(g, dtype=p.dtype)
        arrays = {"the parameter": p, "m": m, "v": v, "the gradient": g}
        for i, (out, a) in enumerate(list(arrays.items())[:3]):
            for other, b in list(arrays.items())[i + 1:]:
                if a.size and b.size and np.may_share_memory(a, b):
                    raise ValueError(f"{where}: for {name!r}, {out} overlaps {other} in "
                                     f"memory (the step writes one while it reads the "
                                     f"other); nothing was updated")
        return p, g, m, v, core


def _number(value: object, name: str) -> float:
    """``float(value)``, or a TypeError naming the setting."""
    try:
        return float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise TypeError(f"the optimizer's {name} must be a number, got {value!r}; nothing "
                        f"was updated") from None


def _core_can_step(*arrays: np.ndarray) -> bool:
    """Whether the C core's Adam step takes these arrays: float32 or float64 ndarrays,
    C-contiguous, aligned, writable, in native byte order."""
    return all(isinstance(a, np.ndarray) and a.dtype in (np.float32, np.float64)
               and a.dtype.isnative and a.flags.c_contiguous and a.flags.aligned
               and a.flags.writeable for a in arrays)


class AdamW(Adam):
    """Optimise with AdamW (Loshchilov & Hutter), Adam with decoupled weight decay.

    Step for step the arithmetic of ``torch.optim.AdamW``: each step first shrinks every
    weight, ``p *= 1 - lr * weight_decay``, then takes the Adam step of :class:`Adam` on the
    gradient alone. Every parameter is decayed (as ``torch.optim.AdamW(model.parameters())``).

    Parameters
    ----------
    params : dict of str to ndarray
        The arrays to update in place.
    lr : float, default 1e-3
        The learning rate.
    betas : tuple of float, default (0.9, 0.999)
        The decay rates of the first and second moments.
    eps : float, default 1e-8
        Added to the denominator.
    weight_decay : float, default 0.01
        The decay rate (torch's default).

    Raises
    ------
    ValueError
        A learning rate that is not positive.

    References
    ----------
    I. Loshchilov and F. Hutter, "Decoupled Weight Decay Regularization", ICLR 2019,
    https://arxiv.org/abs/1711.05101.

    Examples
    --------
    >>> p = {"w": np.array([1.0, -1.0])}
    >>> opt = AdamW(p, lr=0.1, weight_decay=0.5)
    >>> opt.step({"w": np.array([0.5, -2.0])})
    >>> p["w"]                                     # 0.95 after the decay, then 0.1 against g
    array([ 0.85, -0.85])
    """

    def __init__(self, params: Mapping[str, np.ndarray], lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.01) -> None:
        super().__init__(params, lr, betas, eps, weight_decay, decoupled_weight_decay=True)


def global_norm(grads: Mapping[str, np.ndarray], names: Mapping[str, object] | None = None
                ) -> float:
    """Compute the 2-norm of every gradient taken together.

    Parameters
    ----------
    grads : dict of str to ndarray
        The gradients.
    names : mapping, optional
        Only these keys of ``grads`` (e.g. the parameters, leaving out ``head_mask``).

    Returns
    -------
    float
        ``sqrt(sum of g^2 over every entry)``, in float64.

    Examples
    --------
    >>> global_norm({"a": np.array([3.0]), "b": np.array([[4.0]])})
    5.0
    """
    keys = grads.keys() if names is None else names.keys()
    total = 0.0
    for name in keys:
        g = np.asarray(grads[name]).reshape(-1)
        total += float(np.dot(g, g))
    return math.sqrt(total)


def clip_grad_norm(grads: Mapping[str, np.ndarray], max_norm: float,
                   names: Mapping[str, object] | None = None) -> float:
    """Scale the gradients in place so that their global 2-norm is at most ``max_norm``.

    As ``torch.nn.utils.clip_grad_norm_``: every gradient is multiplied by
    ``min(1, max_norm / (norm + 1e-6))``.

    Parameters
    ----------
    grads : dict of str to ndarray
        The gradients (changed in place).
    max_norm : float
        The largest norm let through.
    names : mapping, optional
        Only these keys of ``grads`` are counted and scaled.

    Returns
    -------
    float
        The norm before clipping.

    Examples
    --------
    >>> g = {"a": np.array([3.0, 4.0])}
    >>> clip_grad_norm(g, 1.0), g["a"].round(6)
    (5.0, array([0.6, 0.8]))
    """
    norm = global_norm(grads, names)
    factor = min(1.0, float(max_norm) / (norm + 1e-6))
    if factor < 1.0:
        for name in (grads.keys() if names is None else names.keys()):
            grads[name] *= factor
    return norm


#: the schedules of :func:`lr_schedule`
SCHEDULES = ("cosine", "linear", "constant")


def lr_schedule(kind: str, warmup_steps: int, total_steps: int) -> Callable[[int], float]:
    """Return the learning-rate factor of each step: a linear warm-up, then a decay.

    For step s (0-based, the factor of the s-th update) and W = ``warmup_steps``,
    T = ``total_steps``: s / W while s < W, then with p = (s - W) / max(1, T - W)

    - "cosine": max(0, (1 + cos(pi p)) / 2) (transformers' ``get_cosine_schedule_with_warmup``)
    - "linear": max(0, 1 - p) (``get_linear_schedule_with_warmup``)
    - "constant": 1 (``get_constant_schedule_with_warmup``).

    The learning rate of step s is ``lr * factor(s)``, as ``torch.optim.lr_scheduler.LambdaLR``
    with this function gives it.

    Parameters
    ----------
    kind : {"cosine", "linear", "constant"}
        The decay after the warm-up.
    warmup_steps : int
        W (0: no warm-up).
    total_steps : int
        T, the steps of the run.

    Returns
    -------
    callable
        The factor of a step, ``factor(step) -> float``.

    Raises
    ------
    ValueError
        An unknown kind, or negative steps.

    Examples
    --------
    >>> f = lr_schedule("cosine", 2, 10)
    >>> [round(f(s), 3) for s in (0, 1, 2, 6, 10)]
    [0.0, 0.5, 1.0, 0.5, 0.0]
    """
    if kind not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {kind!r}")
    warmup, total = int(warmup_steps), int(total_steps)
    if warmup < 0 or total < 0:
        raise ValueError(f"warmup_steps and total_steps must be >= 0, got {warmup}, {total}")

    def factor(step: int) -> float:
        if step < warmup:
            return float(step) / float(max(1, warmup))
        if kind == "constant":
            return 1.0
        progress = float(step - warmup) / float(max(1, total - warmup))
        if kind == "linear":
            return max(0.0, 1.0 - progress)
        return max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))
    return factor
