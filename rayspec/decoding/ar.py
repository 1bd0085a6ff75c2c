"""Autoregressive (AR) batched greedy decoding with the ragged KV cache: the baseline every speculative method must
reproduce token for token."""

from __future__ import annotations

from typing import Sequence

import torch

from ..models.cache import DecoderCache
from ..models.whisper import EncoderOutput, WhisperASR
from .common import Hypothesis


@torch.inference_mode()
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
    b = encoder_output.states.shape[0]
    cache = model.new_cache(encoder_output, len(model.prompt_ids) + max(caps) + 1)
    hyps = [Hypothesis([], False, "ar") for _ in range(b)]
    prompt = torch.tensor(model.prompt_ids, device=cache.lengths.device).expand(b, -1)
    greedy_continue(model, cache, hyps, prompt, caps)
    return hyps


@torch.inference_mode()
def greedy_continue(
    model: WhisperASR, cache: DecoderCache, hyps: list[Hypothesis], tokens: torch.Tensor, caps: Sequence[int]
) -> None:
    """Continue greedy decoding of ``B`` rows from a cache (in place on ``hyps``).

    Args:
        cache: committed up to, but excluding, ``tokens``; rows may have different lengths.
        hyps: per row, tokens generated so far (extended in place; counters updated).
        tokens: int64 ``[B, Q]``, the tokens to feed first (the prompt, or each row's last unseen token).
        caps: per row cap on ``len(hyp.tokens)``.
    """
    dev = cache.lengths.device
    live = torch.arange(len(hyps), device=dev)
    while live.numel():
        q = tokens.shape[1]
        logits = model.decode(cache, tokens)[:, -1]
        cache.commit(torch.arange(q, device=dev).expand(live.numel(), -1), torch.full((live.numel(),), q, device=dev))
        rows = live.tolist()
        first = torch.tensor([len(hyps[r].tokens) == 0 for r in rows], device=dev)
        nxt = model.suppress(logits, first=first).argmax(-1)
        done = []
        for j, (row, tok) in enumerate(zip(rows, nxt.tolist())):
            h = hyps[row]
            h.stats.target_forward_passes += 1
            if tok == model.eos_token_id:
                h.finished = True
            else:
                h.tokens.append(tok)
            done.append(h.finished or len(h.tokens) >= caps[row])
        if any(done):
            keep = torch.tensor([j for j, d in enumerate(done) if not d], dtype=torch.long, device=dev)
            live, nxt, cache = live[keep], nxt[keep], cache.select(keep)
        tokens = nxt[:, None]
