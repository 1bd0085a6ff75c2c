"""Batched beam search with openai/whisper's ``BeamSearchDecoder`` semantics.

The algorithm is openai/whisper's (``whisper/decoding.py``: ``BeamSearchDecoder``, ``MaximumLikelihoodRanker``; MIT),
itself the standard left-to-right beam search of neural translation (Graves 2012, arXiv:1211.3711; Wu et al. 2016,
arXiv:1609.08144 for the length penalty), re-implemented here over rayspec's ragged KV cache. For each audio:

1. Every live beam scores its next tokens with ``log_softmax`` of its float32 logits after the logit filters
   (suppress lists, begin-suppression at the first generated position, Whisper's timestamp rules in timestamp
   mode); its ``beam_size + 1`` best tokens become candidates with score ``beam score + log-probability``, summed in
   float32.
2. Candidates are ranked by score (ties keep the beams' order, then the token's rank); walking down the ranking, a
   candidate ending in EOT is collected as *finished* and any other becomes a new beam, until ``beam_size`` beams
   are kept (finished candidates ranked below the last kept beam are not collected).
3. The newly finished are added, best first, while fewer than ``max_candidates = round(beam_size * patience)`` are
   held. The audio is done when that many are held or its beams reach its token cap (openai/whisper's
   ``sample_len``).
4. Done: if fewer than ``beam_size`` finished, the unfinished beams are added best first (their score without an EOT
   term) until there are ``beam_size``; the candidate with the best ``score / penalty`` wins
   (:class:`MaximumLikelihoodRanker`).

Batching: beams are rows of the decoder batch; an audio's rows run together with every other live audio's, and an
audio leaves the batch (its rows dropped from the cache) as soon as it is done, so its result is what it would be
decoded alone (openai/whisper's ``decode`` of one audio). After each step the self-attention KV cache is reordered
by the kept beams' source rows (:meth:`~rayspec.models.cache.DecoderCache.reorder`: only rows whose source changed
are copied, and only their committed positions). The beams of an audio share its cross-attention keys/values: the
prompt pass runs once per audio over the model's usual cache; the beams' cache then holds self-attention rows alone,
and the audio's one copy of cross-attention keys/values (:class:`SharedCross`) is attended by all its beams at once,
their queries grouped into one query block per audio (:func:`grouped_decoder_hidden`: the decoder's layers as
``WhisperASR.decoder_layers`` runs them, with that grouping in cross-attention). Per step a beam then reads no
cross-attention memory of its own (whisper-base holds 37 MB of it per audio in float32, 1,500 positions).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np
import torch

from ..models.cache import DecoderCache, write_slots
from ..models.encoded import EncoderOutput
from ..models.whisper import KEY_BLOCK, WhisperASR
from ..models.whisper_layers import attention_inputs, layer_norm
from ..runner.attention import decode_attention
from ..spec_decode.timestamps import apply_rules, rule_bounds
from .common import DecodeStats, Hypothesis
from .options import BeamOptions

ROUTE = "beam"
TOPK_BLOCK = 512  # columns per block in top_k's first pass


def top_k(x: torch.Tensor, k: int, block: int = TOPK_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """``x.topk(k, dim=-1)`` (largest first) over a long last dimension (a vocabulary), without a partial sort of every
    row: the columns are cut into blocks of ``block`` (the last one shorter), and the ``k`` blocks with the largest
    maxima hold the ``k`` largest values (a value outside them has ``k`` block maxima at least as large above it), so
    a top-k over those ``k`` blocks' columns finds them: one vectorised maximum per block and two small top-ks
    (whisper-base, 5 rows of 51,865 log-probabilities: ~0.2 ms instead of ~0.55 ms, 2 threads).

    Args:
        x: float ``[..., N]``; k: ``1 <= k <= N``.

    Returns:
        ``(values, indices)``, each ``[..., k]``: the same values as ``torch.topk``; among equal values the indices
        picked may differ from its (unspecified) choice. Where a row has fewer than ``k`` values above ``-inf``, the
        result is ``torch.topk``'s own.
    """
    n = x.shape[-1]
    if n < 4 * k * block:
        return x.topk(k, dim=-1)
    whole = n // block
    maxima = x[..., : whole * block].unflatten(-1, (whole, block)).amax(-1)
    if whole * block < n:  # the short last block
        maxima = torch.cat([maxima, x[..., whole * block :].amax(-1, keepdim=True)], -1)
    first = maxima.topk(k, dim=-1).indices * block  # [..., k]: the picked blocks' first columns
    # each picked block's columns; the short last block reads the last `block` columns, those of its
    # neighbour among them masked out (they are the neighbour's, picked or not with it)
    cols = first.clamp(max=n - block)[..., None] + torch.arange(block, device=x.device)  # [..., k, block]
    picked = x.gather(-1, cols.flatten(-2))
    if whole * block < n:
        picked.masked_fill_((cols < first[..., None]).flatten(-2), float("-inf"))
    values, at = picked.topk(k, dim=-1)
    if bool(values[..., -1].isneginf().any()):  # too few values above -inf: a masked column could be picked
        return x.topk(k, dim=-1)
    return values, cols.flatten(-2).gather(-1, at)


@dataclass
class SharedCross:
    """Cross-attention keys/values, one copy per audio, for the beams of the audios (rows in audio order).

    Attributes:
        k, v: one tensor per decoder layer, ``[N, H, S, Dh]`` (the model's dtype); mask: bool ``[N, 1, 1, S]`` or
            None; lengths: int64 numpy ``[N]``, real encoder positions per audio.
    """

    k: list
    v: list
    mask: Optional[torch.Tensor]
    lengths: np.ndarray

    @staticmethod
    def of(cache: DecoderCache) -> "SharedCross":
        """The cross-attention of ``cache``'s rows (one row per audio), not copied."""
        return SharedCross(cache.cross_k, cache.cross_v, cache.cross_mask, cache.cross_lengths)

    def select(self, rows: Sequence[int]) -> "SharedCross":
        """The audios ``rows`` (indices, in that order); no copy when that is all of them in order."""
        if list(rows) == list(range(len(self.lengths))):
            return self
        index = torch.tensor(list(rows), dtype=torch.long, device=self.k[0].device if self.k else None)
        pick = lambda ts: [t.index_select(0, index) for t in ts]  # noqa: E731
        return SharedCross(pick(self.k), pick(self.v), None if self.mask is None else self.mask.index_select(0, index),
                           self.lengths[list(rows)])

    def drop(self, gone: Sequence[int]) -> list[int]:
        """Remove the audios ``gone`` (indices) in place by moving the last surviving audios into their slots
        (swap-remove, as :meth:`~rayspec.models.cache.DecoderCache.drop`): a finished audio costs one audio's copy
        per moved survivor, not a copy of every survivor's keys/values (whisper-base, 15 audios: 550 MB in float32).

        Returns:
            ``order``: audio ``k`` now holds what audio ``order[k]`` held.
        """
        gone_set, n_all = set(int(a) for a in gone), len(self.lengths)
        n = n_all - len(gone_set)
        holes = sorted(h for h in gone_set if h < n)
        tail = [k for k in range(n, n_all) if k not in gone_set]
        order = list(range(n))
        for h, k in zip(holes, tail):
            order[h] = k
        if holes:
            device = self.k[0].device if self.k else None
            src = torch.tensor(tail, dtype=torch.long, device=device)
            dst = torch.tensor(holes, dtype=torch.long, device=device)
            for t in (*self.k, *self.v, *(() if self.mask is None else (self.mask,))):
                t.index_copy_(0, dst, t.index_select(0, src))
        self.k, self.v = [t[:n] for t in self.k], [t[:n] for t in self.v]
        self.mask = None if self.mask is None else self.mask[:n]
        self.lengths = self.lengths[order]
        return order

    def cut(self) -> tuple[list, list, Optional[torch.Tensor]]:
        """Keys, values and mask cut (views) to the longest audio's real positions (as ``DecoderCache.cross``)."""
        s = int(self.lengths.max()) if len(self.lengths) else 0
        if not 0 < s < (self.k[0].shape[2] if self.k else 0):
            return self.k, self.v, self.mask
        return [k[:, :, :s] for k in self.k], [v[:, :, :s] for v in self.v], (
            None if self.mask is None else self.mask[..., :s])


def grouped_decoder_hidden(target: WhisperASR, cache: DecoderCache, tokens: torch.Tensor, cross: SharedCross,
                           groups: list[list[int]]) -> torch.Tensor:
    """The target's decoder over ``Q`` new tokens per row of a self-attention-only cache, each group of rows
    attending to one shared copy of its audio's cross-attention keys/values (their queries stacked into one block of
    ``len(group) * Q`` queries; attention is per query, so this is the same arithmetic up to the order of a kernel's
    sums). The operations and their order are otherwise ``WhisperASR.decoder_layers``'s (inference: no dropout).

    Args:
        cache: ``R`` rows of self-attention keys/values, no cross-attention; its new keys/values become pending.
        tokens: int64 ``[R, Q]``, a causal chain per row (new token ``i`` at position ``lengths[r] + i``).
        cross: ``N`` audios' cross-attention; groups: ``N`` lists of cache rows, group ``a`` attends to audio ``a``.

    Returns:
        Float ``[R, Q, D]``: the last layer's states after the final layer norm.

    Raises:
        ValueError: the cache has pending positions, or positions beyond its capacity.
    """
    t = target
    b, q = tokens.shape
    dev = tokens.device
    lengths = cache.host_lengths
    # A one-token step whose rows all hold the same committed length (beams advance together): every row sees all
    # its keys, so no mask, and the new keys/values go into one slot column (a copy, no scatter).
    level = q == 1 and not t.batch_invariant and b > 0 and not cache.pending and bool((lengths == lengths[0]).all())
    if level:
        at = int(lengths[0])
        top = at + 1
        if top > cache.capacity:
            raise ValueError(f"decoder positions up to {top} exceed the cache capacity {cache.capacity}")
        position = min(at, t.max_target_positions - 1)
        visible = slots = None
        cache.expose(top)
    else:
        positions, slots, top, visible = cache.attention_layout(q, None, None, t.max_target_positions,
                                                                KEY_BLOCK if t.batch_invariant else 1)
    cross_k, cross_v, cross_mask = cross.cut()
    order = [r for g in groups for r in g]
    even = len({len(g) for g in groups}) == 1
    grouped = order != list(range(b))  # rows to put in group order for cross-attention (and back)
    if grouped:
        perm = torch.tensor(order, dtype=torch.long, device=dev)
        back = torch.empty_like(perm)
        back[perm] = torch.arange(b, device=dev)
    dec = t._half("decoder")
    with decode_attention(dev):
        if level:
            x = dec.embed_tokens(tokens) * dec.embed_scale + dec.embed_positions.weight[position]
        else:
            x = dec.embed_tokens(tokens) * dec.embed_scale + dec.embed_positions.weight[positions]
        for i, layer in enumerate(dec.layers):
            attn = layer.self_attn
            qh, kh, vh = attention_inputs(attn, layer_norm(layer.self_attn_layer_norm, x), t._linear)
            qh = t._heads(qh * attn.scaling)
            if level:
                cache.self_k[i][:, :, at:top] = t._heads(kh)
                cache.self_v[i][:, :, at:top] = t._heads(vh)
            else:
                write_slots(cache.self_k[i], slots, t._heads(kh))
                write_slots(cache.self_v[i], slots, t._heads(vh))
            x = t._attend(attn, qh, cache.self_k[i][:, :, :top], cache.self_v[i][:, :, :top], visible, residual=x)

            xattn = layer.encoder_attn
            h = layer_norm(layer.encoder_attn_layer_norm, x)
            if grouped:
                h = h.index_select(0, perm)  # rows in group order
            if even:  # [N, G * Q, D]: each audio's beams as one block of queries
                n, d = len(groups), h.shape[-1]
                hq = t._heads(t._linear(xattn.q_proj, h.reshape(n, -1, d)) * xattn.scaling)
                out = t._attend(xattn, hq, cross_k[i], cross_v[i], cross_mask).reshape(b, q, d)
            else:
                outs, start = [], 0
                for a, g in enumerate(groups):
                    hg = h[start : start + len(g)].reshape(1, -1, h.shape[-1])
                    hq = t._heads(t._linear(xattn.q_proj, hg) * xattn.scaling)
                    m = None if cross_mask is None else cross_mask[a : a + 1]
                    outs.append(t._attend(xattn, hq, cross_k[i][a : a + 1], cross_v[i][a : a + 1], m))
                    start += len(g)
                out = torch.cat(outs, 1).reshape(b, q, -1)
            x = x + (out.index_select(0, back) if grouped else out)

            x = t._add_product(layer.fc2, t._activation_product(layer, layer_norm(layer.final_layer_norm, x)), x)
        hidden = layer_norm(dec.layer_norm, x)
    cache.pending = q
    return hidden


class MaximumLikelihoodRanker:
    """Picks the candidate with the best length-normalised summed log-probability (openai/whisper's ranker).

    Args:
        length_penalty: None: divide by the length in tokens (EOT not counted); ``alpha``: divide by
            ``((5 + length) / 6) ** alpha`` (Wu et al. 2016).
    """

    def __init__(self, length_penalty: Optional[float]) -> None:
        self.length_penalty = length_penalty

    def score(self, sum_logprob: float, length: int) -> float:
        """The ranking score of a candidate of ``length`` tokens. An empty candidate (openai/whisper divides by zero
        there; begin-suppression of EOT keeps real Whisper from producing one) counts as one token long."""
        penalty = max(length, 1) if self.length_penalty is None else ((5 + length) / 6) ** self.length_penalty
        return float(sum_logprob) / penalty

    def rank(self, candidates: Sequence[tuple[Sequence[int], float]]) -> int:
        """Index of the best of ``(tokens, sum_logprob)`` candidates (the first of equals)."""
        scores = [self.score(lp, len(tokens)) for tokens, lp in candidates]
        return int(np.argmax(scores))


@dataclass
class _Beam:
    tokens: list[int]  # generated tokens (no prompt, no EOT)
    logprob: np.float32  # summed log-probability (float32, as openai/whisper's sum_logprobs tensor)


@dataclass
class _Audio:
    """One audio's search state: its beams (best first, as kept), the cache rows holding them, its finished
    candidates (generated tokens -> score with the EOT term, in the order collected)."""

    index: int
    cap: int
    prompt: list[int]
    timestamps: bool
    beams: list[_Beam] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)
    finished: dict = field(default_factory=dict)
    stats: DecodeStats = field(default_factory=DecodeStats)


