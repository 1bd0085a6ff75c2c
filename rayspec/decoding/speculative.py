"""Exact, batched draft-model speculative decoding with SpecASR's three techniques.

Source: SpecASR (Wei et al. 2025, arXiv:2507.18181): IV.A adaptive single-sequence prediction, IV.B draft sequence
recycling, IV.C two-pass sparse token tree; tree attention after SpecInfer. The drafting side is
:class:`~rayspec.decoding.proposer.DraftProposer`; verification is the shared verify loop
(:class:`~rayspec.spec_decode.loop.VerifyLoop`) with greedy acceptance (Leviathan et al. 2023 at temperature 0), so the
output equals the target's own greedy output token for token.
"""

from __future__ import annotations

from typing import Optional, Sequence

from ..models.encoded import EncoderOutput

from ..models.whisper import WhisperASR
from ..spec_decode.loop import VerifyLoop
from .common import Hypothesis
from .proposer import DraftProposer, SpeculationOptions, check_compatible


def speculative_decode(
    target: WhisperASR,
    target_enc: EncoderOutput,
    draft: WhisperASR,
    draft_enc: EncoderOutput,
    caps: Sequence[int],
    options: SpeculationOptions = SpeculationOptions(),
) -> list[Hypothesis]:
    """Exact speculative decoding of a batch: the same tokens as :func:`~rayspec.decoding.ar.greedy_decode`.

    Args:
        target, target_enc: the target model and its encoder output for the batch (``B`` rows).
        draft, draft_enc: the draft model (same tokenizer) and the encoder output it reads for the same rows (its
            own, or ``target_enc`` for a decoder-only draft).
        caps: ``B`` caps on generated tokens (EOS not counted).
        options: :class:`SpeculationOptions`.

    Returns:
        ``B`` hypotheses (route "draft") with NFE, draft passes, proposed/accepted tokens and rounds.

    Raises:
        ValueError: a draft that does not share the target's tokenizer.
    """
    check_compatible(target, draft)
    proposer = DraftProposer(draft, draft_enc, caps, options)
    return draft_loop(target, proposer, options).decode(target_enc, caps)


def draft_loop(target: WhisperASR, proposer, options: SpeculationOptions, max_rows: Optional[int] = None
               ) -> VerifyLoop:
    """The verify loop of draft-model speculation over ``proposer`` (in process or remote), route "draft";
    ``max_rows``: :class:`~rayspec.spec_decode.loop.VerifyLoop`'s (speculate only in rounds with at most this many rows)."""
    return VerifyLoop(target, proposer, max_nodes=options.nodes_per_round, route="draft", max_rows=max_rows)
