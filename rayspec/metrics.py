"""WER and CER after Whisper's English text normalizer (transformers' ``EnglishTextNormalizer`` fed with Whisper's
British->American spelling map, shipped in ``rayspec/data/english_spelling.json``, MIT, OpenAI)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from typing import Sequence

import jiwer


@lru_cache(maxsize=1)
def normalizer():
    """Whisper's English text normalizer (lower case, spelled-out numbers to digits, punctuation removed, ...)."""
    from transformers.models.whisper.english_normalizer import EnglishTextNormalizer

    spelling = json.loads(resources.files("rayspec.data").joinpath("english_spelling.json").read_text())
    return EnglishTextNormalizer(spelling)


def normalize(text: str) -> str:
    return normalizer()(text or "")


@dataclass(frozen=True)
class ErrorRates:
    """Corpus-level error rates (errors / reference words or characters, jiwer's definition).

    Attributes:
        wer, cer: word and character error rates as fractions (0.05 = 5%).
        n: utterances scored; words: reference words after normalization.
    """

    wer: float
    cer: float
    n: int
    words: int


def error_rates(references: Sequence[str], hypotheses: Sequence[str], normalized: bool = True) -> ErrorRates:
    """WER/CER over pairs after normalization. Pairs whose normalized reference is empty are skipped.

    Args:
        normalized: Whisper's normalizer (the open ASR leaderboard's convention); False: only case and white space
            are folded, so spelled-out numbers stay words (e.g. ESPnet's AN4 scoring, where "TWO EIGHTY NINE" is
            three words, not "289").

    Raises:
        ValueError: different numbers of references and hypotheses.
    """
    if len(references) != len(hypotheses):
        raise ValueError(f"{len(references)} references but {len(hypotheses)} hypotheses")
    fold = normalize if normalized else (lambda text: " ".join((text or "").lower().split()))
    pairs = [(fold(r), fold(h)) for r, h in zip(references, hypotheses)]
    pairs = [(r, h) for r, h in pairs if r.strip()]
    if not pairs:
        return ErrorRates(float("nan"), float("nan"), 0, 0)
    refs, hyps = [r for r, _ in pairs], [h for _, h in pairs]
    return ErrorRates(
        jiwer.wer(refs, hyps), jiwer.cer(refs, hyps), len(pairs), sum(len(r.split()) for r in refs)
    )
