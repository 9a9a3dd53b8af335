"""The training loop: :func:`fit` for the period-3 model and for any model of mha.models.

Every update, whatever the model, is one :class:`_Update`: check that the loss and the
gradients are finite (else stop with the step and the last finite loss), measure the
gradient's global norm and clip it, set the learning rate of the step from the schedule, and
take the optimizer's step (inside ``model.writable_parameters()`` for a TransformerModel,
whose dense weights are otherwise read-only packed copies). The schedule scales the
optimizer's ``lr``, its base rate, for each step and puts the base rate back when the fit ends
(also when it raises), so that a second fit with the same optimizer starts from it again.

A TransformerModel trains on batches of token ids: a causal LM on the next-token
cross-entropy (``model.loss_and_grads``), any model on a loss of its last hidden state
(``loss(hidden, batch) -> (value, d_hidden)``, :mod:`mha.train.losses`), back-propagated by
``model.backward(d_hidden=...)``.
"""
from __future__ import annotations

import contextlib
import itertools
import math
import time
from typing import Any, Callable, ContextManager, Iterator, Mapping, Sequence

import numpy as np
from numpy.typing import ArrayLike

from .optim import AdamW, clip_grad_norm, global_norm, lr_schedule

__all__ = ["fit"]

Batch = Mapping[str, Any]
Loss = Callable[[np.ndarray, Batch], "tuple[float, np.ndarray]"]


def _progress(iterable: range, enabled: bool, desc: str | None) -> Any:
    """tqdm.auto's bar (the notebook widget where ipywidgets is installed, text otherwise), as
    the library's other long runs, or the bare iterable.

    Typed Any: tqdm ships no annotations, and fit calls the bar's set_postfix and close."""
    if not enabled:
        return iterable
    from tqdm.auto import tqdm
    return tqdm(iterable, desc=desc, leave=True)


class _Update:
    """One optimizer update from a loss and its gradients (see the module's docstring).

    ``optimizer.lr`` when made is the base rate; each update sets ``optimizer.lr`` to the
    step's scheduled rate, and :meth:`restore_lr` (which a fit calls in ``finally``) sets it
    back to the base rate."""

    def __init__(self, optimizer: Any, factor: Callable[[int], float],
                 max_grad_norm: float | None,
                 writable: Callable[[], ContextManager[Any]] = contextlib.nullcontext) -> None:
        self.optimizer, self.factor, self.max_grad_norm = optimizer, factor, max_grad_norm
        self.saved_lr = optimizer.lr
        self.base_lr = float(optimizer.lr)
        self.writable = writable
        self.last_finite: tuple[int, float] | None = None

    def __call__(self, step: int, loss: float, grads: dict[str, np.ndarray]
                 ) -> tuple[float, float]:
        """Update for step ``step`` (0-based) -> (learning rate, gradient norm before clipping).

        Raises FloatingPointError, the weights untouched, on a loss or gradient that is not
        finite."""
        names = self.optimizer.params
        if self.max_grad_norm is None:
            norm = global_norm(grads, names)
        else:
            norm = clip_grad_norm(grads, self.max_grad_norm, names)
        if not (math.isfinite(loss) and math.isfinite(norm)):
            what = f"the loss is {loss}" if not math.isfinite(loss) else (
                f"the loss is {loss} but the gradient norm is {norm}")
            last = ("no step had a finite loss" if self.last_finite is None else
                    f"the last finite loss was {self.last_finite[1]:.6g} at step "
                    f"{self.last_finite[0]}")
            raise FloatingPointError(f"training stopped at step {step + 1}: {what}; {last} "
                                     f"(the weights are those before step {step + 1})")
        self.last_finite = (step + 1, float(loss))
        lr = self.base_lr * self.factor(step)
        self.optimizer.lr = lr
        with self.writable():
            self.optimizer.step(grads)
        return lr, norm

    def restore_lr(self) -> None:
        """Give the optimizer back its base rate, the ``lr`` it had before the first update."""
        self.optimizer.lr = self.saved_lr


#: fit's arguments that set up the AdamW it builds, refused next to ``optimizer=``
_OPTIMIZER_SETTINGS = ("lr", "weight_decay", "betas", "eps")


