"""Batched speculative sampling of speech tokens: the draft proposes, the target verifies, one rejection sampler.

One round for a batch of ragged rows (each row is one sentence with its own number of frames ``T_b``):

1. Propose: the draft samples ``k_b = min(lookahead, T_b - n_b - 1)`` coarse tokens per row (``n_b`` frames done),
   autoregressively over its own short history (no KV cache: the draft is an MLP).
2. Verify: the target runs ``K + 1`` frames per row in one forward pass (the last accepted token, then the draft),
   giving its distribution before each draft token and after the last.
3. Accept: :func:`~rayspec.spec_decode.sampling.rejection_sample` with the chosen ratio (``sd`` token level, ``ssd``
   relaxed, ``pcg`` group level) keeps a prefix and emits one more token.
4. Commit: the KV cache keeps the accepted frames; their coarse tokens and hidden states are stored.

When every row is done the depth head turns each frame's hidden state and coarse token into its 14 fine codes, for
the whole batch at once (fine codes never feed back into the coarse stream); when streaming, it runs once per round
on the frames of every row with a chunk ready, on the caller's worker thread if it gives one (beside the vocoder:
off the critical path of generation).

With no draft (``method="target"``) every round is one frame sampled from the target: the baseline every speed-up is
measured against. Draws are counter-based per (row seed, frame), so a row's audio does not depend on its batch.
"""

from __future__ import annotations

from concurrent.futures import Executor, Future
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import numpy as np
import torch

from ..models.speech_lm import SpeechDraft, SpeechLM, frame_layout, phone_windows
from ..spec_decode.rng import DRAFT, CounterRNG, sample
from ..spec_decode.sampling import AcceptanceRatio, GroupRatio, RelaxedRatio, TokenRatio, rejection_sample, similarity_groups
from .flags import SamplingOptions

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
class _Live:
    """The rows still generating (the cache holds only these); ``rows`` index the batch's full-size tensors."""

    rows: np.ndarray  # [L] original row index
    rows_dev: torch.Tensor  # [L] the same on the device
    seeds: torch.Tensor  # [L] int64
    frames: np.ndarray  # [L] T_b
    done: np.ndarray  # [L] frames emitted


def group_vectors(target: SpeechLM, opts: SamplingOptions, codec=None) -> torch.Tensor:
    """float ``[n_coarse, D]`` token vectors PCG groups are built from (see :attr:`SamplingOptions.groups`).

    Raises:
        ValueError: codec groups without a codec.
    """
    if opts.groups == "target":
        return target.coarse_in.weight[:target.n_coarse].detach()
    if codec is None:
        raise ValueError("pcg with codec groups needs the codec (or groups='target')")
    return torch.from_numpy(codec.coarse_vectors())


def ratio_for(target: SpeechLM, opts: SamplingOptions, codec=None) -> AcceptanceRatio:
    """The acceptance ratio of ``opts.method`` (for PCG, groups at ``opts.theta`` over :func:`group_vectors`)."""
    if opts.method == "pcg":
        return GroupRatio(similarity_groups(group_vectors(target, opts, codec), opts.theta))
    if opts.method == "ssd":
        return RelaxedRatio(opts.beta)
    return TokenRatio()


def _pad(arrays: Sequence[np.ndarray], width: int, value: int = 0) -> torch.Tensor:
    out = np.full((len(arrays), width, *np.asarray(arrays[0]).shape[1:]), value, dtype=np.int64)
    for i, a in enumerate(arrays):
        out[i, :len(a)] = a
    return torch.from_numpy(out)


