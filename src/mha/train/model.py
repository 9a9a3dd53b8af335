"""Seed 000's small attention model, its loss, Adam, and the training loop.

    tokens (B, n) -> token_embedding[tokens] + pos_embedding[:n]      x (B, n, d_model)
                  -> MultiHeadAttention(x, causal=True)               h (B, n, d_model)
                  -> h @ W_out + b_out                                logits (B, n, vocab)
                  -> softmax cross-entropy, mean over every token

The attention layer (forward and backward) runs on mha's C kernels; the embeddings, the output
projection, the loss and Adam are a few lines of NumPy each.
"""
import time

import numpy as np

from ..layer import MultiHeadAttention

__all__ = ["SimpleAttentionModel", "cross_entropy", "Adam", "fit"]


def cross_entropy(logits, targets):
    """Mean softmax cross-entropy over every token, and its gradient.

    logits: (..., vocab) floats; targets: (...) ints in [0, vocab).
    Returns (loss, d_logits): loss a Python float (like torch.nn.CrossEntropyLoss with the
    default reduction="mean"), d_logits = (softmax(logits) - onehot(targets)) / n_tokens with
    the logits' shape and dtype.
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
    """Seed 000's ``SimpleAttentionModel``: embedding -> causal attention -> linear.

    Args:
        vocab_size: number of token ids
        d_model: embedding width
        n_heads: attention heads (d_head = d_model // n_heads; with one head this is the
            seed's ``SingleHeadAttention``, scale 1/sqrt(d_model))
        seq_len: longest sequence (rows of the position embedding)
        bias: biases on the attention's four projections (the seed has none: False)
        dtype: float32 (default, like the seed's torch model) or float64
        seed: seeds every initial weight (reproducible)

    Initialisation follows PyTorch's defaults for the seed's modules: embeddings N(0, 1);
    output layer U(-1/sqrt(d_model), 1/sqrt(d_model)) for weight and bias; the attention layer
    initialises itself (Xavier-uniform weights, zero biases, docs/semantics.md).

    Attributes:
        attention: the :class:`mha.MultiHeadAttention` layer (its ``head_mask`` prunes heads)
        params: dict name -> array, the arrays themselves (an optimizer updates them in place):
            token_embedding (vocab, d), pos_embedding (seq_len, d), W_q, W_k, W_v, W_o
            (+ b_q, b_k, b_v, b_o with bias=True), W_out (d, vocab), b_out (vocab,)
        grads: same keys plus "head_mask", filled by :meth:`backward`
    """

    def __init__(self, vocab_size=5, d_model=32, n_heads=4, seq_len=12, *, bias=False,
                 dtype=np.float32, seed=None):
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
        self.grads = {}
        self._saved = None

    @property
    def n_heads(self):
        return self.attention.n_heads

    @property
    def params(self):
        own = self._own
        return {"token_embedding": own["token_embedding"], "pos_embedding": own["pos_embedding"],
                **self.attention.params, "W_out": own["W_out"], "b_out": own["b_out"]}

    def num_parameters(self):
        """Number of trainable scalars."""
        return sum(a.size for a in self.params.values())

    def _tokens(self, tokens, name="tokens"):
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

    def forward(self, tokens, *, need_weights=True):
        """tokens (B, n) or (n,) ints -> (logits (B, n, vocab), weights (B, n_heads, n, n)).

        weights are the attention probabilities (None with need_weights=False); an unbatched
        input drops the batch axis of both. Saves what :meth:`backward` needs.
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

    def backward(self, d_logits):
        """Gradients of a scalar loss given d_logits = dL/dlogits (the last forward's shape).

        Fills and returns ``self.grads`` (keys of ``params``, plus "head_mask").
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

    def loss(self, tokens, targets):
        """Mean cross-entropy of the next-token predictions (no gradient)."""
        logits, _ = self.forward(tokens, need_weights=False)
        return cross_entropy(logits, self._tokens(targets, "targets"))[0]

    def loss_and_grads(self, tokens, targets):
        """Forward, cross-entropy and backward: returns (loss, grads)."""
        logits, _ = self.forward(tokens, need_weights=False)
        loss, d_logits = cross_entropy(logits, self._tokens(targets, "targets"))
        return loss, self.backward(d_logits)

    def predict(self, tokens):
        """The most likely next token at every position: (B, n) ints."""
        logits, _ = self.forward(tokens, need_weights=False)
        return logits.argmax(axis=-1)

    def accuracy(self, tokens, targets):
        """Fraction of positions whose predicted next token equals the target."""
        return float(np.mean(self.predict(tokens) == np.asarray(targets)))

    def __repr__(self):
        return (f"SimpleAttentionModel(vocab_size={self.vocab_size}, d_model={self.d_model}, "
                f"n_heads={self.n_heads}, seq_len={self.seq_len}, bias={self.attention.bias}, "
                f"dtype={np.dtype(self.dtype).name}, parameters={self.num_parameters()})")


class Adam:
    """Adam (Kingma & Ba), step for step the same arithmetic as ``torch.optim.Adam``.

        m = b1 m + (1 - b1) g;   v = b2 v + (1 - b2) g^2
        p -= lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)

    params: dict name -> array, updated in place (e.g. ``model.params``). weight_decay adds
    ``weight_decay * p`` to the gradient (L2, like torch.optim.Adam, not AdamW).
    """

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0):
        if lr <= 0:
            raise ValueError(f"lr must be positive, got {lr}")
        self.params = dict(params)
        self.lr, self.betas = float(lr), tuple(betas)
        self.eps, self.weight_decay = float(eps), float(weight_decay)
        self.m = {name: np.zeros_like(p) for name, p in self.params.items()}
        self.v = {name: np.zeros_like(p) for name, p in self.params.items()}
        self.t = 0

    def step(self, grads):
        """One update from grads (dict with at least the keys of params)."""
        b1, b2 = self.betas
        self.t += 1
        step_size = self.lr / (1.0 - b1 ** self.t)
        bc2_sqrt = np.sqrt(1.0 - b2 ** self.t)
        for name, p in self.params.items():
            g = grads[name]
            if self.weight_decay:
                g = g + self.weight_decay * p
            m, v = self.m[name], self.v[name]
            m *= b1
            m += (1.0 - b1) * g
            v *= b2
            v += (1.0 - b2) * (g * g)
            p -= step_size * m / (np.sqrt(v) / bc2_sqrt + self.eps)


def _progress(iterable, enabled, desc):
    """tqdm (the notebook widget when ipywidgets is installed), or the bare iterable."""
    if not enabled:
        return iterable
    try:
        import ipywidgets  # noqa: F401
        from tqdm.auto import tqdm
    except ImportError:
        from tqdm import tqdm
    return tqdm(iterable, desc=desc, leave=True)


def fit(model, tokens, targets, test_tokens=None, test_targets=None, *, epochs=100, lr=0.005,
        batch_size=None, optimizer=None, eval_every=1, seed=None, progress=True, desc=None):
    """Train `model` with Adam (seed 000's ``train_model``) and return its history.

    tokens, targets: (N, n) training set; test_tokens, test_targets: optional test set whose
    accuracy is measured every `eval_every` epochs (and after the last).
    batch_size: None = full batch, one step per epoch (the seed); else shuffled mini-batches
    (shuffling seeded by `seed`). optimizer: any object with ``step(grads)``; default
    ``Adam(model.params, lr=lr)``. progress: show a tqdm bar (loss and test accuracy).

    Returns a dict of plain values:
        loss: (epochs,) mean training loss of each epoch, measured before each step (the seed)
        test_epochs: (k,) 1-based epochs at which the test accuracy was measured
        test_accuracy: (k,) accuracy on the test set at those epochs (empty without a test set)
        final_loss: training loss of the trained model (after the last step)
        final_test_accuracy: test accuracy after the last epoch (nan without a test set)
        seconds: wall time of the training loop
    """
    tokens, targets = np.asarray(tokens), np.asarray(targets)
    if tokens.shape != targets.shape or tokens.ndim != 2:
        raise ValueError(f"tokens {tokens.shape} and targets {targets.shape} must both be (N, n)")
    has_test = test_tokens is not None
    if has_test != (test_targets is not None):
        raise ValueError("pass both test_tokens and test_targets, or neither")
    if int(epochs) < 0:
        raise ValueError(f"epochs must be >= 0, got {epochs}")
    optimizer = Adam(model.params, lr=lr) if optimizer is None else optimizer
    rng = np.random.default_rng(seed)
    N = tokens.shape[0]
    eval_every = max(1, int(eval_every))
    losses, test_epochs, test_accuracy = [], [], []
    bar = _progress(range(int(epochs)), progress, desc)
    start = time.perf_counter()
    for epoch in bar:
        if batch_size is None or batch_size >= N:
            batches = [slice(None)]
        else:
            order = rng.permutation(N)
            batches = [order[i:i + batch_size] for i in range(0, N, int(batch_size))]
        total = 0.0
        for idx in batches:
            x, y = tokens[idx], targets[idx]
            loss, grads = model.loss_and_grads(x, y)
            optimizer.step(grads)
            total += loss * x.shape[0]
        losses.append(total / N)
        postfix = {"loss": f"{losses[-1]:.4f}"}
        if has_test and ((epoch + 1) % eval_every == 0 or epoch + 1 == epochs):
            test_epochs.append(epoch + 1)
            test_accuracy.append(model.accuracy(test_tokens, test_targets))
            postfix["test_acc"] = f"{test_accuracy[-1]:.3f}"
        if progress:
            bar.set_postfix(postfix, refresh=False)
    seconds = time.perf_counter() - start
    if progress:
        bar.close()
    return {
        "loss": np.array(losses),
        "test_epochs": np.array(test_epochs, dtype=np.int64),
        "test_accuracy": np.array(test_accuracy),
        "final_loss": model.loss(tokens, targets),
        "final_test_accuracy": test_accuracy[-1] if test_accuracy else float("nan"),
        "seconds": seconds,
    }