def fit(model: Any, data: Any, targets: ArrayLike | None = None,
        test_tokens: ArrayLike | None = None, test_targets: ArrayLike | None = None, *,
        steps: int | None = None, epochs: int | None = None, lr: float | None = None,
        batch_size: int | None = None, optimizer: Any = None,
        weight_decay: float | None = None, betas: tuple[float, float] | None = None,
        eps: float | None = None, schedule: str | None = None, warmup_steps: int = 0,
        max_grad_norm: float | None = None, loss: Loss | None = None,
        callback: Callable[[Any, int], Mapping[str, Any] | None] | None = None,
        eval_every: int | None = None, seed: int | None = None, progress: bool = True,
        desc: str | None = None) -> dict[str, Any]:
    """Train a model with AdamW, gradient clipping and a warm-up/decay schedule.

    Two kinds of model, one update (:class:`mha.train.AdamW` arithmetic, torch's clipping,
    transformers' schedules, in the model's dtype, float32 or float64):

    - a model of :mod:`mha.models` (loaded, or built by :func:`mha.models.from_config`):
      ``fit(model, data, steps=..., ...)``, one update per batch of token ids;
    - the period-3 model (:class:`mha.train.SimpleAttentionModel`, or anything with
      ``params``, ``loss_and_grads``, ``loss`` and ``accuracy``):
      ``fit(model, tokens, targets, test_tokens, test_targets, epochs=...)``.

    Defaults that differ between the two (left None):

    ============== ============================ ===============================
    argument       a TransformerModel           the period-3 model
    ============== ============================ ===============================
    lr             1e-3                         0.005
    epochs         1                            100
    weight_decay   0.01 (torch's AdamW)         0 (Adam)
    schedule       "cosine"                     "constant"
    max_grad_norm  1.0                          None (no clipping)
    eval_every     every 10% of the steps       every epoch
    ============== ============================ ===============================

    Parameters
    ----------
    model : TransformerModel or SimpleAttentionModel
        Trained in place.
    data : array_like, sequence of batches, or callable
        A TransformerModel's batches: an int array (N, n) of token ids (mini-batches of
        ``batch_size`` rows, reshuffled every epoch), a list of batches (taken in turn), or
        a function ``data(step) -> batch`` (``steps`` then required). A batch is an int
        array (B, n) of ids, or a dict with ``"input_ids"`` and optionally
        ``"attention_mask"``, ``"labels"`` (next-token targets, -100 ignored),
        ``"token_type_ids"`` and whatever ``loss`` reads. The period-3 model: its token ids
        (N, n).
    targets : array_like of int, shape (N, n), optional
        The period-3 model's next tokens.
    test_tokens, test_targets : array_like of int, shape (N_test, n), optional
        The period-3 model's test set, whose accuracy is measured every ``eval_every``
        epochs.
    steps : int, optional
        The number of updates (a TransformerModel); default ``epochs`` passes over ``data``.
    epochs : int, optional
        Passes over the data.
    lr : float, optional
        The peak learning rate of the AdamW that fit builds (not with ``optimizer``).
    batch_size : int, optional
        Rows per update when ``data`` is one array; default all of them.
    optimizer : object, optional
        Anything with ``params``, ``lr`` and ``step(grads)`` (e.g. :class:`mha.train.Adam`),
        whose own settings apply: ``lr``, ``weight_decay``, ``betas`` and ``eps`` are then
        refused. Its ``lr`` is the peak rate: each step sets ``optimizer.lr`` to the
        scheduled rate, and the fit sets it back when it ends (also on an error), so that
        fits in a row start from the same rate. Default ``AdamW(parameters, lr, betas, eps,
        weight_decay)``.
    weight_decay : float, optional
        AdamW's decoupled decay, applied to every parameter (not with ``optimizer``).
    betas : tuple of float, optional
        The moments' decay rates; default (0.9, 0.999) (not with ``optimizer``).
    eps : float, optional
        AdamW's epsilon; default 1e-8 (not with ``optimizer``).
    schedule : {"cosine", "linear", "constant"}, optional
        The learning rate after the warm-up: step s (0-based) uses ``lr * factor(s)`` of
        :func:`mha.train.lr_schedule` (the period-3 model steps once per mini-batch).
    warmup_steps : int, default 0
        Steps of linear warm-up (``lr * s / warmup_steps``; step 0 then has rate 0, as
        transformers' schedules).
    max_grad_norm : float, optional
        Clip the global gradient norm to this (``torch.nn.utils.clip_grad_norm_``).
    loss : callable, optional
        ``loss(hidden, batch) -> (value, d_hidden)`` on the last hidden state (B, n, d_model)
        (:func:`mha.train.cosine_similarity_loss`); default the next-token cross-entropy of a
        causal LM (an encoder needs one).
    callback : callable, optional
        ``callback(model, step) -> dict or None``, called before the first step and after
        every ``eval_every`` steps and the last (a TransformerModel): measurements to keep in
        ``history["eval"]``.
    eval_every : int, optional
        Steps between callbacks (a TransformerModel), epochs between test measurements (the
        period-3 model).
    seed : int, optional
        Seeds the shuffling of mini-batches.
    progress : bool, default True
        Show a tqdm bar with the loss.
    desc : str, optional
        The bar's label.

    Returns
    -------
    dict
        A TransformerModel: ``loss`` (steps,) the loss of each step's batch before its update;
        ``lr`` (steps,) the rate each update used; ``grad_norm`` (steps,) the gradient norm
        before clipping; ``eval``: ``{"step": (k,), name: (k, ...)}`` stacked from the
        callback's dicts; ``seconds``. The period-3 model: ``loss`` (epochs,) the mean
        training loss of each epoch; ``test_epochs``, ``test_accuracy``; ``final_loss``,
        ``final_test_accuracy``; ``seconds``.

    Raises
    ------
    FloatingPointError
        A loss (or gradient norm) that is not finite: the message gives the step and the last
        finite loss; the weights are those before that step, and the error's ``history``
        attribute the history so far (a TransformerModel; NaN from that step on).
    TypeError
        ``lr``, ``weight_decay``, ``betas`` or ``eps`` given together with ``optimizer``
        (they would be ignored): the message names each one given.
    ValueError
        Training arrays of the wrong shapes, a callable ``data`` without ``steps``, an encoder
        without ``loss``, or a negative count.

    See Also
    --------
    mha.models.from_config : A random model to train from scratch.
    mha.train.lr_schedule : The schedules' formulas.

    Examples
    --------
    >>> model = mha.models.from_config({"model_type": "llama", "hidden_size": 32,
    ...     "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4,
    ...     "vocab_size": 20}, seed=0)
    >>> ids = np.random.default_rng(0).integers(0, 20, size=(8, 16))
    >>> history = fit(model, ids, steps=5, lr=1e-2, progress=False)
    >>> history["loss"].shape
    (5,)
    """
    if optimizer is not None:
        settings = {"lr": lr, "weight_decay": weight_decay, "betas": betas, "eps": eps}
        given = [f"{name}={settings[name]!r}" for name in _OPTIMIZER_SETTINGS
                 if settings[name] is not None]
        if given:
            raise TypeError(
                f"fit: {', '.join(given)} would be ignored with optimizer= (the optimizer's "
                f"own settings apply): set them when building the optimizer, e.g. "
                f"AdamW(params, lr=...), or leave optimizer out")
    betas = (0.9, 0.999) if betas is None else betas
    eps = 1e-8 if eps is None else eps
    if hasattr(model, "writable_parameters"):
        if targets is not None or test_tokens is not None or test_targets is not None:
            raise ValueError("a TransformerModel trains on data alone (its targets are the "
                             "next tokens, or the loss's); pass batches as data")
        return _fit_model(
            model, data, steps=steps, epochs=1 if epochs is None else epochs,
            lr=1e-3 if lr is None else lr, batch_size=batch_size, optimizer=optimizer,
            weight_decay=0.01 if weight_decay is None else weight_decay, betas=betas, eps=eps,
            schedule="cosine" if schedule is None else schedule, warmup_steps=warmup_steps,
            max_grad_norm=1.0 if max_grad_norm is None else max_grad_norm, loss=loss,
            callback=callback, eval_every=eval_every, seed=seed, progress=progress, desc=desc)
    return _fit_pattern(
        model, data, targets, test_tokens, test_targets,
        epochs=100 if epochs is None else epochs, lr=0.005 if lr is None else lr,
        batch_size=batch_size, optimizer=optimizer,
        weight_decay=0.0 if weight_decay is None else weight_decay, betas=betas, eps=eps,
        schedule="constant" if schedule is None else schedule, warmup_steps=warmup_steps,
        max_grad_norm=max_grad_norm, eval_every=1 if eval_every is None else eval_every,
        seed=seed, progress=progress, desc=desc)


