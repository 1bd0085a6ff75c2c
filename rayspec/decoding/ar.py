"""Autoregressive (AR) batched greedy decoding with the ragged KV cache: the baseline every speculative method must
reproduce token for token. It is the verify loop without a proposer (:class:`~rayspec.spec_decode.loop.VerifyLoop`)."""

from __future__ import annotations

from typing import Sequence

from ..models.encoded import EncoderOutput

from ..models.whisper import WhisperASR
from ..spec_decode.loop import VerifyLoop
from .common import Hypothesis


def greedy_decode(model: WhisperASR, encoder_output: EncoderOutput, caps: Sequence[int]) -> list[Hypothesis]:
    """Greedy-decode a batch, one target decoder pass per generated token.

    Rows that emit EOS or reach their cap leave the batch at once (their cache rows are dropped), so short
    utterances do not pay for long ones.

    Args:
        model: the target.
        encoder_output: the batch's encoder states (``B`` rows).
        caps: ``B`` caps on generated tokens, EOS not counted (see :func:`~rayspec.decoding.common.token_cap`).

    Returns:
        ``B`` hypotheses, route "ar"; ``stats.target_forward_passes`` = tokens generated (EOS included).
    """
    return VerifyLoop(model).decode(encoder_output, caps)