class BeamSearchDecoder:
    """The host side of beam search for one audio at a time: candidates from each beam's top log-probabilities,
    the kept beams, finished-candidate collection, the stop rule and the final pick (see the module docstring).

    Args:
        options: the beam settings; eot: the end-of-text token id.
    """

    def __init__(self, options: BeamOptions, eot: int) -> None:
        self.options = options
        self.eot = eot
        self.ranker = MaximumLikelihoodRanker(options.length_penalty)

    @property
    def candidates_per_beam(self) -> int:
        return self.options.beam_size + 1

    def update(self, audio: _Audio, logprobs: np.ndarray, tokens: np.ndarray) -> list[int]:
        """One step: replace ``audio.beams`` by the kept candidates and collect the finished ones.

        Args:
            logprobs: float32 ``[N, C]``, each beam's ``C`` best log-probabilities (descending); tokens: int64
                ``[N, C]``, their token ids (``N`` = the audio's beams, in order).

        Returns:
            For each new beam, the index of the beam it extends.
        """
        k = self.options.beam_size
        scores = [(beam.logprob + logprobs[j, c], j, int(tokens[j, c]))
                  for j, beam in enumerate(audio.beams) for c in range(logprobs.shape[1])]
        order = sorted(range(len(scores)), key=lambda i: -scores[i][0])  # stable: ties keep beam, then rank order
        beams, sources, newly = [], [], []
        for i in order:
            score, j, tok = scores[i]
            prefix = audio.beams[j].tokens
            if tok == self.eot:
                newly.append((tuple(prefix), score))
            else:
                beams.append(_Beam(prefix + [tok], np.float32(score)))
                sources.append(j)
                if len(beams) == k:
                    break
        for seq, score in newly:  # already best first
            if len(audio.finished) >= self.options.max_candidates:
                break
            audio.finished[seq] = float(score)
        audio.beams = beams
        return sources

    def done(self, audio: _Audio) -> bool:
        """Whether the audio's search is over: enough finished candidates, its beams at its cap, or no beam left."""
        return (len(audio.finished) >= self.options.max_candidates or not audio.beams
                or len(audio.beams[0].tokens) >= audio.cap)

    def finalize(self, audio: _Audio, route: str = ROUTE) -> Hypothesis:
        """The audio's result: the best finished candidate, with unfinished beams added (best first) while fewer than
        ``beam_size`` finished. ``finished`` is False where an unfinished beam won (it hit the cap)."""
        pool = [(list(seq), lp, True) for seq, lp in audio.finished.items()]
        if len(pool) < self.options.beam_size and audio.beams:
            sums = np.asarray([b.logprob for b in audio.beams], dtype=np.float32)
            for j in np.argsort(sums, kind="stable")[::-1]:
                pool.append((list(audio.beams[j].tokens), float(sums[j]), False))
                if len(pool) >= self.options.beam_size:
                    break
        if not pool:  # only a cap of 0 gets here
            return Hypothesis([], False, route, audio.stats)
        tokens, lp, finished = pool[self.ranker.rank([(t, s) for t, s, _ in pool])]
        audio.stats.sum_logprob = lp
        audio.stats.scored_tokens = len(tokens) + 1  # openai/whisper's avg_logprob: over length + 1
        return Hypothesis(tokens, finished, route, audio.stats)


