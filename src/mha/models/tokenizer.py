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
    """One tokenized text (or text pair). All lists have one entry per token.

    ids: token ids; tokens: token strings; type_ids: segment ids (0, or 1 for the second text
    of a pair); word_ids: index of the word a token belongs to (None for special tokens);
    sequence_ids: 0 / 1 for the first / second text, None for special tokens; offsets:
    (start, end) character span in the text the token came from; special: True for special
    tokens such as [CLS], [SEP]; texts: the input text(s).
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
    """Text -> tokens and ids, with word boundaries (for word-level attention).

    tokenizer: a ``tokenizers.Tokenizer``; max_length: the model's number of positions.
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
        """Load the tokenizer stored in a Hugging Face model folder."""
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
        return self._tok.token_to_id(token)

    def id_to_token(self, i):
        return self._tok.id_to_token(int(i))

    def convert_ids_to_tokens(self, ids):
        return [self._tok.id_to_token(int(i)) for i in np.asarray(ids).reshape(-1)]

    def decode(self, ids, skip_special_tokens=True):
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def __call__(self, text, pair=None, *, add_special_tokens=True, truncation=False):
        """Tokenize ``text`` (and ``pair``, the second text of a BERT pair) -> TokenizedText.

        A text longer than ``max_length`` tokens raises ValueError unless ``truncation=True``
        (then the tokenizer's longest-first truncation keeps the special tokens).
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
