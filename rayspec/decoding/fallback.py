"""Temperature fallback, as openai/whisper's ``transcribe`` decides it, for a batch of rows at once.

A row is decoded at the first temperature (0: greedy, or the target's beam search; above 0: one seeded sample). A
row whose text repeats itself (zlib compression ratio above ``compression_ratio_threshold``) or whose average
log-probability is below ``log_prob_threshold`` is decoded again at the next temperature, unless the target judged
it silence (no-speech probability above ``no_speech_threshold`` together with the low log-probability). The rows
that fail re-decode together, in one batch, while the others are final; at a temperature above 0 each failing row
draws ``best_of`` seeded samples (:mod:`rayspec.spec_decode.gumbel`) and keeps the likeliest (openai/whisper's
``MaximumLikelihoodRanker``: summed log-probability over length, or over ``((5 + length) / 6) ** length_penalty``).
A row that fails at every temperature keeps its last decoding, as openai/whisper's does.

Source: openai/whisper ``transcribe.py`` (``decode_with_fallback``) and ``decoding.py`` (``MaximumLikelihoodRanker``);
Radford et al. 2022, arXiv:2212.04356, section 4.5.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from .common import Hypothesis, compression_ratio

COUNTERS = ("target_forward_passes", "draft_forward_passes", "draft_tokens_proposed", "draft_tokens_accepted", "rounds")


@dataclass(frozen=True)
class FallbackOptions:
    """When a decoding is redone at a higher temperature (openai/whisper's ``transcribe`` arguments).

    Attributes:
        temperatures: the temperatures tried in order (``(0.0,)``: no fallback).
        best_of: samples per failing row at a temperature above 0 after the first (the first temperature draws one).
        compression_ratio_threshold: redo a row whose text's zlib compression ratio exceeds this (None: never).
        log_prob_threshold: redo a row whose average log-probability is below this (None: never).
        no_speech_threshold: a row with a no-speech probability above this and a low log-probability is silence:
            kept (None: no such exception).
        length_penalty: ranking of the ``best_of`` samples (None: summed log-probability over length).
        seed: the run's seed (:func:`~rayspec.spec_decode.gumbel.row_seed`).

    Raises:
        ValueError: no temperature, a negative one, temperatures not increasing, or ``best_of < 1``.
    """

    temperatures: tuple[float, ...] = (0.0,)
    best_of: int = 5
    compression_ratio_threshold: Optional[float] = 2.4
    log_prob_threshold: Optional[float] = -1.0
    no_speech_threshold: Optional[float] = 0.6
    length_penalty: Optional[float] = None
    seed: int = 0

    def __post_init__(self):
        t = tuple(float(x) for x in self.temperatures)
        object.__setattr__(self, "temperatures", t)
        if not t or min(t) < 0 or list(t) != sorted(t):
            raise ValueError(f"temperatures must be >= 0 and increasing, e.g. 0,0.2,0.4,0.6,0.8,1.0; got {t}")
        if self.best_of < 1:
            raise ValueError(f"best_of must be >= 1, got {self.best_of}")


def needs_fallback(hyp: Hypothesis, text: str, options: FallbackOptions) -> bool:
    """openai/whisper's test: repetitive or unlikely text, unless the target judged the segment silence."""
    lp, ns = hyp.stats.avg_logprob, hyp.stats.no_speech_prob
    low = options.log_prob_threshold is not None and lp is not None and lp < options.log_prob_threshold
    needs = low or (options.compression_ratio_threshold is not None
                    and compression_ratio(text) > options.compression_ratio_threshold)
    silent = options.no_speech_threshold is not None and ns is not None and ns > options.no_speech_threshold
    return needs and not (silent and low)


def rank(group: Sequence[Hypothesis], length_penalty: Optional[float] = None) -> int:
    """The index of the likeliest hypothesis of ``group`` (summed log-probability over the length penalty; the first
    where a log-probability is unknown)."""
    def score(h: Hypothesis) -> float:
        lp = h.stats.sum_logprob
        if lp is None:
            return float("-inf")
        n = len(h.tokens)
        return lp / (n if length_penalty is None else ((5 + n) / 6) ** length_penalty) if n else lp
    scores = [score(h) for h in group]
    return max(range(len(group)), key=lambda k: (scores[k], -k))


def absorb(into: Hypothesis, spent: Sequence[Hypothesis]) -> Hypothesis:
    """``into`` with the decoder counters of ``spent`` (discarded decodings of the same row) added: a row's NFE
    counts every pass its fallback took."""
    for h in spent:
        if h is into:
            continue
        for name in COUNTERS:
            setattr(into.stats, name, getattr(into.stats, name) + getattr(h.stats, name))
    return into


def decode_with_fallback(first: list[Hypothesis], redo: Callable[[list[int], float, int, int], list[Hypothesis]],
                         text: Callable[[Sequence[int]], str], options: FallbackOptions) -> list[Hypothesis]:
    """Temperature fallback over a batch whose first decoding is done.

    Args:
        first: the ``B`` rows' hypotheses at ``options.temperatures[0]``.
        redo: ``(rows, temperature, attempt, copies) -> hypotheses``: decode the batch rows ``rows`` (indices) again,
            each ``copies`` times in a row (``len(rows) * copies`` hypotheses, a row's copies adjacent, copy ``j``
            seeded with ``(attempt, j)``) at ``temperature``.
        text: token ids -> text (for the compression ratio).

    Returns:
        ``B`` hypotheses, each with ``stats.temperature`` the temperature it was decoded at and the counters of
        every attempt added.
    """
    hyps = list(first)
    start = options.temperatures[0]  # (a row decoded at a request's own temperature is final)
    todo = [i for i, h in enumerate(hyps) if h.stats.temperature == start and needs_fallback(h, text(h.tokens), options)]
    for attempt, t in enumerate(options.temperatures[1:], start=1):
        if not todo:
            break
        copies = options.best_of if t > 0 else 1
        out = redo(todo, t, attempt, copies)
        for k, i in enumerate(todo):
            group = out[k * copies: (k + 1) * copies]
            hyps[i] = absorb(group[rank(group, options.length_penalty)], [hyps[i], *group])
            hyps[i].stats.temperature = t
        todo = [i for i in todo if needs_fallback(hyps[i], text(hyps[i].tokens), options)]
    return hyps
