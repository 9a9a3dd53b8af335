"""The corpus side of head statistics: reading texts (a file, a list, an iterable), checking and
tokenizing them, cutting them into batches by length, and synthetic texts to try it on."""
from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Sequence, Sized, cast

import numpy as np

if TYPE_CHECKING:
    from ..models import TransformerModel

__all__ = ["CorpusError", "synthetic_texts"]

_TOKENIZER_LOCK = threading.Lock()  # truncation switches the shared tokenizer's state


class CorpusError(ValueError):
    """Signal a text of the corpus that cannot be used.

    The text is empty, not a str, or longer than the model's positions; the message names it
    (its index, or line, and its first characters).
    """


def _start(text: object, width: int = 40) -> str:
    """The first characters of an item, for error messages."""
    s = text if isinstance(text, str) else repr(text)
    return repr(s[:width] + ("..." if len(s) > width else ""))


def _tokenize(model: TransformerModel, items: Iterable[tuple[int, object]],
              name: Callable[[int], str], *, truncation: bool, skip_empty: bool, bar: Any = None,
              ) -> tuple[list[np.ndarray], int, int]:
    """Check and tokenize ``items`` ((index, text) pairs) -> (list of id arrays, number of texts
    truncated, number of empty texts skipped). ``name(index)`` names an item in errors."""
    tokenizer = model.tokenizer
    id_dtype = np.min_scalar_type(max(tokenizer.vocab_size, model.config.vocab_size) - 1)
    ids, truncated, skipped = [], 0, 0
    for index, text in items:
        if bar is not None:
            bar.update(1)
        if not isinstance(text, str):
            raise TypeError(f"{name(index)} is a {type(text).__name__}, not a str: {_start(text)}")
        if not text.strip():
            if skip_empty:
                skipped += 1
                continue
            what = "empty" if not text else f"only whitespace ({text[:20]!r})"
            raise CorpusError(f"{name(index)} is {what}; pass skip_empty=True to skip empty "
                              "texts (they are counted in the result's attributes)")
        with _TOKENIZER_LOCK:
            try:
                tokens = tokenizer(text)
            except ValueError as e:                     # longer than the model's positions
                if not truncation:
                    raise CorpusError(f"{name(index)} ({_start(text)}): {e} (it is then "
                                      "counted in the result's attributes)") from None
                tokens = tokenizer(text, truncation=True)
                truncated += 1
        ids.append(np.asarray(tokens.ids, dtype=id_dtype))
    return ids, truncated, skipped


def _batches(ids: Sequence[np.ndarray], batch_size: int, batch_tokens: int | None,
             ) -> list[tuple[np.ndarray, np.ndarray]]:
    """Texts sorted by length (stable) and cut, in that order, into batches of at most
    ``batch_size`` texts and ``batch_tokens`` padded positions (texts x the longest; None: no
    limit; a text longer than that is a batch of its own) -> list of (flat ids, lengths)."""
    lengths = np.array([len(a) for a in ids], dtype=np.int64)
    order = np.argsort(lengths, kind="stable")
    limit = np.inf if batch_tokens is None else batch_tokens
    chunks, start = [], 0
    for stop, i in enumerate(order):                   # lengths[i] is the longest so far
        if stop > start and (stop - start == batch_size or (stop - start + 1) * lengths[i] > limit):
            chunks.append(order[start:stop])
            start = stop
    chunks.append(order[start:])
    return [(np.concatenate([ids[i] for i in chunk]), lengths[chunk]) for chunk in chunks]


def _open_texts(texts: str | os.PathLike[str] | Iterable[object],
                ) -> tuple[Iterator[tuple[int, object]], Callable[[int], str], str, int | None]:
    """-> (items: iterator of (index, text), name(index) for errors, description, size or None)."""
    if isinstance(texts, (str, os.PathLike)):
        path = Path(texts).expanduser()
        if not path.is_file():
            shown = texts if isinstance(texts, os.PathLike) else _start(texts)
            raise FileNotFoundError(
                f"texts={shown} is not an existing file: pass the path of a text file (one "
                "text per line), a list of str, or a dask.bag.Bag")

        # decoded line by line, so that an error names its line
        def lines() -> Iterator[tuple[int, str]]:
            with open(path, "rb") as f:
                for index, raw in enumerate(f):
                    raw = raw[:-1] if raw.endswith(b"\n") else raw
                    raw = raw[:-1] if raw.endswith(b"\r") else raw   # Windows line ends
                    try:
                        yield index, raw.decode("utf-8")
                    except UnicodeDecodeError as e:
                        raise CorpusError(f"line {index + 1} of {path} is not UTF-8 text (byte "
                                          f"{e.start}: {e.reason})") from None

        return lines(), lambda i: f"line {i + 1} of {path}", str(path), None
    if isinstance(texts, dict) or not hasattr(texts, "__iter__"):
        raise TypeError(f"texts must be a list or iterable of str, the path of a text file, or a "
                        f"dask.bag.Bag, got {type(texts).__name__}")
    size = len(cast(Sized, texts)) if hasattr(texts, "__len__") else None
    return enumerate(texts), lambda i: f"texts[{i}]", f"{type(texts).__name__} of str", size


def synthetic_texts(model: TransformerModel, n: int, *, min_tokens: int = 20, max_tokens: int = 200,
                    seed: int | None = 0) -> list[str]:
    """Make deterministic nonsense texts from the model's own vocabulary.

    For trying and timing :func:`~mha.corpus.head_statistics` offline.

    Words are the vocabulary's whole-word alphabetic tokens; a comma follows about one word in
    ten and each text ends with a full stop. The token count (special tokens included) is
    uniform in [min_tokens, max_tokens], exact for WordPiece vocabularies such as MiniLM's.

    Parameters
    ----------
    model : mha.models.TransformerModel
        Its tokenizer gives the words and counts the tokens.
    n : int
        How many texts.
    min_tokens, max_tokens : int
        The range of token counts, special tokens included.
    seed : int
        Seed of the NumPy generator: the same seed gives the same texts.

    Returns
    -------
    texts : list of str
        The n texts.

    Examples
    --------
    >>> model = mha.models.load("minilm")
    >>> texts = synthetic_texts(model, 100, seed=1)
    >>> lengths = [len(model.tokenize(t)) for t in texts]      # [CLS] and [SEP] included
    >>> 20 <= min(lengths) and max(lengths) <= 200, texts == synthetic_texts(model, 100, seed=1)
    (True, True)
    """
    tok = model.tokenizer
    words = sorted({t for t in (tok.id_to_token(i) for i in range(tok.vocab_size))
                    if t and t.isascii() and t.isalpha() and len(t) > 2})
    specials = len(tok("a").ids) - len(tok("a", add_special_tokens=False).ids)
    rng = np.random.default_rng(seed)
    texts = []
    for _ in range(int(n)):
        slots = int(rng.integers(min_tokens, max_tokens + 1)) - specials - 1   # then the "."
        chosen = rng.integers(0, len(words), max(1, slots))
        comma = rng.random(len(chosen)) < 0.1                     # a "," takes a word's slot
        comma[0] = False
        text = "".join(("," if c else " " + words[w]) for w, c in zip(chosen, comma))
        while " " in text.strip() and len(tok(text.strip() + ".").ids) > max_tokens:
            text = text.rsplit(" ", 1)[0]                      # other vocabularies: cut to fit
        texts.append(text.strip() + ".")
    return texts
