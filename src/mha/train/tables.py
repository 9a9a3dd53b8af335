"""Parameter counts: one attention layer, a whole Transformer, and a Markdown table of them (the
parameter-count exercise: with and without bias, one head against many, attention against the
feed-forward network)."""
from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np

__all__ = ["parameter_count", "transformer_parameters", "parameter_table", "format_table"]


def parameter_count(d_model: int = 512, n_heads: int = 8, *, bias: bool = True,
                    d_head: int | None = None) -> dict[str, int]:
    """Count the parameters of one multi-head attention layer: W_q, W_k, W_v, W_o and optional biases.

    Parameters
    ----------
    d_model, n_heads : int
        Model width and number of heads.
    bias : bool
        Count the four biases.
    d_head : int, optional
        Head width; defaults to d_model // n_heads (so every head count gives 4 d_model^2
        weights).

    Returns
    -------
    dict of int
        "d_head", "W_q", "W_k", "W_v", "W_o", "b_q", "b_k", "b_v", "b_o" (0 without bias),
        "weights", "biases", "total". "total" equals
        ``mha.MultiHeadAttention(d_model, n_heads, bias=bias).num_parameters()``.

    Raises
    ------
    ValueError
        d_head < 1 (more heads than d_model without an explicit d_head).

    Examples
    --------
    >>> parameter_count(512, 8)["total"]
    1050624
    """
    d_model, n_heads = int(d_model), int(n_heads)
    d_head = d_model // n_heads if d_head is None else int(d_head)
    if d_head < 1:
        raise ValueError(f"d_head = {d_head}: need n_heads <= d_model or an explicit d_head")
    inner = n_heads * d_head
    counts = {"d_head": d_head, "W_q": d_model * inner, "W_k": d_model * inner,
              "W_v": d_model * inner, "W_o": inner * d_model}
    b = 1 if bias else 0
    counts.update(b_q=b * inner, b_k=b * inner, b_v=b * inner, b_o=b * d_model)
    counts["weights"] = sum(counts[k] for k in ("W_q", "W_k", "W_v", "W_o"))
    counts["biases"] = sum(counts[k] for k in ("b_q", "b_k", "b_v", "b_o"))
    counts["total"] = counts["weights"] + counts["biases"]
    return counts


def transformer_parameters(d_model: int = 512, n_heads: int = 8, d_ff: int | None = None, *,
                           n_layers: int = 6, vocab_size: int = 37000, bias: bool = True,
                           decoder: bool = True, shared_embeddings: bool = True) -> dict[str, Any]:
    """Count where a Transformer's parameters are.

    A block is post-LN: self-attention, [cross-attention in the decoder], a two-layer FFN
    (d_model -> d_ff -> d_model, biases with bias=True), and one LayerNorm (2 d_model) per
    sub-layer. Sinusoidal positions have no parameters; with shared_embeddings one
    vocab_size x d_model matrix serves encoder, decoder and the output projection.

    Parameters
    ----------
    d_model, n_heads : int
        The base model: 512, 8.
    d_ff : int, optional
        Feed-forward width; defaults to 4 d_model (2048 in the base model).
    n_layers : int
        Encoder layers, and decoder layers with decoder=True.
    vocab_size : int
        The vocabulary (37000 in the base model).
    bias : bool
        Biases in the attention and feed-forward layers.
    decoder : bool
        Count a decoder as well as the encoder.
    shared_embeddings : bool
        One embedding matrix for the encoder, the decoder and the output projection.

    Returns
    -------
    dict
        "mha", "ffn", "layer_norm", "embedding", "total" (whole model) and their ``"*_share"`` of
        the total; "block": the same for one encoder block (mha, ffn, layer_norm, total,
        mha_share, ffn_share).

    References
    ----------
    A. Vaswani et al., "Attention is all you need", NeurIPS 2017.

    Examples
    --------
    >>> base = transformer_parameters()            # the base model of Vaswani et al.
    >>> base["total"], round(base["mha_share"], 3)
    (63082496, 0.3)
    """
    d_model = int(d_model)
    d_ff = 4 * d_model if d_ff is None else int(d_ff)
    attention = parameter_count(d_model, n_heads, bias=bias)["total"]
    ffn = 2 * d_model * d_ff + ((d_ff + d_model) if bias else 0)
    norm = 2 * d_model
    block_total = attention + ffn + 2 * norm
    block = {"mha": attention, "ffn": ffn, "layer_norm": 2 * norm, "total": block_total,
             "mha_share": attention / block_total, "ffn_share": ffn / block_total}
    n_enc, n_dec = int(n_layers), int(n_layers) if decoder else 0
    totals: dict[str, Any] = {     # counts, then shares and the block's dict
        "mha": attention * (n_enc + 2 * n_dec),
        "ffn": ffn * (n_enc + n_dec),
        "layer_norm": norm * (2 * n_enc + 3 * n_dec),
        "embedding": vocab_size * d_model * (1 if shared_embeddings else (3 if decoder else 2)),
    }
    totals["total"] = sum(totals.values())
    for key in ("mha", "ffn", "layer_norm", "embedding"):
        totals[f"{key}_share"] = totals[key] / totals["total"]
    totals["block"] = block
    return totals


