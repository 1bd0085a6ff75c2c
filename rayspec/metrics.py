"""WER and CER after Whisper's English text normalizer (transformers' ``EnglishTextNormalizer`` fed with Whisper's
British->American spelling map, shipped in ``rayspec/data/english_spelling.json``, MIT, OpenAI), and a space-free
CER that does not count how spelled letters and digits are grouped ("U D B E FIVE" vs "UDBE5")."""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from typing import Sequence


def _english_normalizer_class():
    """transformers' ``EnglishTextNormalizer``, loaded from its module file alone where it can be: the module needs
    only the standard library and ``regex``, while importing it through the ``transformers`` package costs 1-1.5 s
    (a Ray job's driver scores its rows and loads no model)."""
    import importlib.util
    import os
    import sys

    name = "transformers.models.whisper.english_normalizer"
    spec = importlib.util.find_spec("transformers") if name not in sys.modules else None
    path = os.path.join(os.path.dirname(spec.origin), "models", "whisper", "english_normalizer.py") if spec else ""
    if not os.path.isfile(path):
        from transformers.models.whisper.english_normalizer import EnglishTextNormalizer

        return EnglishTextNormalizer
    module_spec = importlib.util.spec_from_file_location("rayspec._english_normalizer", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module.EnglishTextNormalizer


@lru_cache(maxsize=1)
def normalizer():
    """Whisper's English text normalizer (lower case, spelled-out numbers to digits, punctuation removed, ...)."""
    spelling = json.loads(resources.files("rayspec.data").joinpath("english_spelling.json").read_text())
    return _english_normalizer_class()(spelling)


def normalize(text: str) -> str:
    return normalizer()(text or "")


def strip_spaces(text: str) -> str:
    """``text`` without white space and hyphens: "u d b e 5", "u-d-b-e-5" and "udbe5" all become "udbe5"."""
    return "".join(text.replace("-", " ").split())


@dataclass(frozen=True)
class ErrorRates:
    """Corpus-level error rates (errors / reference words or characters, jiwer's definition).

    Attributes:
        wer, cer: word and character error rates as fractions (0.05 = 5%).
        n: utterances scored; words: reference words after normalization.
        cer_nospace: character error rate as a fraction after the same folding with all spaces and hyphens removed
            on both sides (:func:`strip_spaces`), so spelled references ("U D B E FIVE" vs "U-D-B-E-5" or "UDBE5";
            "2648" vs "2 6 4 8") count no errors; over the pairs whose stripped reference is not empty (NaN if none).
    """

    wer: float
    cer: float
    n: int
    words: int
    cer_nospace: float = float("nan")


def error_rates(references: Sequence[str], hypotheses: Sequence[str], normalized: bool = True) -> ErrorRates:
    """WER/CER and space-free CER over pairs after normalization. Pairs whose normalized reference is empty are
    skipped (for the space-free CER, pairs whose stripped reference is empty).

    Args:
        normalized: Whisper's normalizer (the open ASR leaderboard's convention); False: only case and white space
            are folded, so spelled-out numbers stay words (e.g. ESPnet's AN4 scoring, where "TWO EIGHTY NINE" is
            three words, not "289"); the space-free CER strips spaces and hyphens after either folding.

    Raises:
        ValueError: different numbers of references and hypotheses.
    """
    import jiwer  # here, not at import: decoding and benchmarking run without it where nothing is scored

    if len(references) != len(hypotheses):
        raise ValueError(f"{len(references)} references but {len(hypotheses)} hypotheses")
    fold = normalize if normalized else (lambda text: " ".join((text or "").lower().split()))
    pairs = [(fold(r), fold(h)) for r, h in zip(references, hypotheses)]
    pairs = [(r, h) for r, h in pairs if r.strip()]
    if not pairs:
        return ErrorRates(float("nan"), float("nan"), 0, 0)
    refs, hyps = [r for r, _ in pairs], [h for _, h in pairs]
    stripped = [(strip_spaces(r), strip_spaces(h)) for r, h in pairs]
    stripped = [(r, h) for r, h in stripped if r]
    cer_nospace = jiwer.cer([r for r, _ in stripped], [h for _, h in stripped]) if stripped else float("nan")
    return ErrorRates(
        jiwer.wer(refs, hyps), jiwer.cer(refs, hyps), len(pairs), sum(len(r.split()) for r in refs), cer_nospace
    )
