"""Probes of real pretrained heads, as functions a notebook calls and plots.

They run on any model of :func:`mha.models.load`, by default the embedded MiniLM
(all-MiniLM-L6-v2, 6 layers x 12 heads), always on mha's C kernels. Every function returns
plain NumPy arrays, lists and dicts.

- :func:`head_patterns`: per-head positional pattern scores (local, first token, previous
  token; plus next token and the attention mass on [CLS] and [SEP]) and each head's class.
- :func:`coreference_probe`: "The doctor said that she would help the patient": every layer
  and head whose she -> doctor weight exceeds 0.1.
- :func:`ambiguity_probe` / :func:`ambiguous_sentences`: ambiguous sentences (attachment and
  word-sense ambiguities), with the attention from the ambiguous word to the words of each
  reading, per head.

Word-level weights follow Clark et al. (2019): attention to a word split into subword tokens is
the sum over its tokens, attention from it the mean (:func:`mha.models.aggregate_to_words`).

This module was ``mha.models.probes``; ``from mha.models import probes`` still gives it. It lives
in mha.analysis because it uses mha.analysis, which the models do not import.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping, Sequence

import numpy as np

from .per_head import PATTERNS, attention_mass, dominant_pattern, pattern_scores

if TYPE_CHECKING:
    from ..models import TransformerModel

#: The sentence of the pattern analysis.
PATTERN_TEXT = "The cat sat on the mat because it was tired"
#: The sentence of the coreference probe: "she" refers to "doctor".
COREF_TEXT = "The doctor said that she would help the patient"

#: Ambiguous sentences -> (ambiguous word, words that each reading links it to). The first is
#: a prepositional-phrase attachment ambiguity (man <-> telescope: the man uses the telescope;
#: astronomer <-> telescope: the astronomer has it); the other pairs name a word that each
#: reading ties the ambiguous word to (financial vs geographical bank, tool vs possession, ...).
AMBIGUOUS_SENTENCES = {
    "The man saw the astronomer with a telescope": ("telescope", ("man", "astronomer")),
    "The bank by the river is closed": ("bank", ("river", "closed")),
    "Time flies like an arrow": ("flies", ("time", "like")),
    "The chicken is ready to eat": ("eat", ("chicken", "ready")),
    "I saw the girl with the binoculars": ("binoculars", ("saw", "girl")),
    "The bank by the river flows money": ("bank", ("river", "money")),
    "The guitar player plays the piano player's song": ("song", ("guitar", "piano")),
}

#: Pattern names of :func:`head_patterns`, in tie-break order for ``dominant_with_special``.
PATTERN_NAMES = PATTERNS + ("cls", "sep")

_CLS_TOKENS = ("[CLS]", "<s>", "<cls>")
_SEP_TOKENS = ("[SEP]", "</s>", "<sep>", "<|endoftext|>")


def _model(model: TransformerModel | None) -> TransformerModel:
    if model is None:
        from ..models.loading import load
        return load("minilm")
    return model


def head_patterns(model: TransformerModel | None = None,
                  text: str = PATTERN_TEXT) -> dict[str, Any]:
    """Classify every head of every layer by its attention pattern on ``text``.

    Returns a dict:
      text, tokens (n), attentions (L, H, n, n);
      scores: name -> (L, H) for ``previous_token``, ``next_token``, ``first_token``, ``local``
      (:func:`mha.analysis.pattern_scores`), ``cls`` and ``sep``
      (mean over queries of the weight on [CLS] / [SEP] tokens; 0 if the text has none);
      dominant: (L, H) str, the winner among the positional patterns
      (:func:`mha.analysis.dominant_pattern`);
      dominant_with_special: (L, H) str, the winner when [CLS]/[SEP] mass competes too
      (ties go to the earlier name of :data:`PATTERN_NAMES`).
    """
    model = _model(model)
    tokens, weights = model.attentions(text)
    scores = dict(pattern_scores(weights))
    for name, specials in (("cls", _CLS_TOKENS), ("sep", _SEP_TOKENS)):
        where = np.array([t in specials for t in tokens])
        scores[name] = (attention_mass(weights, where) if where.any()
                        else np.zeros(weights.shape[:2]))
    stacked = np.stack([scores[name] for name in PATTERN_NAMES], axis=-1)
    best = stacked.max(axis=-1, keepdims=True)
    winner = np.argmax(stacked >= best - 1e-9, axis=-1)
    return {
        "text": text,
        "tokens": list(tokens),
        "attentions": weights,
        "scores": {name: np.asarray(scores[name], dtype=np.float64) for name in PATTERN_NAMES},
        "dominant": np.asarray(dominant_pattern(weights)),
        "dominant_with_special": np.asarray(PATTERN_NAMES)[winner],
    }


def _find_word(words: Sequence[str], word: str, what: str) -> int:
    lowered = [w.lower() for w in words]
    target = word.lower()
    if target in lowered:
        return lowered.index(target)
    raise ValueError(f"{what} {word!r} is not a word of the text; words are {words}")


def coreference_probe(model: TransformerModel | None = None, text: str = COREF_TEXT,
                      pronoun: str = "she", antecedent: str = "doctor",
                      threshold: float = 0.1) -> dict[str, Any]:
    """Probe coreference: which heads make ``pronoun`` attend to ``antecedent``?

    Returns a dict:
      text, words (W), word_attentions (L, H, W, W), pronoun_index, antecedent_index;
      weights: (L, H), the pronoun -> antecedent weight of every head;
      hits: [(layer, head, weight)] for every head above ``threshold``, in layer-then-head
      order (empty if none: attention may be spread over heads);
      strongest: (layer, head, weight) of the largest weight.
    """
    model = _model(model)
    words, weights = model.attentions(text, words=True)
    i = _find_word(words, pronoun, "pronoun")
    j = _find_word(words, antecedent, "antecedent")
    she_doctor = np.asarray(weights[:, :, i, j], dtype=np.float64)
    hits = [(int(layer), int(head), float(she_doctor[layer, head]))
            for layer, head in zip(*np.nonzero(she_doctor > threshold))]
    layer, head = np.unravel_index(int(np.argmax(she_doctor)), she_doctor.shape)
    return {
        "text": text, "words": words, "word_attentions": weights,
        "pronoun_index": i, "antecedent_index": j, "threshold": threshold,
        "weights": she_doctor, "hits": hits,
        "strongest": (int(layer), int(head), float(she_doctor[layer, head])),
    }


def ambiguity_probe(model: TransformerModel | None = None,
                    sentence: str = "The man saw the astronomer with a telescope",
                    word: str = "telescope",
                    candidates: Sequence[str] = ("man", "astronomer")) -> dict[str, Any]:
    """How each head links an ambiguous ``word`` to the words of its competing readings.

    Returns a dict:
      sentence, tokens (n), attentions (L, H, n, n) (for a head view), words (W),
      word_attentions (L, H, W, W), word, candidates;
      weights: candidate -> (L, H), attention from ``word`` to that candidate;
      reverse: candidate -> (L, H), attention from the candidate to ``word``;
      preferred: (L, H) str, the candidate each head weights most (from ``word``);
      counts: candidate -> number of heads that prefer it.
    """
    model = _model(model)
    enc = model.encode(sentence)
    words, word_weights = enc.word_attentions()
    i = _find_word(words, word, "word")
    idx = [_find_word(words, c, "candidate") for c in candidates]
    forward = {c: np.asarray(word_weights[:, :, i, j], dtype=np.float64)
               for c, j in zip(candidates, idx)}
    reverse = {c: np.asarray(word_weights[:, :, j, i], dtype=np.float64)
               for c, j in zip(candidates, idx)}
    stacked = np.stack([forward[c] for c in candidates], axis=-1)
    preferred = np.asarray(candidates)[np.argmax(stacked, axis=-1)]
    return {
        "sentence": sentence, "tokens": list(enc.tokens or ()), "attentions": enc.attentions,
        "words": words, "word_attentions": word_weights, "word": word,
        "candidates": tuple(candidates), "weights": forward, "reverse": reverse,
        "preferred": preferred,
        "counts": {c: int((preferred == c).sum()) for c in candidates},
    }


def ambiguous_sentences(
        model: TransformerModel | None = None,
        sentences: Mapping[str, tuple[str, Sequence[str]]] | Sequence[str] | None = None,
) -> list[dict[str, Any]]:
    """Run :func:`ambiguity_probe` on several sentences (default :data:`AMBIGUOUS_SENTENCES`).

    sentences: a dict sentence -> (word, candidates), or a list of sentences from
    AMBIGUOUS_SENTENCES. Returns a list of the probes' dicts, in order.
    """
    model = _model(model)
    if sentences is None:
        sentences = AMBIGUOUS_SENTENCES
    if not isinstance(sentences, dict):
        sentences = {s: AMBIGUOUS_SENTENCES[s] for s in sentences}
    return [ambiguity_probe(model, s, word, tuple(cands))
            for s, (word, cands) in sentences.items()]