def parameter_table(d_model: int = 512, n_heads_list: Sequence[int] = (1, 8), *,
                    bias: bool | Sequence[bool] = (False, True), d_ff: int | None = None,
                    ) -> list[dict[str, Any]]:
    """Tabulate the parameter counts: one row per (n_heads, bias), d_head = d_model // n_heads.

    Parameters
    ----------
    d_model : int
        The model width.
    n_heads_list : sequence of int
        The head counts, one row each.
    bias : bool or sequence of bool
        With and/or without biases, one row each.
    d_ff : int, optional
        As `transformer_parameters`.

    Returns
    -------
    list of dict
        The keys d_model, n_heads, d_head, bias, W_q, W_k, W_v, W_o, biases, mha (attention total),
        ffn, block (one encoder block), mha_share, ffn_share. Print it with `format_table`.

    Examples
    --------
    >>> rows = parameter_table(64, (1, 8), bias=True)
    >>> [(r["n_heads"], r["mha"]) for r in rows]       # the head count does not change the size
    [(1, 16640), (8, 16640)]
    """
    rows = []
    for b in ((bias,) if isinstance(bias, (bool, np.bool_)) else tuple(bias)):
        for h in n_heads_list:
            c = parameter_count(d_model, h, bias=bool(b))
            block = transformer_parameters(d_model, h, d_ff, bias=bool(b))["block"]
            rows.append({"d_model": int(d_model), "n_heads": int(h), "d_head": c["d_head"],
                         "bias": bool(b), "W_q": c["W_q"], "W_k": c["W_k"], "W_v": c["W_v"],
                         "W_o": c["W_o"], "biases": c["biases"], "mha": c["total"],
                         "ffn": block["ffn"], "block": block["total"],
                         "mha_share": block["mha_share"], "ffn_share": block["ffn_share"]})
    return rows


def format_table(rows: Sequence[Mapping[str, Any]], columns: Sequence[str] | None = None) -> str:
    """Format a list of dicts as a Markdown table.

    Parameters
    ----------
    rows : list of dict
        One dict per row, e.g. from `parameter_table`.
    columns : sequence of str, optional
        The keys to show, in order; default: the first row's.

    Returns
    -------
    str
        Ints with thousands separators, bools as yes/no, floats as % when the column name ends
        in "share", else with 4 significant digits; "" for no rows.

    Examples
    --------
    >>> print(format_table(parameter_table(64, (1, 8), bias=True), ["n_heads", "d_head", "mha"]))
    | n_heads | d_head | mha |
    |---|---|---|
    | 1 | 64 | 16,640 |
    | 8 | 8 | 16,640 |
    """
    if not rows:
        return ""
    columns = list(rows[0]) if columns is None else list(columns)

    def cell(name: str, value: object) -> str:
        if isinstance(value, (bool, np.bool_)):
            return "yes" if value else "no"
        if isinstance(value, (int, np.integer)):
            return f"{int(value):,}"
        if isinstance(value, (float, np.floating)):
            return f"{value:.1%}" if name.endswith("share") else f"{value:.4g}"
        return str(value)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(c, row[c]) for c in columns) + " |" for row in rows]
    return "\n".join(lines)
