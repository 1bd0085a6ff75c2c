"""Batched speculative sampling of speech tokens: the draft proposes, the target verifies, one rejection sampler.

One round for a batch of ragged rows (each row is one sentence with its own number of frames ``T_b``):

1. Propose: the draft samples ``k_b = min(lookahead, T_b - n_b - 1)`` coarse tokens per row (``n_b`` frames done),
   autoregressively over its own short history (no KV cache: the draft is an MLP).
2. Verify: the target runs ``K + 1`` frames per row in one forward pass (the last accepted token, then the draft),
   giving its distribution before each draft token and after the last.
3. Accept: :func:`~rayspec.spec.sampling.rejection_sample` with the chosen ratio (``sd`` token level, ``ssd``
   relaxed, ``pcg`` group level) keeps a prefix and emits one more token.
4. Commit: the KV cache keeps the accepted frames; the depth head turns each accepted frame's hidden state and coarse
   token into its 14 fine codes.

With no draft (``method="target"``) every round is one frame sampled from the target: the baseline every speed-up is
measured against. Draws are counter-based per (row seed, frame), so a row's audio does not depend on its batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np
import torch

from ..models.speech_lm import SpeechDraft, SpeechLM, frame_layout, phone_windows
from ..spec.rng import DRAFT, CounterRNG, sample
from ..spec.sampling import AcceptanceRatio, GroupRatio, RelaxedRatio, TokenRatio, rejection_sample, similarity_groups

METHODS = ("target", "sd", "ssd", "pcg")


@dataclass(frozen=True)
class SamplingOptions:
    """How speech tokens are sampled.

    Attributes:
        method: "target" (target-only sampling), "sd" (exact speculative sampling), "ssd" (relaxed by ``beta``) or
            "pcg" (group-level acceptance over similarity groups at ``theta``).
        temperature: softmax temperature of target and draft (> 0).
        lookahead: draft tokens per round (the paper's gamma; PCG paper: 3).
        beta: ``ssd``'s additive relaxation.
        theta: ``pcg``'s cosine threshold for the groups (> 1 makes every group one token: ``sd``).
    """

    method: str = "pcg"
    temperature: float = 0.8
    lookahead: int = 3
    beta: float = 0.3
    theta: float = 0.6

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"unknown sampling method {self.method!r}; choose from {', '.join(METHODS)}")
        if self.temperature <= 0:
            raise ValueError("temperature must be > 0")
        if self.lookahead < 0 or (self.method != "target" and self.lookahead == 0):
            raise ValueError("lookahead must be >= 1 for speculative methods")


@dataclass
class SpeechTokens:
    """One row's generated tokens and counts.

    Attributes:
        codes: int64 ``[T, 16]`` Lyra codes (coarse token split into codebooks 1-2, then the 14 fine codebooks).
        target_passes: target forward passes (NFE) this row took part in.
        draft_proposed / draft_accepted: draft tokens proposed / kept.
    """

    codes: np.ndarray
    target_passes: int = 0
    draft_proposed: int = 0
    draft_accepted: int = 0


@dataclass
class _Batch:
    seeds: torch.Tensor  # [B] int64
    frames: np.ndarray  # [B] T_b
    done: np.ndarray  # [B] n_b frames emitted
    cond: torch.Tensor  # [B, Tmax, D]
    window: torch.Tensor  # [B, Tmax, 3]
    since: torch.Tensor  # [B, Tmax]
    to_end: torch.Tensor  # [B, Tmax]
    seq: torch.Tensor  # [B, context + Tmax + lookahead] coarse tokens, BOS-padded on the left
    rows: list[int] = field(default_factory=list)  # original row index of each live row


def ratio_for(target: SpeechLM, opts: SamplingOptions) -> AcceptanceRatio:
    """The acceptance ratio of ``opts.method`` (groups from the target's coarse input embeddings for PCG)."""
    if opts.method == "pcg":
        return GroupRatio(similarity_groups(target.coarse_in.weight[:target.n_coarse].detach(), opts.theta))
    if opts.method == "ssd":
        return RelaxedRatio(opts.beta)
    return TokenRatio()


def _pad(arrays: Sequence[np.ndarray], width: int, value: int = 0) -> torch.Tensor:
    out = np.full((len(arrays), width, *np.asarray(arrays[0]).shape[1:]), value, dtype=np.int64)
    for i, a in enumerate(arrays):
        out[i, :len(a)] = a
    return torch.from_numpy(out)


@torch.no_grad()
def generate(target: SpeechLM, draft: Optional[SpeechDraft], phones: Sequence[np.ndarray],
             durations: Sequence[np.ndarray], seeds: Sequence[int], opts: SamplingOptions,
             ratio: Optional[AcceptanceRatio] = None) -> list[SpeechTokens]:
    """Sample the speech tokens of a batch of sentences.

    Args:
        target, draft: the TTS models (``draft`` unused for ``method="target"``).
        phones: per row int64 ``[P_b]`` phone ids; durations: per row int64 ``[P_b]`` frames (sum ``T_b >= 1``,
            at most ``target.max_frames``).
        seeds: per row int seed (same seed + text -> same audio, whatever the batch).
        opts: sampling options; ratio: a prebuilt acceptance ratio (default :func:`ratio_for`).

    Returns:
        One :class:`SpeechTokens` per row, in order.

    Raises:
        ValueError: a row with no frame or more than ``target.max_frames``.
    """
    frames = np.asarray([int(np.sum(d)) for d in durations], dtype=np.int64)
    if (frames < 1).any() or (frames > target.max_frames).any():
        raise ValueError(f"frames per row must be 1..{target.max_frames}, got {frames.tolist()}")
    speculative = opts.method != "target"
    if speculative and draft is None:
        raise ValueError(f"method {opts.method!r} needs a draft model")
    ratio = ratio or ratio_for(target, opts)
    dev = next(target.parameters()).device
    bsz, tmax, look = len(phones), int(frames.max()), opts.lookahead if speculative else 0
    context = draft.context if speculative else 1
    layouts = [frame_layout(d) for d in durations]
    pm = _pad([np.ones(len(p)) for p in phones], max(len(p) for p in phones)).bool().to(dev)
    enc = target.encode_phones(_pad(phones, pm.shape[1]).to(dev), pm)
    index, since, to_end = (_pad([lay[i] for lay in layouts], tmax).to(dev) for i in range(3))
    window = _pad([phone_windows(p, lay[0]) for p, lay in zip(phones, layouts)], tmax).to(dev)
    seq = torch.full((bsz, context + tmax + look), target.bos, dtype=torch.long, device=dev)
    st = _Batch(torch.as_tensor(list(seeds), dtype=torch.long, device=dev), frames, np.zeros(bsz, dtype=np.int64),
                target.condition(enc, index, since, to_end), window, since, to_end, seq, list(range(bsz)))
    cache = target.new_cache(bsz, tmax + look + 1, dev, enc.dtype)
    results = [SpeechTokens(np.zeros((f, 2 + target.n_fine), dtype=np.int64)) for f in frames]
    while st.rows:
        k = np.minimum(look, st.frames - st.done - 1)  # [B] draft tokens per live row
        kmax = int(k.max())
        n_dev = torch.from_numpy(st.done).to(dev)
        rng = CounterRNG(st.seeds, n_dev)
        b = len(st.rows)
        rows_dev = torch.arange(b, device=dev)
        # 1. propose
        draft_tokens = torch.zeros((b, kmax), dtype=torch.long, device=dev)
        draft_probs = torch.zeros((b, kmax, target.n_coarse), device=dev)
        u_draft = rng.uniform(DRAFT, kmax)
        steps = n_dev[:, None] + torch.arange(kmax + 1, device=dev)  # [B, K + 1] frames of this round
        for j in range(kmax):
            t = steps[:, j].clamp(max=tmax - 1)
            hist = st.seq[rows_dev[:, None], steps[:, j:j + 1] + torch.arange(context, device=dev)]
            q = (draft(st.window[rows_dev, t], st.since[rows_dev, t], st.to_end[rows_dev, t], hist)
                 / opts.temperature).softmax(-1)
            draft_probs[:, j], draft_tokens[:, j] = q, sample(q, u_draft[:, j])
            st.seq[rows_dev, context + steps[:, j]] = draft_tokens[:, j]
        # 2. verify: frames n .. n + K, each fed the previous frame's token
        prev = torch.cat([st.seq[rows_dev, context + n_dev - 1][:, None], draft_tokens], 1)
        logits, hidden = target.step(cache, st.cond[rows_dev[:, None], steps.clamp(max=tmax - 1)], prev)
        probs = (logits.float() / opts.temperature).softmax(-1)
        # 3. accept
        out = rejection_sample(probs, draft_probs, draft_tokens, torch.from_numpy(k).to(dev), rng, ratio)
        accepted = out.accepted.cpu().numpy()  # the round's one device-to-host read (+ the codes below)
        # 4. commit
        counts = accepted + 1
        cache.commit(np.broadcast_to(np.arange(kmax + 1), (b, kmax + 1)), counts)
        emitted = torch.cat([draft_tokens, draft_tokens.new_zeros((b, 1))], 1)  # [B, K + 1]
        emitted[rows_dev, out.accepted] = out.next_tokens
        st.seq[rows_dev[:, None], context + steps] = emitted  # past the accepted ones: redrafted before read
        keep = torch.arange(kmax + 1, device=dev)[None] <= out.accepted[:, None]  # [B, K + 1]
        fine = target.fine_codes(hidden[keep], emitted[keep]).cpu().numpy()
        coarse = emitted[keep].cpu().numpy()
        pos = 0
        for i, r in enumerate(st.rows):
            res, c = results[r], int(counts[i])
            res.codes[st.done[i]:st.done[i] + c, 0] = coarse[pos:pos + c] // 16
            res.codes[st.done[i]:st.done[i] + c, 1] = coarse[pos:pos + c] % 16
            res.codes[st.done[i]:st.done[i] + c, 2:] = fine[pos:pos + c]
            res.target_passes += 1
            res.draft_proposed += int(k[i])
            res.draft_accepted += int(accepted[i])
            pos += c
        st.done = st.done + counts
        live = np.flatnonzero(st.done < st.frames)
        if len(live) < b:
            idx = torch.from_numpy(live).to(dev)
            cache = cache.select(live)
            st = _Batch(st.seeds[idx], st.frames[live], st.done[live], st.cond[idx], st.window[idx], st.since[idx],
                        st.to_end[idx], st.seq[idx], [st.rows[i] for i in live])
    return results
