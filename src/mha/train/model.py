"""A small attention model for the period-3 task and its loss (trained by
:func:`mha.train.fit` with :class:`mha.train.AdamW`).

    tokens (B, n) -> token_embedding[tokens] + pos_embedding[:n]      x (B, n, d_model)
                  -> MultiHeadAttention(x, causal=True)               h (B, n, d_model)
                  -> h @ W_out + b_out                                logits (B, n, vocab)
                  -> softmax cross-entropy, mean over every token

The attention layer (forward and backward) runs on mha's C kernels; the embeddings, the output
projection and the loss are a few lines of NumPy each.
"""
from __future__ import annotations


import numpy as np
from numpy.typing import ArrayLike, DTypeLike

from ..layer import MultiHeadAttention

__all__ = ["SimpleAttentionModel", "cross_entropy"]


def cross_entropy(logits: ArrayLike, targets: ArrayLike) -> tuple[float, np.ndarray]:
    """Compute the mean softmax cross-entropy over every token, and its gradient.

    Parameters
    ----------
    logits : array_like of float, shape (..., vocab)
        Unnormalised scores.
    targets : array_like of int, shape (...)
        Class ids in [0, vocab).

    Returns
    -------
    loss : float
        The mean over tokens (like ``torch.nn.CrossEntropyLoss`` with ``reduction="mean"``).
    d_logits : ndarray, shape and dtype of ``logits``
        ``(softmax(logits) - onehot(targets)) / n_tokens``.

    Raises
    ------
    ValueError
        Targets whose shape is not ``logits.shape[:-1]``.

    Examples
    --------
    >>> loss, d = cross_entropy(np.zeros((2, 4)), np.array([0, 3]))
    >>> round(loss, 4), d[0]                               # ln 4
    (1.3863, array([-0.375,  0.125,  0.125,  0.125]))
    """
    logits = np.asarray(logits)
    targets = np.asarray(targets)
    if logits.shape[:-1] != targets.shape:
        raise ValueError(f"logits have shape {logits.shape} but targets have shape "
                         f"{targets.shape}: expected targets of shape {logits.shape[:-1]}")
    vocab = logits.shape[-1]
    flat = logits.reshape(-1, vocab)
    labels = targets.reshape(-1)
    n = flat.shape[0]
    shifted = flat - flat.max(axis=1, keepdims=True)
    log_sum = np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    log_probs = shifted - log_sum                                          # (n, vocab)
    rows = np.arange(n)
    loss = -float(log_probs[rows, labels].mean())
    d_flat = np.exp(log_probs)
    d_flat[rows, labels] -= 1.0
    d_flat /= n
    return loss, d_flat.reshape(logits.shape).astype(logits.dtype, copy=False)


