"""Tokenizer: a thin wrapper over the ``tokenizers`` library for a Hugging Face folder.

Reads ``tokenizer.json`` when present; otherwise builds the tokenizer from ``vocab.txt``
(BERT WordPiece) or ``vocab.json`` + ``merges.txt`` (GPT-2 byte-level BPE). Padding and
truncation stored in the file are switched off (MiniLM's file pads every text to 128 tokens):
mha pads batches itself and truncates only when asked.
"""
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass
class TokenizedText:
    """Hold one tokenized text (or text pair); every list has one entry per token.

    Parameters
    ----------
    ids : list of int
        Token ids.
    tokens : list of str
        Token strings.
    type_ids : list of int
        Segment ids (0, or 1 for the second text of a pair).
    word_ids : list of int or None
        The index of the word a token belongs to (None for special tokens).
    sequence_ids : list of int or None
        0 / 1 for the first / second text, None for special tokens.
    offsets : list of tuple of int
        The (start, end) character span in the text the token came from.
    special : list of bool
        True for special tokens such as [CLS], [SEP].
    texts : tuple of str
        The input text(s).

    Examples
    --------
    >>> tok = Tokenizer.from_folder(mha.models.minilm_path())
    >>> t = tok("Tokenization matters")
    >>> t.tokens, t.word_ids
    (['[CLS]', 'token', '##ization', 'matters', '[SEP]'], [None, 0, 0, 1, None])
    """
    ids: list
    tokens: list
    type_ids: list
    word_ids: list
    sequence_ids: list
    offsets: list
    special: list
    texts: tuple

    def __len__(self):
        return len(self.ids)


class Tokenizer:
    """Turn text into tokens and ids, with word boundaries (for word-level attention).

    Parameters
    ----------
    tokenizer : tokenizers.Tokenizer
        The Hugging Face tokenizer (its padding and truncation are turned off).
    max_length : int, optional
        The model's number of positions: longer texts raise unless truncated.

    Examples
    --------
    >>> tok = mha.models.Tokenizer.from_folder(mha.models.minilm_path(), max_length=512)
    >>> tok("Hello world").tokens
    ['[CLS]', 'hello', 'world', '[SEP]']
    """

    def __init__(self, tokenizer, max_length=None):
        tokenizer.no_padding()
        tokenizer.no_truncation()
        self._tok = tokenizer
        self.max_length = max_length
        self.special_tokens = {
            t.content for t in tokenizer.get_added_tokens_decoder().values() if t.special}

    @classmethod
    def from_folder(cls, folder, max_length=None):
        """Load the tokenizer stored in a Hugging Face model folder.

        Parameters
        ----------
        folder : str or os.PathLike
            A folder with tokenizer.json, vocab.txt (BERT) or vocab.json + merges.txt (GPT-2).
        max_length : int, optional
            The model's number of positions.

        Returns
        -------
        Tokenizer
            The folder's tokenizer.

        Raises
        ------
        FileNotFoundError
            None of those files.
        """
        from tokenizers import Tokenizer as _HFTokenizer

        folder = Path(folder)
        if (folder / "tokenizer.json").is_file():
            return cls(_HFTokenizer.from_file(str(folder / "tokenizer.json")), max_length)
        tok_config = {}
        if (folder / "tokenizer_config.json").is_file():
            tok_config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
        if (folder / "vocab.txt").is_file():
            from tokenizers.implementations import BertWordPieceTokenizer

            impl = BertWordPieceTokenizer(
                str(folder / "vocab.txt"), lowercase=bool(tok_config.get("do_lower_case", True)))
            return cls(impl._tokenizer, max_length)
        if (folder / "vocab.json").is_file() and (folder / "merges.txt").is_file():
            from tokenizers.implementations import ByteLevelBPETokenizer

            impl = ByteLevelBPETokenizer(str(folder / "vocab.json"), str(folder / "merges.txt"))
            if impl.token_to_id("<|endoftext|>") is not None:
                impl.add_special_tokens(["<|endoftext|>"])
            return cls(impl._tokenizer, max_length)
        raise FileNotFoundError(
            f"no tokenizer in {folder}: expected tokenizer.json, vocab.txt (BERT) or "
            f"vocab.json + merges.txt (GPT-2)")

    @property
    def vocab_size(self):
        return self._tok.get_vocab_size()

    def token_to_id(self, token):
        """Look up the id of a token.

        Parameters
        ----------
        token : str
            A token of the vocabulary.

        Returns
        -------
        int or None
            Its id, or None when the vocabulary has no such token.
        """
        return self._tok.token_to_id(token)

    def id_to_token(self, i):
        """Look up the token of an id.

        Parameters
        ----------
        i : int
            A token id.

        Returns
        -------
        str or None
            The token, or None for an id outside the vocabulary.
        """
        return self._tok.id_to_token(int(i))

    def convert_ids_to_tokens(self, ids):
        """Look up the tokens of many ids.

        Parameters
        ----------
        ids : array_like of int
            Token ids (flattened).

        Returns
        -------
        list of str
            One token per id.
        """
        return [self._tok.id_to_token(int(i)) for i in np.asarray(ids).reshape(-1)]

    def decode(self, ids, skip_special_tokens=True):
        """Turn ids back into text.

        Parameters
        ----------
        ids : sequence of int
            Token ids.
        skip_special_tokens : bool, default True
            Leave [CLS], [SEP], ``<|endoftext|>`` and the like out.

        Returns
        -------
        str
            The text.
        """
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def __call__(self, text, pair=None, *, add_special_tokens=True, truncation=False):
        """Tokenize a text, or a sentence pair.

        Parameters
        ----------
        text : str
            The text.
        pair : str, optional
            The second text of a BERT pair.
        add_special_tokens : bool, default True
            Add [CLS], [SEP] or the model's own special tokens.
        truncation : bool, default False
            Cut a text longer than ``max_length`` (longest first, special tokens kept).

        Returns
        -------
        TokenizedText
            Ids, tokens and word boundaries.

        Raises
        ------
        TypeError
            A text that is not a str.
        ValueError
            A text longer than ``max_length`` tokens without ``truncation``.
        """
        if not isinstance(text, str) or (pair is not None and not isinstance(pair, str)):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        if truncation and self.max_length:
            self._tok.enable_truncation(max_length=self.max_length)
        try:
            enc = self._tok.encode(text, pair, add_special_tokens=add_special_tokens)
        finally:
            self._tok.no_truncation()
        if self.max_length and len(enc.ids) > self.max_length:
            raise ValueError(
                f"text has {len(enc.ids)} tokens but the model has {self.max_length} positions; "
                f"pass truncation=True to cut it")
        special = [bool(s) for s in enc.special_tokens_mask]
        return TokenizedText(
            ids=list(enc.ids), tokens=list(enc.tokens), type_ids=list(enc.type_ids),
            word_ids=[None if s else w for w, s in zip(enc.word_ids, special)],
            sequence_ids=[None if s else q for q, s in zip(enc.sequence_ids, special)],
            offsets=[tuple(o) for o in enc.offsets], special=special,
            texts=(text,) if pair is None else (text, pair))
