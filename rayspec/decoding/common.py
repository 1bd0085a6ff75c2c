"""Shared types of the decoders: per-utterance counters and hypotheses, length caps."""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, field
from typing import Optional

DEFAULT_MAX_TOKENS_PER_SECOND = 30.0
MIN_TOKEN_CAP = 16


@dataclass
class DecodeStats:
    """Counters of one utterance's decoding.

    Attributes:
        target_forward_passes: target decoder calls that included this utterance (NFE). The prompt pass counts.
        draft_forward_passes: draft decoder calls that included this utterance.
        draft_tokens_proposed: draft tokens sent to the target for verification.
        draft_tokens_accepted: of those, tokens the target accepted.
        rounds: draft-then-verify rounds.
        accepted_prefix: for CTC-verified decoding, the length of the verified prefix (tokens), else None.
        ctc_entropy: for CTC-gated decoding, the largest per-frame CTC entropy (nats; the gate's statistic).
        no_speech_prob: the target's probability of ``<|nospeech|>`` at ``<|startoftranscript|>`` in its first pass
            (openai/whisper's ``no_speech_prob``), None without a target pass or such a token.
        sum_logprob: the summed log-probability (nats) of the generated tokens, EOS included, under the target's
            logits after its logit rules at temperature 1 (openai/whisper's ``sum_logprobs``); None where a token was
            decided without the target's full logits (SSD's gate and verified prefixes).
        scored_tokens: the tokens counted in ``sum_logprob`` (EOS included).
        temperature: the sampling temperature of the decoding that produced the hypothesis (0: greedy or beam;
            above 0 after temperature fallback or with ``--temperature``).
    """

    target_forward_passes: int = 0
    draft_forward_passes: int = 0
    draft_tokens_proposed: int = 0
    draft_tokens_accepted: int = 0
    rounds: int = 0
    accepted_prefix: Optional[int] = None
    ctc_entropy: Optional[float] = None
    no_speech_prob: Optional[float] = None
    sum_logprob: Optional[float] = 0.0
    scored_tokens: int = 0
    temperature: float = 0.0

    @property
    def avg_logprob(self) -> Optional[float]:
        """``sum_logprob`` per scored token (openai/whisper's ``avg_logprob``), None where it is unknown."""
        if self.sum_logprob is None or not self.scored_tokens:
            return None
        return self.sum_logprob / self.scored_tokens

    def add_logprob(self, logprob: float) -> None:
        """Count one more generated token's log-probability (no effect once the sum is unknown)."""
        if self.sum_logprob is not None:
            self.sum_logprob += logprob
            self.scored_tokens += 1

    @property
    def acceptance_rate(self) -> float:
        return self.draft_tokens_accepted / self.draft_tokens_proposed if self.draft_tokens_proposed else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per verification round (accepted draft tokens + the target's bonus token)."""
        return (self.draft_tokens_accepted + self.rounds) / self.rounds if self.rounds else 0.0


@dataclass
class Hypothesis:
    """A decoded utterance.

    Attributes:
        tokens: generated token ids, without the prompt and without EOS.
        finished: True if EOS ended it, False if it hit the length cap.
        route: how it was produced ("ar", "draft", "ctc", "verified", "fallback", "beam").
        stats: counters.
    """

    tokens: list[int]
    finished: bool
    route: str
    stats: DecodeStats = field(default_factory=DecodeStats)


def token_cap(duration_s: float, max_tokens_per_second: float, limit: int) -> int:
    """Most tokens to generate for an utterance of ``duration_s`` seconds (against runaway repetition).

    Returns ``min(limit, max(MIN_TOKEN_CAP, ceil(duration_s * max_tokens_per_second)))``, EOS not counted.
    """
    return int(min(limit, max(MIN_TOKEN_CAP, math.ceil(duration_s * max_tokens_per_second))))


def compression_ratio(text: str) -> float:
    """UTF-8 bytes of ``text`` over its zlib-compressed bytes: openai/whisper's repetition statistic (its
    ``compression_ratio_threshold`` of 2.4 marks text that repeats itself, the usual form of a hallucination).
    0.0 for empty text."""
    raw = text.encode("utf-8")
    return len(raw) / len(zlib.compress(raw)) if raw else 0.0