@torch.no_grad()
def _frame_codes(target: SpeechLM, coarse: torch.Tensor, hidden: torch.Tensor) -> np.ndarray:
    """int64 ``[N, 16]`` Lyra codes of frames: coarse ``[N]`` (codebooks 1-2) + the depth head's 14 fine codebooks
    from their hidden states ``[N, D]``."""
    return torch.cat([torch.stack([coarse // 16, coarse % 16], -1), target.fine_codes(hidden, coarse)],
                     -1).cpu().numpy()


def _emit_chunks(target: SpeechLM, coarse: torch.Tensor, hidden: torch.Tensor, ready: list[tuple[int, int, int]],
                 chunks: list[list[np.ndarray]], on_chunk: Callable[[int, np.ndarray], None]) -> None:
    """The depth head over the frames ``[a, b)`` of each ``(row, a, b)`` in ``ready`` (their coarse tokens ``[N]``
    and hidden states ``[N, D]`` concatenated in that order), each row's codes stored and handed to ``on_chunk``."""
    codes = _frame_codes(target, coarse, hidden)
    for (row, a, b), piece in zip(ready, np.split(codes, np.cumsum([b - a for _, a, b in ready])[:-1])):
        chunks[row].append(piece)
        on_chunk(row, piece)


@torch.no_grad()
def generate(target: SpeechLM, draft: Optional[SpeechDraft], phones: Sequence[np.ndarray],
             durations: Sequence[np.ndarray], seeds: Sequence[int], opts: SamplingOptions,
             ratio: Optional[AcceptanceRatio] = None, on_chunk: Optional[Callable[[int, np.ndarray], None]] = None,
             chunk_frames: int = 10, depth_executor: Optional[Executor] = None) -> list[SpeechTokens]:
    """Sample the speech tokens of a batch of sentences.

    Args:
        target, draft: the TTS models (``draft`` unused for ``method="target"``).
        phones: per row int64 ``[P_b]`` phone ids; durations: per row int64 ``[P_b]`` frames (sum ``T_b >= 1``,
            at most ``target.max_frames``).
        seeds: per row int seed (same seed + text -> same audio, whatever the batch).
        opts: sampling options; ratio: a prebuilt acceptance ratio (default :func:`ratio_for`).
        on_chunk: streaming: called as ``(row, codes)`` with int64 ``[n, 16]`` codes of a row's next frames as soon
            as ``chunk_frames`` (20 ms each) of them are accepted (or half as many, when another row's chunk is due
            in the same round), and with the rest when the row ends; a row's chunks come in order and add up to its
            returned codes.
        depth_executor: streaming only: a one-worker executor that runs the depth head and ``on_chunk`` (in
            submission order, so a row's chunks still come in order) while this thread generates the next frames;
            ``generate`` waits for it before returning. Default: both run on this thread.

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
    cond = target.condition(enc, index, since, to_end)  # [B, Tmax, D]
    if speculative:  # the draft's per-frame share of its first layer, once per frame: [B, Tmax, hidden]
        window = _pad([phone_windows(p, lay[0]) for p, lay in zip(phones, layouts)], tmax).to(dev)  # [B, Tmax, 3]
        draft_frames = draft.frame_features(window, since, to_end)
    seq = torch.full((bsz, context + tmax + look), target.bos, dtype=torch.long, device=dev)  # coarse, BOS-padded
    hidden_all = torch.zeros((bsz, tmax, cond.shape[-1]), dtype=cond.dtype, device=dev)  # accepted frames' states
    passes, proposed, kept = (np.zeros(bsz, dtype=np.int64) for _ in range(3))
    st = _Live(np.arange(bsz), torch.arange(bsz, device=dev), torch.as_tensor(list(seeds), dtype=torch.long,
                                                                             device=dev),
               frames, np.zeros(bsz, dtype=np.int64))
    cache = target.new_cache(bsz, tmax + look + 1, dev, enc.dtype)
    offsets = torch.arange(look + 1, device=dev)
    window_offsets = torch.arange(context, device=dev)
    streamed = np.zeros(bsz, dtype=np.int64)  # frames of each row already given to on_chunk
    chunks: list[list[np.ndarray]] = [[] for _ in range(bsz)]  # the codes given to on_chunk, per row
    depth_jobs: list[Future] = []  # the depth head's calls on depth_executor
    while len(st.rows):
        k = np.minimum(look, st.frames - st.done - 1)  # [L] draft tokens per live row
        kmax = int(k.max())
        n_dev = torch.from_numpy(st.done).to(dev)
        rng = CounterRNG(st.seeds, n_dev, kmax + 1)  # every draw of the round, hashed in one call
        r = st.rows_dev
        steps = n_dev[:, None] + offsets[:kmax + 1]  # [L, K + 1] frames of this round
        at = steps.clamp(max=tmax - 1)
        # 1. propose
        draft_tokens = torch.zeros((len(r), kmax), dtype=torch.long, device=dev)
        draft_probs = torch.zeros((len(r), kmax, target.n_coarse), device=dev)
        u_draft = rng.uniform(DRAFT, kmax)
        for j in range(kmax):
            hist = seq[r[:, None], steps[:, j:j + 1] + window_offsets]  # [L, context] the tokens before frame
            q = (draft.logits(draft_frames[r, at[:, j]], hist) / opts.temperature).softmax(-1)
            draft_probs[:, j], draft_tokens[:, j] = q, sample(q, u_draft[:, j])
            seq[r, context + steps[:, j]] = draft_tokens[:, j]
        # 2. verify: frames n .. n + K, each fed the previous frame's token
        prev = torch.cat([seq[r, context + n_dev - 1][:, None], draft_tokens], 1)
        logits, hidden = target.step(cache, cond[r[:, None], at], prev)
        probs = (logits.float() / opts.temperature).softmax(-1)
        # 3. accept
        out = rejection_sample(probs, draft_probs, draft_tokens, torch.from_numpy(k).to(dev), rng, ratio)
        accepted = out.accepted.cpu().numpy()  # the round's one device-to-host read
        # 4. commit: the cache keeps the accepted frames; their tokens and states are stored for the depth head
        counts = accepted + 1
        cache.commit(np.broadcast_to(np.arange(kmax + 1), (len(r), kmax + 1)), counts)
        emitted = torch.cat([draft_tokens, draft_tokens.new_zeros((len(r), 1))], 1)  # [L, K + 1]
        emitted[torch.arange(len(r), device=dev), out.accepted] = out.next_tokens
        seq[r[:, None], context + steps] = emitted  # past the accepted ones: redrafted before they are read
        keep = offsets[None, :kmax + 1] <= out.accepted[:, None]  # [L, K + 1]
        hidden_all[r[:, None].expand_as(steps)[keep], steps[keep]] = hidden[keep]
        passes[st.rows] += 1
        proposed[st.rows] += k
        kept[st.rows] += accepted
        st.done = st.done + counts
        if on_chunk is not None:  # the due rows' new frames through the depth head in one call, and the rows half-way
            # to a chunk with them: speculative rows fall due in different rounds, and calls for a few rows at a time
            # cost 0.55 s more than target-only's calls on the same frames (30 sentences, batch 16)
            pending = st.done - streamed[st.rows]  # [L] accepted frames not yet given to on_chunk
            due = (pending >= chunk_frames) | (st.done >= st.frames)
            if due.any():
                ride = due | (pending >= (chunk_frames + 1) // 2)
                ready = [(int(row), int(streamed[row]), int(done)) for row, done in zip(st.rows[ride], st.done[ride])]
                coarse = torch.cat([seq[row, context + a:context + b] for row, a, b in ready])  # copies: the job
                states = torch.cat([hidden_all[row, a:b] for row, a, b in ready])  # may run after they change
                if depth_executor is None:
                    _emit_chunks(target, coarse, states, ready, chunks, on_chunk)
                else:
                    depth_jobs.append(depth_executor.submit(_emit_chunks, target, coarse, states, ready, chunks,
                                                            on_chunk))
                for row, _, b in ready:
                    streamed[row] = b
        finished = np.flatnonzero(st.done >= st.frames)
        if len(finished):  # swap-remove in place: only the rows that fill the finished rows' slots move
            live = np.asarray(cache.drop(finished), dtype=np.int64)
            idx = torch.from_numpy(live).to(dev)
            st = _Live(st.rows[live], st.rows_dev[idx], st.seeds[idx], st.frames[live], st.done[live])
    if on_chunk is not None:  # every frame went through the depth head chunk by chunk
        for job in depth_jobs:
            job.result()
        per_row = [np.concatenate(c) for c in chunks]
    else:  # 5. fine codebooks of every frame at once (they do not feed back into the coarse stream)
        mask = torch.arange(tmax, device=dev)[None] < torch.from_numpy(frames).to(dev)[:, None]  # [B, Tmax]
        codes = _frame_codes(target, seq[:, context:context + tmax][mask], hidden_all[mask])
        per_row = np.split(codes, np.cumsum(frames)[:-1])
    return [SpeechTokens(per_row[i], int(passes[i]), int(proposed[i]), int(kept[i])) for i in range(bsz)]
