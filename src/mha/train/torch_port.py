"""The PyTorch twin of :class:`SimpleAttentionModel`, loaded with its weights: textbook
single-head and multi-head attention modules (``nn.Linear`` projections, the heads split by
``view`` and ``transpose``) under an embedding and an output layer.

The peer of the speed comparison (:func:`mha.apps.epoch_speed.benchmark_epoch`). torch is
optional: it is imported only when :func:`torch_model` is called.
"""
from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from .model import SimpleAttentionModel

__all__ = ["torch_model"]


@functools.lru_cache(maxsize=None)
def _classes() -> type:
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    class SingleHeadAttention(nn.Module):
        """One head of width d_model, scale 1/sqrt(d_model), with an optional bias."""

        def __init__(self, d_model: int, bias: bool = False) -> None:
            super().__init__()
            self.d_model = d_model
            self.W_q = nn.Linear(d_model, d_model, bias=bias)
            self.W_k = nn.Linear(d_model, d_model, bias=bias)
            self.W_v = nn.Linear(d_model, d_model, bias=bias)
            self.W_o = nn.Linear(d_model, d_model, bias=bias)

        def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
            Q, K, V = self.W_q(x), self.W_k(x), self.W_v(x)
            scores = torch.matmul(Q, K.transpose(-2, -1)) / (self.d_model ** 0.5)
            if mask is not None:
                scores = scores.masked_fill(mask == 0, float("-inf"))
            attn_weights = F.softmax(scores, dim=-1)
            return self.W_o(torch.matmul(attn_weights, V)), attn_weights

    class MultiHeadAttention(nn.Module):
        """Heads of width d_model // n_heads, split and combined by reshape, optional bias."""

        def __init__(self, d_model: int, n_heads: int, bias: bool = False) -> None:
            super().__init__()
            self.d_model, self.n_heads, self.d_k = d_model, n_heads, d_model // n_heads
            self.W_q = nn.Linear(d_model, d_model, bias=bias)
            self.W_k = nn.Linear(d_model, d_model, bias=bias)
            self.W_v = nn.Linear(d_model, d_model, bias=bias)
            self.W_o = nn.Linear(d_model, d_model, bias=bias)

        def split_heads(self, x: torch.Tensor) -> torch.Tensor:
            batch_size, seq_len, _ = x.shape
            return x.view(batch_size, seq_len, self.n_heads, self.d_k).transpose(1, 2)

        def combine_heads(self, x: torch.Tensor) -> torch.Tensor:
            batch_size, _, seq_len, _ = x.shape
            return x.transpose(1, 2).contiguous().view(batch_size, seq_len, self.d_model)

        def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
            Q = self.split_heads(self.W_q(x))
            K = self.split_heads(self.W_k(x))
            V = self.split_heads(self.W_v(x))
            scores = torch.matmul(Q, K.transpose(-2, -1)) / (self.d_k ** 0.5)
            if mask is not None:
                scores = scores.masked_fill(mask == 0, float("-inf"))
            attn_weights = F.softmax(scores, dim=-1)
            context = self.combine_heads(torch.matmul(attn_weights, V))
            return self.W_o(context), attn_weights

    class SimpleAttentionModel(nn.Module):
        """Token and position embedding -> causal attention -> output layer."""

        def __init__(self, vocab_size: int, d_model: int, n_heads: int, seq_len: int,
                     bias: bool = False) -> None:
            super().__init__()
            self.embedding = nn.Embedding(vocab_size, d_model)
            self.pos_embedding = nn.Embedding(seq_len, d_model)
            self.attention: SingleHeadAttention | MultiHeadAttention
            if n_heads == 1:
                self.attention = SingleHeadAttention(d_model, bias)
            else:
                self.attention = MultiHeadAttention(d_model, n_heads, bias)
            self.output = nn.Linear(d_model, vocab_size)
            self.n_heads = n_heads

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            batch_size, seq_len = x.shape
            positions = torch.arange(seq_len, device=x.device).unsqueeze(0)
            mask = torch.tril(torch.ones(seq_len, seq_len, device=x.device)).unsqueeze(0)
            if self.n_heads > 1:
                mask = mask.unsqueeze(1)
            x = self.embedding(x) + self.pos_embedding(positions)
            x, attn = self.attention(x, mask=mask)
            return self.output(x), attn

    return SimpleAttentionModel


def torch_model(model: SimpleAttentionModel) -> Any:
    """Build the torch twin of `model` (an ``nn.Module``) holding a copy of its weights.

    The torch model has the model's dtype (float32 or float64); nn.Linear stores weights
    (out, in), so each W is transposed. torch is imported here only.

    Parameters
    ----------
    model : mha.train.SimpleAttentionModel
        A model with d_head = d_model // n_heads, no grouped heads and no head mask.

    Returns
    -------
    torch.nn.Module
        The torch model with the same weights, in train mode.

    Raises
    ------
    ValueError
        A model the torch twin cannot hold.
    ImportError
        torch is not installed.

    Examples
    --------
    >>> model = SimpleAttentionModel(d_model=16, n_heads=2, seed=0)
    >>> module = torch_model(model)                                  # doctest: +SKIP
    >>> import torch                                                 # doctest: +SKIP
    >>> x = np.array([[0, 1, 2, 0, 1, 2]])
    >>> bool(np.allclose(module(torch.from_numpy(x))[0].detach().numpy(), model(x)[0], atol=1e-5))  # doctest: +SKIP
    True
    """
    import torch

    att = model.attention
    if att.d_head * att.n_heads != model.d_model or att.n_kv_heads != att.n_heads:
        raise ValueError("torch_model needs d_head = d_model // n_heads and no grouped heads")
    if not np.all(np.asarray(att.head_mask) == 1):
        raise ValueError("torch_model: the torch model has no head mask; "
                         "reset model.attention.head_mask to ones first")
    cls = _classes()
    dtype = torch.float64 if np.dtype(model.dtype) == np.float64 else torch.float32
    module = cls(model.vocab_size, model.d_model, model.n_heads, model.seq_len,
                 bias=att.bias).to(dtype)
    P = model.params

    def put(param: torch.nn.Parameter, array: np.ndarray) -> None:
        param.data.copy_(torch.from_numpy(np.ascontiguousarray(array)))

    with torch.no_grad():
        put(module.embedding.weight, P["token_embedding"])
        put(module.pos_embedding.weight, P["pos_embedding"])
        for name in ("q", "k", "v", "o"):
            linear = getattr(module.attention, f"W_{name}")
            put(linear.weight, P[f"W_{name}"].T)
            if att.bias:
                put(linear.bias, P[f"b_{name}"])
        put(module.output.weight, P["W_out"].T)
        put(module.output.bias, P["b_out"])
    return module