class SimpleAttentionModel:
    """Build a small next-token model: embedding, causal attention, linear.

    Initialisation follows PyTorch's defaults for the same modules (``nn.Embedding``,
    ``nn.Linear``, as in :func:`mha.train.torch_model`): embeddings N(0, 1);
    output layer U(-1/sqrt(d_model), 1/sqrt(d_model)) for weight and bias; the attention layer
    initialises itself (docs/semantics.md).

    Parameters
    ----------
    vocab_size : int, default 5
        The number of token ids.
    d_model : int, default 32
        The embedding width.
    n_heads : int, default 4
        Attention heads (d_head = d_model // n_heads; with one head this is plain
        single-head attention, scale 1/sqrt(d_model)).
    seq_len : int, default 12
        The longest sequence (rows of the position embedding).
    bias : bool, default False
        Biases on the attention's four projections.
    dtype : {numpy.float32, numpy.float64}, default numpy.float32
        What the model computes in (float32 like a default torch model).
    seed : int, optional
        Seeds every initial weight (reproducible).

    Attributes
    ----------
    attention : mha.MultiHeadAttention
        The attention layer (its ``head_mask`` prunes heads).
    params : dict of str to ndarray
        The arrays themselves (an optimizer updates them in place): token_embedding (vocab, d),
        pos_embedding (seq_len, d), W_q, W_k, W_v, W_o (+ b_q, b_k, b_v, b_o with bias=True),
        W_out (d, vocab), b_out (vocab,).
    grads : dict of str to ndarray
        The same keys plus "head_mask", filled by :meth:`backward`.

    Raises
    ------
    ValueError
        Sizes that are not positive.

    Examples
    --------
    >>> model = SimpleAttentionModel(vocab_size=5, d_model=8, n_heads=2, seq_len=6, seed=0)
    >>> logits, weights = model(np.array([[0, 1, 2, 0, 1, 2]]))
    >>> logits.shape, weights.shape
    ((1, 6, 5), (1, 2, 6, 6))
    """

    def __init__(self, vocab_size: int = 5, d_model: int = 32, n_heads: int = 4, seq_len: int = 12,
                 *, bias: bool = False, dtype: DTypeLike = np.float32, seed: int | None = None,
                 ) -> None:
        self.vocab_size, self.d_model, self.seq_len = int(vocab_size), int(d_model), int(seq_len)
        if min(self.vocab_size, self.seq_len) < 1:
            raise ValueError(f"vocab_size and seq_len must be positive, got {vocab_size}, "
                             f"{seq_len}")
        rng = np.random.default_rng(seed)
        self.attention = MultiHeadAttention(d_model, n_heads, bias=bias, dtype=dtype,
                                            seed=int(rng.integers(0, 2**63)))
        self.dtype = self.attention.dtype
        bound = 1.0 / np.sqrt(self.d_model)
        self._own = {
            "token_embedding": rng.standard_normal((self.vocab_size, self.d_model)),
            "pos_embedding": rng.standard_normal((self.seq_len, self.d_model)),
            "W_out": rng.uniform(-bound, bound, size=(self.d_model, self.vocab_size)),
            "b_out": rng.uniform(-bound, bound, size=self.vocab_size),
        }
        self._own = {name: a.astype(self.dtype) for name, a in self._own.items()}
        self.grads: dict[str, np.ndarray] = {}
        # what backward needs from the last forward: tokens, the attention's output, unbatched
        self._saved: tuple[np.ndarray, np.ndarray, bool] | None = None

    @property
    def n_heads(self) -> int:
        return self.attention.n_heads

    @property
    def params(self) -> dict[str, np.ndarray]:
        own = self._own
        return {"token_embedding": own["token_embedding"], "pos_embedding": own["pos_embedding"],
                **self.attention.params, "W_out": own["W_out"], "b_out": own["b_out"]}

    def num_parameters(self) -> int:
        """Count the trainable scalars.

        Returns
        -------
        int
            The total size of ``params``.
        """
        return sum(a.size for a in self.params.values())

    def _tokens(self, tokens: ArrayLike, name: str = "tokens") -> np.ndarray:
        tokens = np.asarray(tokens)
        if tokens.dtype.kind not in "iu":
            raise TypeError(f"{name} must be an integer array of token ids, got dtype "
                            f"{tokens.dtype}")
        if tokens.ndim not in (1, 2) or tokens.shape[-1] < 1:
            raise ValueError(f"{name} has shape {tokens.shape} but expected (batch, n) or (n,)")
        if tokens.shape[-1] > self.seq_len:
            raise ValueError(f"{name} has {tokens.shape[-1]} positions but the model has "
                             f"seq_len={self.seq_len}")
        if tokens.size and (tokens.min() < 0 or tokens.max() >= self.vocab_size):
            raise ValueError(f"{name} holds ids outside [0, {self.vocab_size})")
        return tokens

    def forward(self, tokens: ArrayLike, *, need_weights: bool = True
                ) -> tuple[np.ndarray, np.ndarray | None]:
        """Run the model: embeddings, causal attention, output layer.

        Saves what :meth:`backward` needs.

        Parameters
        ----------
        tokens : array_like of int, shape (B, n) or (n,)
            Token ids in [0, vocab_size), n <= seq_len.
        need_weights : bool, default True
            Also return the attention probabilities.

        Returns
        -------
        logits : ndarray, shape (B, n, vocab_size)
            The next-token scores (the batch axis dropped for an unbatched input).
        weights : ndarray, shape (B, n_heads, n, n), or None
            The attention probabilities (None with ``need_weights=False``).

        Raises
        ------
        TypeError
            Token ids that are not integers.
        ValueError
            Ids out of range, or sequences longer than ``seq_len``.
        """
        tokens = self._tokens(tokens)
        unbatched = tokens.ndim == 1
        if unbatched:
            tokens = tokens[None]
        n = tokens.shape[1]
        x = self._own["token_embedding"][tokens] + self._own["pos_embedding"][:n]   # (B, n, d)
        h, weights = self.attention(x, causal=True, need_weights=need_weights)    # (B, n, d)
        logits = h @ self._own["W_out"] + self._own["b_out"]                       # (B, n, V)
        self._saved = (tokens, h, unbatched)
        if unbatched:
            logits = logits[0]
            weights = None if weights is None else weights[0]
        return logits, weights

    __call__ = forward

    def backward(self, d_logits: ArrayLike) -> dict[str, np.ndarray]:
        """Compute the gradients of a scalar loss from the gradient of the last forward's logits.

        Parameters
        ----------
        d_logits : array_like, shape of the last forward's logits
            The gradient dL/dlogits.

        Returns
        -------
        dict of str to ndarray
            ``self.grads``: the keys of ``params``, plus "head_mask".

        Raises
        ------
        RuntimeError
            No forward call before.
        ValueError
            ``d_logits`` of the wrong shape.
        """
        if self._saved is None:
            raise RuntimeError("backward() needs a forward call first")
        tokens, h, unbatched = self._saved
        d_logits = np.asarray(d_logits, dtype=self.dtype)
        if unbatched and d_logits.ndim == 2:
            d_logits = d_logits[None]
        B, n = tokens.shape
        if d_logits.shape != (B, n, self.vocab_size):
            raise ValueError(f"d_logits has shape {d_logits.shape} but the logits have shape "
                             f"{(B, n, self.vocab_size)}")
        d, V = self.d_model, self.vocab_size
        # 3. logits = h @ W_out + b_out  (batched products: a (B*n, d) x (d, V) BLAS call is
        #    split over threads for a few microseconds of work, slow on a busy machine)
        d_W_out = (h.transpose(0, 2, 1) @ d_logits).sum(axis=0)                    # (d, V)
        d_b_out = d_logits.sum(axis=(0, 1))
        d_h = d_logits @ self._own["W_out"].T                                      # (B, n, d)
        # 2. h = attention(x): the C backward
        d_x, _, _ = self.attention.backward(d_h)                                   # (B, n, d)
        # 1. x = token_embedding[tokens] + pos_embedding[:n]
        flat_index = (tokens.reshape(-1, 1) * d + np.arange(d)).reshape(-1)    # (B*n*d,)
        d_tok = np.bincount(flat_index, weights=d_x.reshape(-1), minlength=V * d)
        d_tok = d_tok.reshape(V, d).astype(self.dtype)
        d_pos = np.zeros_like(self._own["pos_embedding"])
        d_pos[:n] = d_x.sum(axis=0)
        att = self.attention.grads
        self.grads = {"token_embedding": d_tok, "pos_embedding": d_pos,
                      **{k: v for k, v in att.items() if k != "head_mask"},
                      "W_out": d_W_out, "b_out": d_b_out, "head_mask": att["head_mask"]}
        return self.grads

    def loss(self, tokens: ArrayLike, targets: ArrayLike) -> float:
        """Compute the mean cross-entropy of the next-token predictions (no gradient).

        Parameters
        ----------
        tokens : array_like of int, shape (B, n) or (n,)
            Token ids in [0, vocab_size), n <= seq_len.
        targets : array_like of int, shape of ``tokens``
            The next token of each position.

        Returns
        -------
        float
            The loss in nats per token.
        """
        logits, _ = self.forward(tokens, need_weights=False)
        return cross_entropy(logits, self._tokens(targets, "targets"))[0]

    def loss_and_grads(self, tokens: ArrayLike, targets: ArrayLike
                       ) -> tuple[float, dict[str, np.ndarray]]:
        """Run forward, cross-entropy and backward.

        Parameters
        ----------
        tokens : array_like of int, shape (B, n) or (n,)
            Token ids in [0, vocab_size), n <= seq_len.
        targets : array_like of int, shape of ``tokens``
            The next token of each position.

        Returns
        -------
        loss : float
            The loss in nats per token.
        grads : dict of str to ndarray
            As returned by :meth:`backward`.
        """
        logits, _ = self.forward(tokens, need_weights=False)
        loss, d_logits = cross_entropy(logits, self._tokens(targets, "targets"))
        return loss, self.backward(d_logits)

    def predict(self, tokens: ArrayLike) -> np.ndarray:
        """Predict the most likely next token at every position.

        Parameters
        ----------
        tokens : array_like of int, shape (B, n) or (n,)
            Token ids in [0, vocab_size), n <= seq_len.

        Returns
        -------
        ndarray of int, shape of ``tokens``
            The argmax of the logits.
        """
        logits, _ = self.forward(tokens, need_weights=False)
        return logits.argmax(axis=-1)

    def accuracy(self, tokens: ArrayLike, targets: ArrayLike) -> float:
        """Compute the fraction of positions whose predicted next token equals the target.

        Parameters
        ----------
        tokens : array_like of int, shape (B, n) or (n,)
            Token ids in [0, vocab_size), n <= seq_len.
        targets : array_like of int, shape of ``tokens``
            The next token of each position.

        Returns
        -------
        float
            In [0, 1].
        """
        return float(np.mean(self.predict(tokens) == np.asarray(targets)))

    def __repr__(self) -> str:
        return (f"SimpleAttentionModel(vocab_size={self.vocab_size}, d_model={self.d_model}, "
                f"n_heads={self.n_heads}, seq_len={self.seq_len}, bias={self.attention.bias}, "
                f"dtype={np.dtype(self.dtype).name}, parameters={self.num_parameters()})")
