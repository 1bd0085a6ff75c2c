"""Autoregressive (AR) batched greedy decoding with the ragged KV cache: the baseline every speculative method must
reproduce token for token."""

from __future__ import annotations

from typing import Sequence

import torch

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
    dev = encoder_output.states.device
    prompt = torch.tensor(model.prompt_ids, device=dev)
    capacity = len(model.prompt_ids) + max(caps) + 1
    cache = model.new_cache(encoder_output, capacity)
    hyps = [Hypothesis([], False, "ar") for _ in range(b)]
    live = torch.arange(b, device=dev)
    cap_t = torch.tensor(list(caps), device=dev)
    tokens = prompt.expand(b, -1)
    step = 0
    while live.numel():
        logits = model.decode(cache, tokens)[:, -1]
        cache.commit(torch.arange(tokens.shape[1], device=dev).expand(live.numel(), -1),
                     torch.full((live.numel(),), tokens.shape[1], device=dev))
        nxt = model.suppress(logits, first=step == 0).argmax(-1)
        step += 1
        done = torch.zeros_like(nxt, dtype=torch.bool)
        for j, row in enumerate(live.tolist()):
            h = hyps[row]
            h.stats.target_forward_passes += 1
            tok = int(nxt[j])
            if tok == model.eos_token_id:
                h.finished = True
                done[j] = True
            else:
                h.tokens.append(tok)
                done[j] = len(h.tokens) >= int(cap_t[row])
        if bool(done.any()):
            keep = (~done).nonzero().squeeze(1)
            live, nxt, cache = live[keep], nxt[keep], cache.select(keep)
        tokens = nxt[:, None]
    return hyps
