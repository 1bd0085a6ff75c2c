"""The one verify loop of every decoding method: propose -> verify -> commit, for a batch of rows at once.

Autoregressive decoding is the case without a proposer (every round verifies an empty draft and emits the target's
next token); draft-model speculation, the SSD fallback and Medusa differ only in their proposer and acceptance rule.

One round, for every live row (rows keep different lengths in the ragged KV cache):

1. Propose: the proposer returns a :class:`~rayspec.spec_decode.tree.DraftTree` per row that speculates this round
   (nothing without a proposer; with ``speculate_max_rows`` given, every row in rounds of at most that many live
   rows; by default the rows :func:`~rayspec.spec_decode.rule.plan_round` picks from the whole round's measured
   costs, :mod:`rayspec.spec_decode.rule`: a round that would not pay is a plain target step).
2. Verify: the row's context (tokens the target has not seen; the last is the root) and its draft tree are flattened
   into :class:`~rayspec.spec_decode.tree.TokenTrees`, copied to the device once, and scored in ONE target pass under tree
   attention; the acceptance rule's per-node verdicts, argmaxes (a sampling row's: of its Gumbel-perturbed
   logits, :mod:`rayspec.spec_decode.gumbel`) and their log-probabilities come back in ONE transfer
   (:func:`~rayspec.spec_decode.acceptance.score_tree`), and the longest passing path is picked on the host.
3. Commit: the cache keeps the context and the accepted path (compacted); the row emits the path and the target's
   token after it; EOS or the row's cap ends it and it leaves the batch. The proposer is told which of its nodes
   were kept (:meth:`Proposer.update`), so it can roll back or recycle its own state.

Host/device traffic per round: two host-to-device copies (the tree layout, the commit indices when a branch was
taken) and one device-to-host read (the verdicts); the cache never reads lengths back from the device. With the
target's static steps (:mod:`rayspec.runner.static_step`) a greedy round without timestamps or sampling, in a bucket
of at most ``HEAD_NODES`` nodes, stages the layout and the committed lengths in one pinned buffer (one copy) and runs
the projection, the suppress lists and the argmax inside the step (:meth:`StaticSteps.verify_greedy`): the scores
come back in the round's one read, as the dynamic path's do.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, Optional, Protocol, Sequence

import numpy as np
import torch

from ..decoding.common import Hypothesis
from ..decoding.options import CPU_SPECULATE_MAX_ROWS
from ..models.cache import DecoderCache
from ..models.encoded import EncoderOutput
from ..models.whisper import WhisperASR
from .acceptance import GREEDY, AcceptanceRule, accept_tree, score_greedy_lazily, score_tree
from .gumbel import perturb, token_logprobs, vocab_argmax
from .rule import RoundCosts, RowState, costs_for, plan_round, seed_costs
from .timestamps import EXTRA_NODES, apply_rules, rule_bounds, wrap_proposer
from .tree import DraftTree, TokenTrees

# greedy verification projects to the vocabulary only where it can matter (score_greedy_lazily) from this many
# nodes besides the rows' last ones per pass, on a CPU in float32: below it the full projection costs about the same
# (packed weights are read at memory speed: whisper-base, 2 threads, 5.2 / 6.1 / 11.5 / 40 ms for 1 / 10 / 40 / 160
# rows, the bound 0.1-3.4 ms), and on a GPU the host round trip would stall the device
LAZY_MIN_NODES = 16


def speculate_max_rows(device: torch.device, rows: Optional[int] = None) -> int:
    """The most live rows a round may have and still speculate: ``rows`` if given (0: no limit), else the device's
    default (:data:`CPU_SPECULATE_MAX_ROWS` on a CPU; no limit on an accelerator, where a wide verification pass
    costs about what a one-token step does)."""
    if rows is not None:
        if rows < 0:
            raise ValueError(f"speculate_max_rows must be >= 0 (0: no limit), got {rows}")
        return rows
    return CPU_SPECULATE_MAX_ROWS if torch.device(device).type == "cpu" else 0


COST_RULE = True
"""Whether a loop without a fixed ``max_rows`` decides per round from measured costs (:mod:`rayspec.spec_decode.rule`);
False: it speculates in every round (the tests set it, so that they exercise batched verification)."""


def _lazy_projection(hidden: torch.Tensor, target) -> bool:
    """Whether a pass's greedy verification should use :func:`score_greedy_lazily`: hidden ``[B, Q, D]``; not for an
    int8 target (its token logits and shortlist bound would be float32 products beside an int8 projection)."""
    b, q, _ = hidden.shape
    return _lazy(b, q, hidden.device, hidden.dtype, target)


def _lazy(b: int, q: int, device: torch.device, dtype: torch.dtype, target) -> bool:
    return (device.type == "cpu" and dtype == torch.float32 and b * (q - 1) >= LAZY_MIN_NODES
            and not getattr(target, "int8", False))


@dataclass
class DraftRequest:
    """What the loop tells a proposer about one live row before a round.

    Attributes:
        index: the row's index in the batch the proposer was built for.
        seq: prompt + tokens emitted so far (token ids).
        room: tokens the row may still emit (its cap minus emitted tokens); > 0.
        speculate: False when the loop verifies no draft for the row this round (the batch is too large for
            speculation to pay): the proposer proposes nothing and runs no draft pass for it, but keeps its state in
            step (the round's feedback still comes).
    """

    index: int
    seq: list[int]
    room: int
    speculate: bool = True


@dataclass
class Proposal:
    """A proposer's answer for one row.

    Attributes:
        tree: the draft nodes after the row's last token (empty: no speculation this round).
        passes: draft forward passes this row took part in this round.
    """

    tree: DraftTree = field(default_factory=DraftTree)
    passes: int = 0


@dataclass
class Feedback:
    """What the target kept of one row's proposal.

    Attributes:
        index: the row's batch index; accepted: indices into the proposal's ``tree`` of the kept root path.
        hidden: for proposers with ``needs_hidden``, the target's last decoder hidden state ``[D]`` (device) at the
            end of the kept path: the state that predicted the row's newest token (Medusa heads read it).
        timestamp: for rows in timestamp mode, the target's most likely timestamp token at the end of the kept path
            (before the timestamp rules): where a segment ending there would end
            (:class:`~rayspec.spec_decode.timestamps.TimestampProposer` guesses a segment's end from it).
    """

    index: int
    accepted: list[int]
    hidden: Optional[torch.Tensor] = None
    timestamp: Optional[int] = None


@dataclass
class Admission:
    """Rows that join a continuous batch (:meth:`VerifyLoop.decode_stream`), e.g. one encoded batch of a corpus.

    Attributes:
        ids: ``R`` keys, one per row, unique within the stream (results come back under them).
        enc: the target's encoder output for the rows (``R`` rows).
        caps: ``R`` caps on generated tokens (EOS not counted).
        extra: what the proposer needs per row, handed to its ``admit`` (the draft model's encoder output for
            draft-model speculation, the CTC hypotheses for the CTC proposer: a list, or the batch's
            :class:`~rayspec.decoding.ssd.CTCDrafts`), or None.
        start: optional, per row the hypothesis to continue (see :meth:`VerifyLoop.decode`): its tokens are decided
            already (e.g. SSD's verified prefix) and its counters hold the passes spent on them; a row whose start
            is finished or at its cap is yielded at once, without a decoder pass.
        prefix_kv: optional, per row the target's keys/values of prompt + ``start`` tokens minus the last one (from
            :meth:`~rayspec.models.cache.DecoderCache.export_rows`), or None to recompute them.
    """

    ids: list
    enc: EncoderOutput
    caps: list[int]
    extra: Any = None
    start: Optional[list[Hypothesis]] = None
    prefix_kv: Optional[list] = None

    def __len__(self) -> int:
        return len(self.ids)

    def select(self, keep: Sequence[int]) -> "Admission":
        """The rows ``keep`` (indices, in that order)."""
        index = torch.tensor(list(keep), dtype=torch.long, device=self.enc.states.device)
        pick = lambda xs: None if xs is None else [xs[k] for k in keep]  # noqa: E731
        extra = (self.extra.select(index.to(self.extra.states.device)) if isinstance(self.extra, EncoderOutput)
                 else self.extra.select(keep) if hasattr(self.extra, "select") else pick(self.extra))
        return Admission(pick(self.ids), self.enc.select(index), pick(self.caps), extra, pick(self.start),
                         pick(self.prefix_kv))

    def split(self, n: int) -> tuple["Admission", Optional["Admission"]]:
        """The first ``n`` rows and the rest (None when nothing is left)."""
        if n >= len(self.ids):
            return self, None
        return self.select(range(n)), self.select(range(n, len(self.ids)))


class Proposer(Protocol):
    """A drafting strategy (propose vs update, as transformers' ``CandidateGenerator``): in this process or behind a
    Ray actor (``actors.drafter.RemoteProposers``). A proposer with a true ``needs_hidden`` attribute gets the
    target's hidden states in its feedback; one with a true ``needs_cross`` also gets the cache's cross-attention
    keys/values (:meth:`~rayspec.models.cache.DecoderCache.cross`, rows in request order) as ``propose``'s second
    argument."""

    def propose(self, requests: list[DraftRequest]) -> list[Proposal]:
        """One proposal per request (the live rows, in batch order; rows not requested any more are finished)."""
        ...

    def update(self, feedback: list[Feedback]) -> None:
        """What the target kept of the last proposals (one entry per row that is still live)."""
        ...


@dataclass
class _Row:
    index: int
    cap: int
    hyp: Hypothesis
    seq: list[int]  # prompt + emitted tokens
    target_len: int = 0  # leading tokens of seq whose keys/values the target cache holds
    timestamps: bool = False  # the prompt lacks <|notimestamps|>: Whisper's timestamp rules apply
    temperature: float = 0.0  # > 0: seeded Gumbel-max sampling (rayspec.spec_decode.gumbel)
    seed: int = 0
    sot: int = 0  # index of <|startoftranscript|> in seq (> 0 after <|startofprev|> text): drafters see seq[sot:]
    begin: int = 0  # generated tokens before the first sampled one (a --prefix): first-token suppression applies there
    started: bool = False  # the row has speculated (its drafter's per-row set-up is paid)

    @property
    def room(self) -> int:
        return self.cap - len(self.hyp.tokens)


def _new_row(key, cap: int, start: Optional[Hypothesis], prompt: list[int], route: str, tt,
             sampling: tuple[float, int] = (0.0, 0), sot: Optional[int] = None, prefix: Sequence[int] = ()) -> _Row:
    """A row to decode; ``start`` (a hypothesis to continue) takes precedence over ``prefix`` (tokens the transcript
    starts with)."""
    begin = 0
    if start is not None:
        hyp = start
    else:
        hyp, begin = Hypothesis(list(prefix), False, route), len(prefix)
    temperature, seed = sampling
    hyp.stats.temperature = float(temperature)
    return _Row(key, int(cap), hyp, prompt + hyp.tokens, timestamps=tt is not None and tt.in_timestamp_mode(prompt),
                temperature=float(temperature), seed=int(seed), sot=prompt.index(sot) if sot in prompt else 0,
                begin=begin)


def _done(hyp: Hypothesis, cap: int) -> bool:
    return hyp.finished or len(hyp.tokens) >= cap


class VerifyLoop:
    """Decode a batch with the target, speculatively when a proposer is given (see the module docstring).

    Args:
        target: the target model.
        proposer: the drafting side over the batch's rows, or None for plain greedy decoding.
        rule: how draft tokens are accepted (:data:`~rayspec.spec_decode.acceptance.GREEDY`: exact).
        max_nodes: most draft nodes a proposal may hold (sizes the KV cache's room for pending positions).
        route: the hypotheses' route ("ar", "draft", ...).

    Rows whose prompt lacks ``<|notimestamps|>`` decode with Whisper's timestamp rules at every verified node
    (:mod:`rayspec.spec_decode.timestamps`), and the proposer is wrapped so that text-only drafters still speculate
    (:class:`~rayspec.spec_decode.timestamps.TimestampProposer`).

    Args:
        max_rows: speculate only in rounds with at most this many live rows (0: always); None: the rows and rounds
            the cost model picks (:func:`~rayspec.spec_decode.rule.plan_round`), for a lossless ``rule``; a lossy
            one (SSD's relaxed threshold, top-k) takes the device's fixed cap (:func:`speculate_max_rows`), so that
            its output never depends on measured times. With a lossless rule the tokens are the same either way.

    Raises:
        ValueError: a negative ``max_rows``.
    """

    def __init__(self, target: WhisperASR, proposer: Optional[Proposer] = None, rule: AcceptanceRule = GREEDY,
                 max_nodes: int = 0, route: str = "ar", max_rows: Optional[int] = None) -> None:
        self.tt = target.timestamp_tokens
        self.target, self.rule = target, rule
        self.proposer = wrap_proposer(proposer, self.tt, target.prompt_ids, target.eos_token_id)
        self.max_nodes = max_nodes + (EXTRA_NODES if self.proposer is not proposer else 0)
        self.route = route
        if max_rows is None and not rule.lossless:  # a lossy rule's tokens depend on the rounds that verify drafts:
            max_rows = speculate_max_rows(target.device)  # the device's fixed cap keeps its output reproducible
        self.max_rows = 0 if max_rows is None else speculate_max_rows(target.device, max_rows)
        self.costs: Optional[RoundCosts] = None
        if max_rows is None and COST_RULE and self.proposer is not None:
            seed = seed_costs(target.device.type, route, getattr(target, "static_steps", None), self.max_nodes)
            self.costs = costs_for(target, route, seed)
        # draft tokens accepted, speculating row-rounds (a prior: the method's seed as PRIOR_ROUNDS rounds, or one
        # token with a fixed cap); shared with the method's later loops on this target through its costs
        self._accepted = self.costs.accepted if self.costs is not None else [1.0, 1]
        self.eos = target.eos_token_id
        self.sot = target.prompt_ids[0]

    @torch.inference_mode()
    def decode(self, enc: EncoderOutput, caps: Sequence[int], start: Optional[list[Optional[Hypothesis]]] = None,
               prefix_kv: Optional[list] = None, cache: Optional[DecoderCache] = None) -> list[Hypothesis]:
        """Decode ``B`` rows; with the greedy rule the tokens equal the target's own greedy output.

        Args:
            enc: the target's encoder output (``B`` rows); caps: ``B`` caps on generated tokens (EOS not counted).
            start: optional, per row a hypothesis to continue in place, or None: its tokens are already decided
                (e.g. a verified CTC prefix plus the target's next token) and decoding goes on after them; its
                counters and route are kept and added to.
            prefix_kv: optional, per row the target's keys/values of prompt + ``start`` tokens minus the last one
                (from :meth:`~rayspec.models.cache.DecoderCache.export_rows`) or None, so they are not recomputed.
            cache: optional, the ``B`` rows' own cache to continue in (e.g. SSD's verification pass's), holding
                (committed, no pending positions) each row's prompt + ``start`` tokens minus the last one, with room
                for its cap and this loop's draft nodes; instead of ``prefix_kv`` (nothing is copied or recomputed,
                the cross-attention keys/values included).

        Returns:
            ``B`` hypotheses; ``stats.target_forward_passes`` counts every target pass a row took part in; with a
            proposer also rounds, draft passes, proposed and accepted draft tokens.

        Raises:
            ValueError: prefix keys/values (or a cache) that do not match the start tokens, or a cache without room.
        """
        t = self.target
        prompts = enc.row_prompts(t.prompt_ids)
        start = start or [None] * len(caps)
        capacity = max(map(len, prompts)) + max(caps) + self.max_nodes + 2
        given = cache is not None
        if not given:
            cache = t.new_cache(enc, capacity)
        elif cache.batch_size != len(caps) or cache.pending or cache.capacity < capacity:
            raise ValueError(f"a cache of {cache.batch_size} rows, {cache.capacity} positions and {cache.pending} "
                             f"pending cannot continue {len(caps)} rows needing {capacity} positions")
        rows = [_new_row(i, c, h, p, self.route, self.tt, x, self.sot, f)
                for i, (c, h, p, x, f) in enumerate(zip(caps, start, prompts, enc.row_sampling(), enc.row_prefixes()))]
        if given:
            _check_prefixes(cache, list(range(len(rows))), rows)
        elif prefix_kv is not None:
            _import_prefixes(cache, list(range(len(rows))), rows, prefix_kv)
        live = _drop(cache, rows, [k for k, r in enumerate(rows) if _done(r.hyp, r.cap)])
        while live:
            done = self._step(live, cache)
            if done:
                live = _drop(cache, live, done)
        return [r.hyp for r in rows]

    @torch.inference_mode()
    def decode_stream(self, source: Iterable[Optional[Admission]], slots: int, max_cap: int,
                      max_prompt: Optional[int] = None) -> Iterator[tuple[Any, Hypothesis]]:
        """Continuous batching: decode the rows of ``source`` with up to ``slots`` rows live at once; the slot of a
        finished row is refilled from ``source`` before the next round (Orca's iteration-level scheduling, Yu et al.
        2022), so the batch stays full until the source runs dry; a batch below ``slots`` rows (an online source
        with fewer requests so far) grows as rows arrive (:meth:`~rayspec.models.cache.DecoderCache.extend`). Every
        row is decoded as in :meth:`decode` (its tokens do not depend on its neighbours), with the same counters.

        ``source`` is read lazily, a few rows ahead of need (e.g. a generator that encodes the next batch of a
        corpus only when its rows are wanted); it may yield None for "no rows ready now" (an online request queue):
        decoding goes on with the live rows and asks again when a slot frees, and the stream ends once no row is
        live and the source has none ready. Rows that need no decoding (cap 0, or a finished ``start``) are yielded
        as they are read. The proposer, if any, must accept new rows with ``admit(slots, ids, extra)`` (``slots``:
        cache rows to fill; on an empty proposer ``0 .. R-1``).

        Args:
            source: :class:`Admission` s (or None, see above), in the order their rows should start.
            slots: most rows decoded at once (the batch size).
            max_cap: the largest cap any row will have (sizes the KV cache).
            max_prompt: the longest prompt any row will have (default: the target's own prompt; longer with
                ``<|startofprev|>`` text, :mod:`rayspec.longform`).

        Yields:
            ``(id, hypothesis)`` per row as it finishes (not in source order).

        Raises:
            ValueError: ``slots < 1``, a cap above ``max_cap``, or a proposer without ``admit``.
        """
        if slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")
        if self.proposer is not None and not hasattr(self.proposer, "admit"):
            raise ValueError(f"{type(self.proposer).__name__} cannot take rows mid-batch (no admit method)")
        t = self.target
        prompt = list(t.prompt_ids)
        capacity = (max_prompt or len(prompt)) + max_cap + self.max_nodes + 2
        rows = iter(source)
        waiting: list[Optional[Admission]] = [None]
        instant: list[tuple[Any, Hypothesis]] = []  # rows with nothing to generate

        def pull(n: int) -> list[Admission]:
            parts = []
            while n > 0:
                if waiting[0] is None:
                    waiting[0] = next(rows, None)  # None: the source is exhausted or has nothing ready now
                    if waiting[0] is None:
                        break
                head, waiting[0] = waiting[0].split(n)
                if any(c > max_cap for c in head.caps):
                    raise ValueError(f"a cap of {max(head.caps)} tokens exceeds max_cap {max_cap}")
                starts = [h if h is not None else Hypothesis([], False, self.route)
                          for h in (head.start or [None] * len(head))]
                keep = [k for k, (h, c) in enumerate(zip(starts, head.caps)) if not _done(h, c)]
                kept = set(keep)
                instant.extend((head.ids[k], starts[k]) for k in range(len(head)) if k not in kept)
                if len(keep) < len(head):
                    if not keep:
                        continue
                    head = head.select(keep)
                parts.append(head)
                n -= len(head)
            return parts

        def start_rows(parts: list[Admission], where: list[int], cache, place: bool) -> list[_Row]:
            """Rows for ``parts`` in cache rows ``where``; ``place``: write their cross-attention there first."""
            new_rows = []
            for part in parts:
                at, where = where[: len(part)], where[len(part):]
                if place:
                    cache.place(at, t.new_cache(part.enc, 1))
                if self.proposer is not None:
                    self.proposer.admit(at, part.ids, part.extra)
                new = [_new_row(key, cap, h, p, self.route, self.tt, x, self.sot, f) for key, cap, h, p, x, f in
                       zip(part.ids, part.caps, part.start or [None] * len(part), part.enc.row_prompts(prompt),
                           part.enc.row_sampling(), part.enc.row_prefixes())]
                if part.prefix_kv is not None:
                    _import_prefixes(cache, at, new, part.prefix_kv)
                new_rows += new
            return new_rows

        parts = pull(slots)
        yield from instant
        instant.clear()
        if not parts:
            return
        cache = t.new_cache(EncoderOutput.cat([p.enc for p in parts]), capacity)
        live = start_rows(parts, list(range(sum(len(p) for p in parts))), cache, place=False)
        while live:
            done = self._step(live, cache)
            for k in done:
                yield live[k].index, live[k].hyp
            # Refill the finished rows' slots, and grow toward ``slots`` if the batch started (or shrank) below it.
            parts = pull(len(done) + slots - len(live)) if done or len(live) < slots else []
            free, arriving = list(done), sum(len(p) for p in parts)
            extra = arriving - len(free)
            if extra > 0:  # room grows geometrically up to ``slots`` rows, so growing copies O(slots) rows in all
                cache.reserve(min(slots, max(len(live) + extra, 2 * len(live))))
                cache.extend(extra)
                free += list(range(len(live), len(live) + extra))
                live += [None] * extra
            where, free = free[:arriving], free[arriving:]
            for slot, row in zip(where, start_rows(parts, where, cache, place=True)):
                live[slot] = row
            yield from instant
            instant.clear()
            if free:
                live = _drop(cache, live, free)

    def _step(self, live: list[_Row], cache) -> list[int]:
        """One round over the live rows (propose -> verify -> commit); the proposer hears what was kept of the rows
        that go on. Returns the indices (into ``live``) of the rows that finished."""
        t0 = time.perf_counter()
        flags = [False] * len(live)
        if self.proposer is None:
            proposals = [Proposal() for _ in live]
        else:
            if self.costs is not None:
                flags = plan_round(self.costs, [RowState(r.started, len(r.hyp.tokens), r.room) for r in live],
                                   self._accepted[0] / self._accepted[1], self.costs.lengths)
            else:
                flags = [not self.max_rows or len(live) <= self.max_rows] * len(live)
            # drafters see a row from <|startoftranscript|> on (previous text or an initial prompt left out)
            requests = [DraftRequest(r.index, r.seq[r.sot:], r.room, f) for r, f in zip(live, flags)]
            proposals = (self.proposer.propose(requests, cache.cross()) if getattr(self.proposer, "needs_cross", False)
                         else self.proposer.propose(requests))
        feedback, shape = self._round(live, proposals, cache)
        done = [k for k, r in enumerate(live) if r.hyp.finished or r.room <= 0]
        if self.proposer is not None:
            gone = set(done)
            self.proposer.update([f for k, f in enumerate(feedback) if k not in gone])
            starters = sum(f and not r.started for r, f in zip(live, flags))
            for r, f in zip(live, flags):
                r.started |= f
            if self.costs is not None:  # the whole round: drafting, verification, scoring, host work
                self.costs.record(len(live), any(flags), time.perf_counter() - t0, starters, shape)
                self.costs.add_lengths([len(live[k].hyp.tokens) for k in done])
        return done

    def _round(self, live: list[_Row], proposals: list[Proposal], cache) -> tuple[list[Feedback], tuple[int, int]]:
        """Verify the proposals of the live rows in one target pass and commit what is kept; returns per row what the
        proposer hears, and the pass's shape (rows, tokens per row)."""
        t = self.target
        trees = TokenTrees.build([r.seq[r.target_len :] for r in live], [p.tree for p in proposals])
        # the root's output is a row's first generated token (a root's depth is its index: contexts are chains)
        first = np.where([len(r.hyp.tokens) == r.begin for r in live], trees.roots, -1)
        lay = trees.layout(self.eos, first)
        fresh = [k for k, r in enumerate(live) if r.target_len == 0]  # first pass: node 0 is <|startoftranscript|>
        logits = None  # [B, Q, V] unless the lazy projection skips most of it
        stamped = [r.timestamps for r in live]
        bounds = rule_bounds(lay, [r.hyp.tokens for r in live], stamped, self.tt) if any(stamped) else None
        guess = bounds is not None and self.proposer is not None  # each node's likeliest timestamp, for proposals
        sampling = [k for k, r in enumerate(live) if r.temperature > 0]
        if sampling and self.rule.kind != "greedy":
            raise ValueError(f"sampling (temperature > 0) verifies with the exact greedy rule, not {self.rule.kind!r}")
        b, q = lay["tokens"].shape
        steps = getattr(t, "static_steps", None)
        no_speech = None
        if (self.rule.kind == "greedy" and not sampling and bounds is None and steps is not None
                and not _lazy(b, q, cache.device, t.dtype, t) and steps.takes_head(cache, b, q)):
            # the static step's head: one copy in, projection + suppression + argmax on the device, one read back
            scores, hidden = steps.verify_greedy(cache, lay)
            if fresh and t.no_speech_token_id is not None:
                no_speech = scores[3, fresh, 0].view(np.float64).tolist()
            scores = scores[:3]
            dev = None
        else:
            dev = trees.to_device(self.eos, first, cache.device, lay)
            hidden = t.decode_hidden(cache, dev.tokens, dev.ancestors, dev.depths)  # [B, Q, D]
        if dev is not None:  # the dynamic path, or a static step without its head
            if self.rule.kind == "greedy" and not sampling and _lazy_projection(hidden, t):
                scores = score_greedy_lazily(hidden, dev, t, None if bounds is None else (bounds, self.tt))
                if guess:  # (the lazy path runs on a CPU: reading back costs nothing)
                    stamps = t.timestamp_logits(hidden).argmax(-1) + self.tt.begin
                    scores = np.concatenate([scores, stamps.cpu().numpy()[None]])
            else:
                logits = t.project(hidden)
                masked = t.suppress(logits, first=dev.host["first"])
                extra = None
                if bounds is not None:  # (in place: a copy where suppress left the logits as they were)
                    if guess:  # read back with the verdicts
                        extra = (logits[..., self.tt.begin:].argmax(-1) + self.tt.begin)[None]
                    masked = apply_rules(masked if masked is not logits else logits.clone(), bounds, self.tt)
                scored = masked
                if sampling:  # the perturbed argmax is the seeded sample: verified as greedy tokens are
                    made = np.asarray([len(r.hyp.tokens) for r in live], dtype=np.int64) - trees.roots
                    positions = dev.depths + torch.from_numpy(made).to(cache.device)[:, None]  # [B, Q] generated index
                    scored = perturb(masked, sampling, [live[k].temperature for k in sampling],
                                     [live[k].seed for k in sampling], positions)
                best = vocab_argmax(scored)  # [B, Q], once for both
                logprob = token_logprobs(masked, best).view(torch.int64)[None]  # read back as float64 bits
                # a round without draft nodes reads no verdict (only each root's argmax): any rule gives its tokens,
                # and the greedy one needs no log-softmax over the vocabulary (SSD's plain rounds at batch 16)
                rule = self.rule if any(len(p.tree) for p in proposals) else GREEDY
                scores = score_tree(scored, dev, rule, logprob if extra is None else torch.cat([logprob, extra]), best)
        if fresh and dev is not None and t.no_speech_token_id is not None:  # one more read, in a first round only
            at = torch.tensor(fresh, device=cache.device)
            sot = t.project(hidden[at, 0]) if logits is None else logits[at, 0]
            no_speech = t.no_speech_probability(sot).tolist()
        result = accept_tree(lay, scores)
        logprobs = scores[2].view(np.float64)  # [B, Q] the log-probability of each node's (sampled) argmax
        for k, p in zip(fresh, no_speech or []):
            live[k].hyp.stats.no_speech_prob = p
        last = None  # [B, D] the state at each row's last kept node (one gather), for proposers that read it
        if getattr(self.proposer, "needs_hidden", False):
            ends = np.asarray([p[-1] if p else trees.roots[k] for k, p in enumerate(result.paths)], dtype=np.int64)
            ends_t = torch.from_numpy(ends).to(cache.device, non_blocking=True)
            last = hidden[torch.arange(len(live), device=cache.device), ends_t]
        keep = np.zeros((len(live), int(trees.sizes.max())), dtype=np.int64)
        counts = np.zeros(len(live), dtype=np.int64)
        feedback = []
        for k, (r, prop, path) in enumerate(zip(live, proposals, result.paths)):
            root = int(trees.roots[k])
            kept = list(range(root + 1)) + path
            keep[k, : len(kept)] = kept
            counts[k] = len(kept)
            base = int(trees.cu_nodes[k])
            accepted = trees.tokens[base + np.asarray(path, dtype=np.int64)].tolist() if path else []
            s = r.hyp.stats
            s.target_forward_passes += 1
            s.draft_forward_passes += prop.passes
            if self.proposer is not None:
                s.rounds += 1
                s.draft_tokens_proposed += len(prop.tree)
                s.draft_tokens_accepted += len(path)
                if len(prop.tree):
                    self._accepted[0] += len(path)
                    self._accepted[1] += 1
            stamp = int(scores[3][k, path[-1] if path else root]) if len(scores) > 3 and r.timestamps else None
            feedback.append(Feedback(r.index, [a - root - 1 for a in path], None if last is None else last[k], stamp))
            r.target_len = len(r.seq) + len(accepted)
            for tok, at in zip(accepted + [int(result.next_tokens[k])], [root] + path):
                r.hyp.stats.add_logprob(float(logprobs[k, at]))
                if tok == self.eos:
                    r.hyp.finished = True
                    break
                r.hyp.tokens.append(tok)
                r.seq.append(tok)
                if r.room <= 0:
                    break
        cache.commit(keep, counts)
        return feedback, (b, q)


def _drop(cache, live: list[_Row], gone: list[int]) -> list[_Row]:
    """Remove the rows ``gone`` (indices into ``live``) from the cache in place (swap-remove: only the rows that
    fill their slots move); returns the remaining rows in the cache's new order."""
    if not gone:
        return live
    return [live[k] for k in cache.drop(gone)]


def _import_prefixes(cache, slots: list[int], rows: list[_Row], prefix_kv: list) -> None:
    """Load the rows' prefix keys/values (None: recompute that row's) into cache rows ``slots``.

    Raises:
        ValueError: keys/values that do not cover a row's prompt + tokens minus the last one.
    """
    have = [k for k, kv in enumerate(prefix_kv) if kv is not None]
    if not have:
        return
    cache.import_rows([prefix_kv[k] for k in have], [slots[k] for k in have])
    _check_prefixes(cache, [slots[k] for k in have], [rows[k] for k in have])


def _check_prefixes(cache, slots: list[int], rows: list[_Row]) -> None:
    """The rows' keys/values are those in cache rows ``slots`` (prompt + tokens minus the last one).

    Raises:
        ValueError: a cache row that does not cover exactly that.
    """
    for slot, row in zip(slots, rows):
        n = int(cache.host_lengths[slot])
        if n != len(row.seq) - 1:
            raise ValueError(f"prefix keys/values cover {n} positions, expected {len(row.seq) - 1}")
        row.target_len = n