def _as_batch(batch: Any) -> Batch:
    """An ids array, or a dict with "input_ids" -> the dict."""
    if isinstance(batch, Mapping):
        if "input_ids" not in batch:
            raise ValueError(f"a batch dict needs 'input_ids', got keys {sorted(batch)}")
        return batch
    ids = np.asarray(batch)
    if ids.ndim != 2 or ids.dtype.kind not in "iu":
        raise ValueError(f"a batch must be int token ids (B, n) or a dict, got "
                         f"{ids.dtype} {ids.shape}")
    return {"input_ids": ids}


def _batches(data: Any, steps: int | None, epochs: int, batch_size: int | None,
             seed: int | None) -> tuple[Iterator[Batch], int]:
    """(an endless iterator of batches, the number of steps)."""
    if int(epochs) < 0 or (steps is not None and int(steps) < 0):
        raise ValueError(f"steps and epochs must be >= 0, got {steps}, {epochs}")
    if callable(data):
        if steps is None:
            raise ValueError("data is a function of the step: pass steps")
        return (_as_batch(data(s)) for s in itertools.count()), int(steps)
    if isinstance(data, np.ndarray) and data.dtype.kind in "iu":
        ids = data if data.ndim == 2 else data[None]
        N = ids.shape[0]
        size = N if batch_size is None else max(1, min(int(batch_size), N))
        per_epoch = -(-N // size)
        rng = np.random.default_rng(seed)

        def rows() -> Iterator[Batch]:
            while True:
                order = np.arange(N) if size == N else rng.permutation(N)
                for i in range(0, N, size):
                    yield {"input_ids": ids[order[i:i + size]]}
        return rows(), int(steps) if steps is not None else per_epoch * int(epochs)
    batches = [_as_batch(b) for b in data]
    if not batches:
        raise ValueError("data holds no batch")
    return itertools.cycle(batches), int(steps) if steps is not None else len(batches) * int(
        epochs)


def _step_function(model: Any, loss: Loss | None
                   ) -> Callable[[Batch], tuple[float, dict[str, np.ndarray]]]:
    """batch -> (loss, gradients of every parameter)."""
    if loss is None:
        if not model.causal:
            raise ValueError(f"{type(model).__name__} is an encoder: pass loss= (a function "
                             f"of the last hidden state, see mha.train.losses)")
        return lambda b: model.loss_and_grads(b["input_ids"], b.get("labels"),
                                              b.get("attention_mask"))

    def on_hidden(b: Batch) -> tuple[float, dict[str, np.ndarray]]:
        enc = model(np.asarray(b["input_ids"]), b.get("attention_mask"),
                    b.get("token_type_ids"), need_weights=False, backward=True)
        value, d_hidden = loss(enc.last_hidden_state, b)
        return float(value), model.backward(d_hidden=d_hidden)
    return on_hidden


def _fit_model(model: Any, data: Any, *, steps: int | None, epochs: int, lr: float,
               batch_size: int | None, optimizer: Any, weight_decay: float,
               betas: tuple[float, float], eps: float, schedule: str, warmup_steps: int,
               max_grad_norm: float | None, loss: Loss | None,
               callback: Callable[[Any, int], Mapping[str, Any] | None] | None,
               eval_every: int | None, seed: int | None, progress: bool, desc: str | None
               ) -> dict[str, Any]:
    """fit for a TransformerModel."""
    batches, total = _batches(data, steps, epochs, batch_size, seed)
    step_function = _step_function(model, loss)
    if optimizer is None:
        optimizer = AdamW(model.parameters(), lr=lr, betas=betas, eps=eps,
                          weight_decay=weight_decay)
    update = _Update(optimizer, lr_schedule(schedule, warmup_steps, total), max_grad_norm,
                     model.writable_parameters)
    every = max(1, total // 10) if eval_every is None else max(1, int(eval_every))
    losses, rates, norms = np.full(total, np.nan), np.full(total, np.nan), np.full(total, np.nan)
    evals: list[dict[str, Any]] = []

    def measure(step: int) -> None:
        if callback is not None:
            evals.append({"step": step, **(callback(model, step) or {})})

    def history() -> dict[str, Any]:
        stacked = {key: np.array([e.get(key) for e in evals])
                   for key in (evals[0] if evals else {})}
        return {"loss": losses, "lr": rates, "grad_norm": norms, "eval": stacked,
                "seconds": time.perf_counter() - start}

    measure(0)
    bar = _progress(range(total), progress, desc)
    start = time.perf_counter()
    try:
        for step in bar:
            value, grads = step_function(next(batches))
            losses[step] = value
            rates[step], norms[step] = update(step, value, grads)
            if progress:
                bar.set_postfix({"loss": f"{value:.4f}", "lr": f"{rates[step]:.2e}"},
                                refresh=False)
            if (step + 1) % every == 0 or step + 1 == total:
                measure(step + 1)
    except FloatingPointError as error:
        error.history = history()           # type: ignore[attr-defined]
        raise
    finally:
        update.restore_lr()
        if progress:
            bar.close()
    return history()


def _fit_pattern(model: Any, tokens: ArrayLike, targets: ArrayLike | None,
                 test_tokens: ArrayLike | None, test_targets: ArrayLike | None, *,
                 epochs: int, lr: float, batch_size: int | None, optimizer: Any,
                 weight_decay: float, betas: tuple[float, float], eps: float, schedule: str,
                 warmup_steps: int, max_grad_norm: float | None, eval_every: int,
                 seed: int | None, progress: bool, desc: str | None) -> dict[str, Any]:
    """fit for the period-3 model: epochs of mini-batches, the test accuracy per epoch."""
    tokens, targets = np.asarray(tokens), np.asarray(targets)
    if tokens.shape != targets.shape or tokens.ndim != 2:
        raise ValueError(f"tokens {tokens.shape} and targets {targets.shape} must both be (N, n)")
    has_test = test_tokens is not None
    if has_test != (test_targets is not None):
        raise ValueError("pass both test_tokens and test_targets, or neither")
    if int(epochs) < 0:
        raise ValueError(f"epochs must be >= 0, got {epochs}")
    if optimizer is None:
        optimizer = AdamW(model.params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
    rng = np.random.default_rng(seed)
    N = tokens.shape[0]
    size = N if batch_size is None else max(1, min(int(batch_size), N))
    full = size == N
    per_epoch = -(-N // size)
    update = _Update(optimizer, lr_schedule(schedule, warmup_steps, per_epoch * int(epochs)),
                     max_grad_norm)
    eval_every = max(1, int(eval_every))
    losses, test_epochs, test_accuracy = [], [], []
    bar = _progress(range(int(epochs)), progress, desc)
    start = time.perf_counter()
    step = 0
    try:
        for epoch in bar:
            if full:
                batches: Sequence[slice | np.ndarray] = [slice(None)]
            else:
                order = rng.permutation(N)
                batches = [order[i:i + size] for i in range(0, N, size)]
            total = 0.0
            for idx in batches:
                x, y = tokens[idx], targets[idx]
                loss, grads = model.loss_and_grads(x, y)
                update(step, loss, grads)
                step += 1
                total += loss * x.shape[0]
            losses.append(total / N)
            postfix = {"loss": f"{losses[-1]:.4f}"}
            if has_test and ((epoch + 1) % eval_every == 0 or epoch + 1 == epochs):
                test_epochs.append(epoch + 1)
                test_accuracy.append(model.accuracy(test_tokens, test_targets))
                postfix["test_acc"] = f"{test_accuracy[-1]:.3f}"
            if progress:
                bar.set_postfix(postfix, refresh=False)
    finally:
        update.restore_lr()
        if progress:
            bar.close()
    seconds = time.perf_counter() - start
    return {
        "loss": np.array(losses),
        "test_epochs": np.array(test_epochs, dtype=np.int64),
        "test_accuracy": np.array(test_accuracy),
        "final_loss": model.loss(tokens, targets),
        "final_test_accuracy": test_accuracy[-1] if test_accuracy else float("nan"),
        "seconds": seconds,
    }