class BeamSearch:
    """Batched beam search over a Whisper target (see the module docstring).

    Args:
        target: the target model; options: the beam settings.
    """

    route = ROUTE
    max_draft = 0  # most draft tokens a row verifies per pass (cache room past the caps)

    def __init__(self, target: WhisperASR, options: BeamOptions = BeamOptions()) -> None:
        self.target = target
        self.options = options
        self.eot = target.eos_token_id
        self.tt = target.timestamp_tokens
        self.decoder = BeamSearchDecoder(options, self.eot)
        self.cross: Optional[SharedCross] = None  # the live audios' cross-attention, in their order

    @torch.inference_mode()
    def decode(self, enc: EncoderOutput, caps: Sequence[int], prompts: Optional[Sequence[Sequence[int]]] = None
               ) -> list[Hypothesis]:
        """Beam-search ``B`` audios; see :func:`beam_decode`."""
        out, live, cache = self._start(enc, caps, prompts)
        while live:
            live, cache = self._step(live, cache, out)
        return out

    def _start(self, enc: EncoderOutput, caps: Sequence[int], prompts: Optional[Sequence[Sequence[int]]]):
        """Check the arguments, run the prompt pass and the first step. Returns ``(out, live, cache)``: the
        hypotheses so far (None where not done), the live audios, the cache of their beams' rows."""
        t = self.target
        n = enc.states.shape[0]
        prompts = enc.row_prompts(t.prompt_ids) if prompts is None else [list(p) for p in prompts]
        if len(caps) != n or len(prompts) != n:
            raise ValueError(f"{n} encoder rows, {len(caps)} caps and {len(prompts)} prompts")
        if any(c < 0 for c in caps) or any(not p for p in prompts):
            raise ValueError("caps must be >= 0 and prompts non-empty")
        audios = [_Audio(i, int(c), p, self.tt is not None and self.tt.in_timestamp_mode(p))
                  for i, (c, p) in enumerate(zip(caps, prompts))]
        out: list[Optional[Hypothesis]] = [None] * n
        live = [a for a in audios if a.cap > 0]
        for a in audios:
            if a.cap <= 0:
                out[a.index] = Hypothesis([], False, self.route, a.stats)
        if not live:
            return out, [], None
        if len(live) < n:
            enc = enc.select(torch.tensor([a.index for a in live], device=enc.states.device))
        lens = np.asarray([len(a.prompt) for a in live], dtype=np.int64)
        width = int(lens.max())
        cache = t.new_cache(enc, width + max(a.cap for a in live) + 1 + self.max_draft)

        # the prompt pass: each audio's prompt once (right-padded: padding is never attended to, and not committed)
        tokens = torch.tensor([a.prompt + [self.eot] * (width - len(a.prompt)) for a in live], device=cache.device)
        hidden = t.decode_hidden(cache, tokens)  # [N, P, D]
        cache.commit(np.tile(np.arange(width), (len(live), 1)), lens)
        at = torch.arange(len(live), device=cache.device)
        last = hidden[at, torch.from_numpy(lens - 1).to(cache.device)]
        if t.no_speech_token_id is not None:
            sot = int(t.generation_config.decoder_start_token_id)
            where = torch.tensor([a.prompt.index(sot) if sot in a.prompt else 0 for a in live], device=cache.device)
            for a, p in zip(live, t.no_speech_probability(t.project(hidden[at, where])).tolist()):
                a.stats.no_speech_prob = p
        for r, a in enumerate(live):
            a.beams, a.rows = [_Beam([], np.float32(0.0))], [r]
        live, cache = self._advance(live, cache, last, out, first=True)
        return out, live, cache

    def _decode(self, live: list[_Audio], cache, tokens: np.ndarray) -> torch.Tensor:
        """The decoder over ``tokens`` (int64 ``[R, Q]``, a chain per beam row): hidden ``[R, Q, D]``."""
        return grouped_decoder_hidden(self.target, cache, torch.from_numpy(tokens).to(cache.device), self.cross,
                                      [a.rows for a in live])

    def _step(self, live: list[_Audio], cache, out: list) -> tuple[list[_Audio], object]:
        """One decoder pass over every live beam's newest token and one search step."""
        last_tokens = np.empty(cache.batch_size, dtype=np.int64)
        for a in live:
            for j, row in enumerate(a.rows):
                last_tokens[row] = a.beams[j].tokens[-1]
        hidden = self._decode(live, cache, last_tokens[:, None])
        cache.commit(np.zeros((cache.batch_size, 1), dtype=np.int64), np.ones(cache.batch_size, dtype=np.int64))
        return self._advance(live, cache, hidden[:, 0], out)

    def _by_row(self, live: list[_Audio], rows: int) -> list[tuple[_Audio, int]]:
        """``(audio, beam index)`` of each cache row."""
        by_row: list = [None] * rows
        for a in live:
            for j, row in enumerate(a.rows):
                by_row[row] = (a, j)
        return by_row

    def _logprobs(self, hidden: torch.Tensor, by_row: list[tuple[_Audio, int]],
                  drafts: Optional[list[list[int]]] = None) -> tuple[np.ndarray, np.ndarray]:
        """The ``beam_size + 1`` best float32 log-probabilities of the token after each node, and those tokens, on
        the host (one read).

        Args:
            hidden: ``[R, Q, D]``: node 0 of row ``r`` is the newest token of beam ``by_row[r]``, node ``q`` that beam
                extended by ``drafts[r][:q]`` (without drafts ``Q`` = 1).

        Returns:
            float32 ``[R, Q, C]`` and int64 ``[R, Q, C]`` (``C = beam_size + 1``, or the vocabulary if smaller).
        """
        t = self.target
        r, q = hidden.shape[:2]
        first = np.zeros((r, q), dtype=bool)
        first[:, 0] = [not a.beams[j].tokens for a, j in by_row]
        logits = t.suppressed_logits(hidden, first)  # [R, Q, V]
        stamped = [a.timestamps for a, _ in by_row]
        if any(stamped):
            chains = [[a.beams[j].tokens[-1] if a.beams[j].tokens else a.prompt[-1]] + (drafts[k] if drafts else [])
                      for k, (a, j) in enumerate(by_row)]
            tokens = np.full((r, q), self.eot, dtype=np.int64)
            parents = np.full((r, q), -1, dtype=np.int64)
            for k, chain in enumerate(chains):
                tokens[k, : len(chain)] = chain
                parents[k, 1 : len(chain)] = np.arange(len(chain) - 1)
            layout = {"tokens": tokens, "parents": parents, "roots": np.zeros(r, dtype=np.int64),
                      "sizes": np.asarray([len(c) for c in chains], dtype=np.int64)}
            bounds = rule_bounds(layout, [a.beams[j].tokens for a, j in by_row], stamped, self.tt)
            logits = apply_rules(logits.contiguous(), bounds, self.tt)
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        values, ids = top_k(logprobs, min(self.decoder.candidates_per_beam, logprobs.shape[-1]))
        return values.cpu().numpy(), ids.cpu().numpy()

    def _advance(self, live: list[_Audio], cache, hidden: torch.Tensor, out: list, first: bool = False):
        """Score the rows' next tokens (hidden ``[R, D]``, row ``r`` = cache row ``r``), update every audio, finalize
        the done ones and move the cache rows to the kept beams. Returns the audios still live and the cache."""
        values, ids = self._logprobs(hidden[:, None], self._by_row(live, cache.batch_size))
        values, ids = values[:, 0], ids[:, 0]
        plan = []  # (audio, source rows of its new beams)
        for a in live:
            a.stats.target_forward_passes += 1
            rows = a.rows
            sources = self.decoder.update(a, values[rows], ids[rows])
            if self.decoder.done(a):
                out[a.index] = self.decoder.finalize(a, self.route)
            else:
                plan.append((a, [rows[s] for s in sources]))
        if first:  # one row per audio so far: its beams' rows copy its self-attention; cross-attention is shared
            src = [r for _, srcs in plan for r in srcs]
            start = 0
            for a, srcs in plan:
                a.rows = list(range(start, start + len(srcs)))
                start += len(srcs)
            self.cross = SharedCross.of(cache).select([live.index(a) for a, _ in plan])
            return [a for a, _ in plan], (_self_rows(cache, src) if src else cache)
        gather = np.arange(cache.batch_size)
        for a, srcs in plan:
            slots = a.rows[: len(srcs)]
            gather[slots] = srcs
            a.rows = slots
        cache.reorder(gather)
        return self._compact(live, plan, cache)

    def _compact(self, live: list[_Audio], plan: list, cache):
        """Drop the cache rows no kept beam holds and the shared cross-attention of finished audios; returns the
        audios still live (``plan``'s) and the cache."""
        keep = {r for a, _ in plan for r in a.rows}
        gone = [r for r in range(cache.batch_size) if r not in keep]
        if gone:
            order = cache.drop(gone)
            moved = {old: new for new, old in enumerate(order)}
            for a, _ in plan:
                a.rows = [moved[r] for r in a.rows]
        kept = [a for a, _ in plan]
        if len(kept) < len(live):  # the audios' order follows their cross-attention slots
            kept_ids = {id(a) for a in kept}
            order = self.cross.drop([k for k, a in enumerate(live) if id(a) not in kept_ids])
            kept = [live[k] for k in order]
        return kept, cache


