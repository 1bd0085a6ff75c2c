"""The drafting side of draft-model speculative decoding: a proposer that owns the draft model's KV cache.

Source: SpecASR (Wei et al. 2025, arXiv:2507.18181): IV.A adaptive single-sequence prediction, IV.B draft sequence
recycling, IV.C two-pass sparse token tree. The verify loop (:class:`~rayspec.spec_decode.loop.VerifyLoop`)
and the proposer only exchange small per-row messages (:class:`~rayspec.spec_decode.loop.DraftRequest` in, a
:class:`~rayspec.spec_decode.loop.Proposal` token tree out, :class:`~rayspec.spec_decode.loop.Feedback` back), so the proposer can
run in the verifier's process or in another Ray actor on another GPU (``actors/drafter.py``), as vLLM's
``v1/spec_decode`` separates proposers from its rejection sampler. The verifier knows nothing of the strategy: the
proposer turns the feedback (which of its nodes were kept) into its own draft-cache rollback and recycling state.

One call of :meth:`DraftProposer.propose`, for every live row of the batch at once:

1. The trunk: the draft catches up on the tokens of the row's sequence it has not seen (ragged, one pass), then
   proposes greedily, one batched draft pass per position, until its top-1 probability drops below ``threshold``,
   it proposes EOS, or ``max_draft`` / the row's room is reached. With recycling, a new draft token that re-joins
   last round's rejected suffix (same or adjacent position) ends drafting: the rest of the old suffix is reused
   without draft passes.
2. The branches: at up to ``tree_branches`` trunk positions whose top-1 probability is below ``tree_threshold``,
   the 2nd-best token starts a branch, drafted greedily from a forked draft cache (all branches of all rows in one
   batch); a branch that re-joins the trunk reuses the rest of the trunk.
3. The tree: trunk nodes form a chain under the row's root; branch ``(i, tokens)`` hangs under trunk node ``i - 1``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np
import torch

from ..models.cache import DecoderCache
from ..models.errors import ModelPairingError
from ..models.encoded import EncoderOutput
from ..models.whisper import WhisperASR
from ..spec_decode.loop import DraftRequest, Feedback, Proposal
from ..spec_decode.tree import DraftTree
from .options import SpeculationOptions


@dataclass
class _Sent:
    """What the proposer sent for one row last round (to interpret the verifier's feedback).

    Attributes:
        seq_len: length of the row's sequence the proposal continued.
        trunk: the greedy draft continuation; fed: leading trunk tokens whose draft keys/values sit in the cache.
        branches: ``(i, tokens)``, a branch replacing the trunk from position ``i`` on.
    """

    seq_len: int
    trunk: list[int]
    fed: int
    branches: list[tuple[int, list[int]]]

    def tree(self) -> DraftTree:
        tokens, parents = list(self.trunk), list(range(-1, len(self.trunk) - 1))
        for i, br in self.branches:
            prev = i - 1
            for t in br:
                parents.append(prev)
                prev = len(tokens)
                tokens.append(t)
        return DraftTree(tuple(tokens), tuple(parents))

    def followed(self, last_node: int) -> list[int]:
        """The draft sequence (trunk or trunk prefix + branch) that node ``last_node`` of :meth:`tree` lies on."""
        n = len(self.trunk)
        for i, br in self.branches:
            if n <= last_node < n + len(br):
                return self.trunk[:i] + br
            n += len(br)
        return self.trunk


def check_compatible(target: WhisperASR, draft: WhisperASR) -> None:
    """Check that draft and target share the tokenizer (prompt ids, EOS and vocabulary size) and that a decoder-only
    draft (``WhisperForCausalLM``) reads encoder states of the target's width.

    Raises:
        ModelPairingError: (a ``ValueError``) naming what differs, e.g. a tiny.en draft (English-only vocabulary)
            for a multilingual base target.
    """
    pair = f"draft {draft.name or '?'} and target {target.name or '?'}"
    if draft.prompt_ids != target.prompt_ids or draft.eos_token_id != target.eos_token_id:
        raise ModelPairingError(f"{pair} must share the tokenizer: prompt ids {draft.prompt_ids} vs "
                                f"{target.prompt_ids}, EOS {draft.eos_token_id} vs {target.eos_token_id}")
    if draft.vocab_size != target.vocab_size:
        raise ModelPairingError(f"{pair}: vocabulary sizes differ: target {target.vocab_size}, draft "
                                f"{draft.vocab_size}")
    if not draft.has_encoder and draft.config.d_model != target.config.d_model:
        raise ModelPairingError(f"{pair}: a decoder-only draft reads the target's encoder states: its width "
                                f"{draft.config.d_model} differs from the target's {target.config.d_model}")


def rejoin(new: list[int], old: list[int]) -> Optional[int]:
    """Index in ``old`` right after a re-join of the newest token of ``new`` with ``old``, else None.

    ``new[-1]`` sits at the position of ``old[len(new) - 1]``; it re-joins if it equals the old token at the same or
    an adjacent position (SpecASR IV.B: the correction was a substitution, insertion or deletion).
    """
    i = len(new) - 1
    for j in (i, i - 1, i + 1):
        if 0 <= j < len(old) and old[j] == new[-1]:
            return j + 1
    return None


@dataclass
class _Work:
    """A row being drafted: its request, its draft so far and per-position draft statistics."""

    req: DraftRequest
    out: _Sent
    valid: int  # leading tokens of req.seq whose draft keys/values are correct
    old_suffix: list[int]  # last round's rejected draft continuation (recycling, IV.B)
    passes: int = 0
    p1: list[Optional[float]] = field(default_factory=list)  # top-1 probability per trunk token (None: recycled)
    alt: list[int] = field(default_factory=list)  # 2nd-best token per trunk position
    drafting: bool = True


class DraftProposer:
    """Proposes draft token trunks and branches for the rows of one batch (see the module docstring).

    Args:
        draft: the draft model; draft_enc: its encoder output for the batch (``B`` rows, any device), or None for a
            proposer whose rows all arrive through :meth:`admit` (continuous batching).
        caps: ``B`` caps on generated tokens (size the draft KV cache; with ``draft_enc`` None, the largest cap of
            any row to come).
        options: :class:`SpeculationOptions`.
    """

    def __init__(self, draft: WhisperASR, draft_enc: Optional[EncoderOutput], caps: Sequence[int],
                 options: SpeculationOptions) -> None:
        self.draft, self.opt = draft, options
        self.eos = draft.eos_token_id
        self.prompt_len = len(draft.prompt_ids)
        self.capacity = self.prompt_len + max(caps) + options.max_draft + options.branch_max + 2
        self.shortlist = options.vocabulary and draft.vocabulary is not None
        self.cache: Optional[DecoderCache] = None
        self.rows: list = []  # row id of each cache row
        self.sent: dict[int, _Sent] = {}  # last round's draft per row
        self.valid: dict[int, int] = {}  # leading sequence tokens with correct draft keys/values, per row
        self.old_suffix: dict[int, list[int]] = {}  # rejected draft continuation per row (recycling)
        # encoder states [1, S, D] of rows whose cross-attention keys/values are not computed yet: a row's are
        # computed the first round it speculates (rows the speculation rule never starts never are)
        self.uncrossed: dict[int, torch.Tensor] = {}
        self.blanked: set = set()  # rows of uncrossed whose cross-attention keys/values were zeroed
        if draft_enc is not None:
            self.admit(list(range(len(caps))), list(range(len(caps))), draft_enc)

    def admit(self, slots: list[int], ids: list, draft_enc: EncoderOutput) -> None:
        """Take new rows ``ids`` (the verify loop's row keys) into cache rows ``slots`` (``0 .. R-1`` on an empty
        proposer), replacing finished rows there or, past the last row, appending; ``draft_enc``: the draft's encoder
        output for them (``R`` rows)."""
        enc = draft_enc.to(self.draft.device)
        self.uncrossed.update((key, enc.states[k : k + 1]) for k, key in enumerate(ids))
        if self.cache is None:
            self.cache, self.rows = self.draft.new_cache(enc, self.capacity, cross=False), list(ids)
            return
        if max(slots) >= len(self.rows):
            grow = max(slots) + 1 - len(self.rows)
            self.cache.extend(grow)
            self.rows += [None] * grow
        self.cache.place(slots, self.draft.new_cache(enc, 1, cross=False))
        for slot, key in zip(slots, ids):
            self.rows[slot] = key

    @torch.inference_mode()
    def propose(self, requests: list[DraftRequest]) -> list[Proposal]:
        """Draft for the live rows in ``requests`` (rows still held, in the verify loop's order; rows not requested
        are freed with the same swap-remove as the loop's cache, so both keep one row order).

        Raises:
            ValueError: a request for a row this proposer no longer holds.
        """
        wanted = [r.index for r in requests]
        if wanted != self.rows:
            held = set(wanted)
            missing = held - set(self.rows)
            if missing:
                raise ValueError(f"row {missing.pop()} is not held by this proposer")
            order = self.cache.drop([k for k, key in enumerate(self.rows) if key not in held])
            self.rows = [self.rows[k] for k in order]
            if self.rows != wanted:  # a different order than the loop's (not from the verify loop): reorder
                pos = {key: k for k, key in enumerate(self.rows)}
                self.cache, self.rows = self.cache.select([pos[key] for key in wanted]), wanted
            live = set(self.rows)
            self.valid = {k: v for k, v in self.valid.items() if k in live}
            self.old_suffix = {k: v for k, v in self.old_suffix.items() if k in live}
            self.uncrossed = {k: v for k, v in self.uncrossed.items() if k in live}
            self.blanked &= live
        if not any(r.speculate for r in requests):  # a round without drafts: no draft pass; the cache stays valid
            self.sent = {r.index: _Sent(self.valid.get(r.index, 0), [], 0, []) for r in requests}
            return [Proposal() for _ in requests]
        self._cross({r.index for r in requests if r.speculate})  # the rows that draft are fed below, the others padding
        # at least the newest token is fed (a row's sequence may not have grown past the kept draft tokens: with
        # timestamps the drafter sees the text alone, rayspec.spec_decode.timestamps.TimestampProposer); a row that
        # does not speculate is fed padding in the shared passes (no catch-up, no cross-attention keys/values) and
        # keeps its valid draft keys/values where they were
        work = []
        for r in requests:
            valid = min(self.valid.get(r.index, 0), len(r.seq) - 1)
            work.append(_Work(r, _Sent(len(r.seq) if r.speculate else valid, [], 0, []), valid,
                              self.old_suffix.get(r.index, []), drafting=r.speculate))
        self.cache.crop([w.valid for w in work])
        self._trunk(work)
        if self.opt.tree and self.opt.tree_branches:
            self._branches(work)
        self.sent = {w.req.index: w.out for w in work}
        return [Proposal(w.out.tree(), w.passes) for w in work]

    def update(self, feedback: list[Feedback]) -> None:
        """Roll the draft cache back to the kept part of the trunk and keep the rejected continuation of the
        followed sequence for recycling (SpecASR IV.B)."""
        for f in feedback:
            sent = self.sent[f.index]
            tree = sent.tree()
            accepted = [tree.tokens[a] for a in f.accepted]
            followed = sent.followed(f.accepted[-1]) if f.accepted else sent.trunk
            self.old_suffix[f.index] = followed[len(accepted) + 1 :] if len(accepted) < len(followed) else []
            common = 0  # the draft cache is valid along the trunk tokens it was fed
            while common < min(len(accepted), sent.fed) and accepted[common] == sent.trunk[common]:
                common += 1
            self.valid[f.index] = sent.seq_len + common

    def _cross(self, keys: set) -> None:
        """Compute the cross-attention keys/values of the held rows ``keys`` that lack them (one pass per encoder
        length); zero those of the other rows that lack them (uninitialised memory, which the padding they are fed
        would read), once per row."""
        groups: dict[int, list[tuple[int, torch.Tensor]]] = {}
        blank = []
        for slot, key in enumerate(self.rows):
            if key in keys and key in self.uncrossed:
                states = self.uncrossed.pop(key)
                groups.setdefault(states.shape[1], []).append((slot, states))
            elif key in self.uncrossed and key not in self.blanked:
                blank.append(slot)
                self.blanked.add(key)
        if blank:
            index = torch.tensor(blank, dtype=torch.long, device=self.cache.device)
            for t in self.cache.cross_k + self.cache.cross_v:
                t.index_fill_(0, index, 0)
        for group in groups.values():
            self.draft.fill_cross(self.cache, [slot for slot, _ in group], torch.cat([st for _, st in group]))

    def _feed(self, cache: DecoderCache, chunks: list[list[int]]) -> torch.Tensor:
        """Feed ragged token lists (one per row, each non-empty); commit them; return the draft's final hidden state
        at each row's last token, float ``[R, D]`` (only those are read out)."""
        counts = np.asarray([len(c) for c in chunks], dtype=np.int64)
        width = int(counts.max())
        tokens = torch.tensor([c + [self.eos] * (width - len(c)) for c in chunks]).to(cache.device, non_blocking=True)
        hidden = self.draft.decode_hidden(cache, tokens)
        cache.commit(np.broadcast_to(np.arange(width), (len(chunks), width)), counts)
        last = torch.from_numpy(counts - 1).to(cache.device, non_blocking=True)
        return hidden[torch.arange(len(chunks), device=cache.device), last]

    def _top2(self, hidden: torch.Tensor, first: list[bool]):
        """Top-2 probabilities and tokens per row of hidden states ``[R, D]`` (one device read: adaptive drafting
        decides on the host)."""
        first = np.asarray(first)
        if self.shortlist:
            logits, ids = self.draft.readout_logits(hidden, first)
        else:
            logits, ids = self.draft.suppress(self.draft.project(hidden), first=first), None
        p, tok = logits.float().softmax(-1).topk(2, dim=-1)
        if ids is not None:
            tok = ids[tok]
        both = torch.cat([p.double(), tok.double()], dim=1).tolist()
        return [r[:2] for r in both], [[int(r[2]), int(r[3])] for r in both]

    def _trunk(self, work: list[_Work]) -> None:
        opt = self.opt
        hidden = self._feed(self.cache, [w.req.seq[w.valid :] if w.req.speculate else [self.eos] for w in work])
        for w in work:
            w.passes += w.req.speculate
        while True:
            first = [len(w.req.seq) - self.prompt_len + len(w.out.trunk) == 0 for w in work]
            p, tok = self._top2(hidden, first)
            for k, w in enumerate(work):
                if not w.drafting:
                    continue
                trunk = w.out.trunk
                trunk.append(tok[k][0])
                w.p1.append(p[k][0])
                w.alt.append(tok[k][1])
                limit = min(opt.max_draft, w.req.room)
                if tok[k][0] == self.eos or len(trunk) >= limit or p[k][0] < opt.threshold:
                    w.drafting = False
                elif opt.recycle and w.old_suffix:
                    j = rejoin(trunk, w.old_suffix)
                    if j is not None:
                        reused = w.old_suffix[j:]
                        if self.eos in reused:
                            reused = reused[: reused.index(self.eos) + 1]
                        reused = reused[: limit - len(trunk)]
                        trunk += reused
                        w.p1 += [None] * len(reused)
                        w.alt += [self.eos] * len(reused)
                        w.drafting = False
            if not any(w.drafting for w in work):
                break
            # One batched draft pass: every row feeds its next unfed trunk token (rows done drafting keep feeding
            # their recycled tokens, which keeps those keys/values valid for the next round, or padding).
            feed = []
            for w in work:
                if w.out.fed < len(w.out.trunk):
                    feed.append([w.out.trunk[w.out.fed]])
                    w.out.fed += 1
                else:
                    feed.append([self.eos])
            for w in work:
                if w.drafting:
                    w.passes += 1
            hidden = self._feed(self.cache, feed)

    def _branches(self, work: list[_Work]) -> None:
        """Second pass: branches from the 2nd-best token at the least confident trunk positions, drafted together."""
        opt = self.opt
        starts = []  # (row position in work, trunk index i, first branch token)
        for k, w in enumerate(work):
            trunk = w.out.trunk
            cand = [i for i, p in enumerate(w.p1) if p is not None and p < opt.tree_threshold
                    and w.alt[i] != trunk[i] and i <= w.out.fed]
            cand = sorted(cand, key=lambda i: w.p1[i])[: opt.tree_branches]
            starts += [(k, i, w.alt[i]) for i in sorted(cand)]
        if not starts:
            return
        fork = self.cache.fork([k for k, _, _ in starts], [len(work[k].req.seq) + i for k, i, _ in starts])
        branches = [[tok] for _, _, tok in starts]
        active = [tok != self.eos and min(opt.branch_max, work[k].req.room - i) > 1 for k, i, tok in starts]
        while any(active):
            hidden = self._feed(fork, [[br[-1]] for br in branches])
            for (k, _, _), on in zip(starts, active):
                if on:
                    work[k].passes += 1
            p, tok = self._top2(hidden, [False] * len(branches))
            for n, ((k, i, _), br) in enumerate(zip(starts, branches)):
                if not active[n]:
                    continue
                trunk = work[k].out.trunk
                br.append(tok[n][0])
                limit = min(opt.branch_max, work[k].req.room - i)
                if tok[n][0] == self.eos or len(br) >= limit or p[n][0] < opt.threshold:
                    active[n] = False
                    continue
                # Re-join the trunk (same or adjacent position): reuse the rest of the trunk.
                j = rejoin(br[1:], trunk[i + 1 :])
                if j is not None:
                    br += trunk[i + 1 + j :][: limit - len(br)]
                    active[n] = False
        for (k, i, _), br in zip(starts, branches):
            work[k].out.branches.append((i, br))