def _self_rows(cache: DecoderCache, rows: Sequence[int]) -> DecoderCache:
    """A cache of ``cache``'s self-attention rows ``rows`` (copies of their committed positions; repeats allowed)
    without cross-attention, every layer's keys/values in one buffer (:meth:`DecoderCache.stacked`)."""
    if cache.pending:
        raise ValueError("cannot copy the rows of a cache with pending positions")
    rows = np.asarray(rows, dtype=np.int64)
    return DecoderCache.stacked(cache.self_k, cache.self_v, rows, cache.host_lengths[rows])


def beam_decode(target: WhisperASR, enc: EncoderOutput, caps: Sequence[int], options: BeamOptions = BeamOptions(),
                prompts: Optional[Sequence[Sequence[int]]] = None) -> list[Hypothesis]:
    """Beam-search a batch of audios with openai/whisper's ``BeamSearchDecoder`` semantics (module docstring).

    Args:
        target: the target model.
        enc: its encoder output for ``B`` audios (float states ``[B, S, D]``).
        caps: ``B`` caps on generated tokens, EOT not counted (openai/whisper's ``sample_len``; see
            :func:`~rayspec.decoding.common.token_cap`); a cap of 0 returns an empty unfinished hypothesis.
        options: beam size, patience, length penalty.
        prompts: ``B`` decoder prompts (token ids; any lengths); default: ``enc.prompts``, else the target's prompt.
            A prompt without ``<|notimestamps|>`` decodes with Whisper's timestamp rules.

    Returns:
        ``B`` hypotheses, route "beam", in input order: the chosen candidate's tokens (no prompt, no EOT),
        ``finished`` False where it hit the cap, ``stats.sum_logprob`` its summed log-probability (the EOT term
        included where it finished), ``stats.target_forward_passes`` the decoder passes the audio took part in
        (the prompt pass included), ``stats.no_speech_prob`` from the prompt pass.

    Raises:
        ValueError: ``caps`` or ``prompts`` whose length is not ``B``, a negative cap, an empty prompt.
    """
    return BeamSearch(target, options).decode(enc, caps, prompts)
