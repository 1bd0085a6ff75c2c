"""Exact, batched draft-model speculative decoding with SpecASR's three techniques.

Source: SpecASR (../shared/seeds/specasr.txt): IV.A adaptive single-sequence prediction, IV.B draft sequence
recycling, IV.C two-pass sparse token tree; tree attention after SpecInfer. Verification is exact greedy acceptance
(Leviathan et al. 2023 with temperature 0): the output equals the target's own greedy output token for token.

One round, for every live row of the batch at once (rows accept different numbers of tokens):

1. Draft, first pass (the trunk): the draft catches up on the tokens it has not seen (ragged, one pass), then
   proposes greedily, one batched draft pass per position, until its top-1 probability drops below ``threshold``,
   it proposes EOS, or ``max_draft`` / the row's length cap is reached. With recycling, a new draft token that
   re-joins last round's rejected suffix (same or adjacent position) ends drafting: the rest of the old suffix is
   reused without draft passes.
2. Draft, second pass (the branches): at up to ``tree_branches`` trunk positions whose top-1 probability is below
   ``tree_threshold``, the 2nd-best token starts a branch, drafted greedily from a forked draft cache (all branches of
   all rows in one batch); a branch that re-joins the trunk reuses the rest of the trunk.
3. Verify: the target scores the root (its last unseen token), the trunk and every branch in ONE pass under a tree
   attention mask. Walking from the root, a child is accepted while its token equals the target's argmax at its
   parent; the longest accepted root-to-leaf path wins and the target's argmax after it is the bonus token.
4. Commit: the target cache keeps the root and the accepted path (compacted), the draft cache rolls back to the
   longest prefix it computed correctly; EOS or the cap ends a row, which leaves the batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from ..models.cache import DecoderCache
from ..models.whisper import EncoderOutput, WhisperASR
from .common import Hypothesis


@dataclass(frozen=True)
class SpeculationOptions:
    """Options of :func:`speculative_decode` (defaults: all three SpecASR techniques on).

    Attributes:
        max_draft: most trunk tokens per round (SpecASR: 24).
        threshold: adaptive drafting stops after the first token whose draft top-1 probability is below this
            (SpecASR IV.A: 0.4); 0 drafts exactly ``max_draft`` tokens (fixed-length speculation).
        recycle: reuse the rejected draft suffix where the new draft re-joins it (IV.B).
        tree: draft branches at uncertain trunk positions and verify a token tree (IV.C).
        tree_threshold: trunk positions with top-1 probability below this are branch candidates.
        tree_branches: most branches per row and round (the least confident positions first).
        branch_max: most tokens per branch.
    """

    max_draft: int = 24
    threshold: float = 0.4
    recycle: bool = True
    tree: bool = True
    tree_threshold: float = 0.6
    tree_branches: int = 2
    branch_max: int = 8

    def __post_init__(self):
        if self.max_draft < 1 or self.tree_branches < 0 or self.branch_max < 1:
            raise ValueError(f"invalid speculation options: {self}")


@dataclass
class _Row:
    """Decoding state of one utterance."""

    index: int
    cap: int
    hyp: Hypothesis
    seq: list[int]  # prompt + emitted tokens
    target_len: int = 0  # tokens of seq the target cache holds
    draft_len: int = 0  # tokens of seq the draft cache holds
    old_suffix: list[int] = field(default_factory=list)  # last round's rejected draft continuation (recycling)
    # per-round state
    trunk: list[int] = field(default_factory=list)
    trunk_p1: list[Optional[float]] = field(default_factory=list)
    trunk_alt: list[int] = field(default_factory=list)
    fed: int = 0  # trunk tokens whose draft keys/values sit in the draft cache
    drafting: bool = False
    branches: list[tuple[int, list[int]]] = field(default_factory=list)  # (trunk position it replaces, tokens)

    @property
    def room(self) -> int:
        return self.cap - len(self.hyp.tokens)


def _rejoin(new: list[int], old: list[int]) -> Optional[int]:
    """Index in ``old`` right after a re-join of the newest token of ``new`` with ``old``, else None.

    ``new[-1]`` sits at the position of ``old[len(new) - 1]``; it re-joins if it equals the old token at the same or
    an adjacent position (SpecASR IV.B: the correction was a substitution, insertion or deletion).
    """
    i = len(new) - 1
    for j in (i, i - 1, i + 1):
        if 0 <= j < len(old) and old[j] == new[-1]:
            return j + 1
    return None


class SpeculativeDecoder:
    """Batched draft-then-verify decoding of one batch (see the module docstring for the algorithm).

    Args:
        target, draft: models sharing a tokenizer (same prompt, EOS and vocabulary).
        options: :class:`SpeculationOptions`.

    Raises:
        ValueError: draft and target disagree on prompt, EOS or vocabulary size.
    """

    def __init__(self, target: WhisperASR, draft: WhisperASR, options: SpeculationOptions) -> None:
        if draft.prompt_ids != target.prompt_ids or draft.eos_token_id != target.eos_token_id:
            raise ValueError("draft and target must share the tokenizer: prompts or EOS differ")
        if draft.vocab_size != target.vocab_size:
            raise ValueError(f"vocabulary sizes differ: target {target.vocab_size}, draft {draft.vocab_size}")
        self.target, self.draft, self.opt = target, draft, options
        self.eos = target.eos_token_id

    @torch.inference_mode()
    def decode(
        self,
        target_enc: EncoderOutput,
        draft_enc: EncoderOutput,
        caps: Sequence[int],
        prefixes: Optional[list[list[int]]] = None,
        target_prefix_kv: Optional[list] = None,
    ) -> list[Hypothesis]:
        """Decode a batch; returns one hypothesis per row (route "draft"), identical to AR greedy's tokens.

        Args:
            prefixes: optional per-row tokens already decided (e.g. a verified CTC prefix plus the target's next
                token); decoding continues after them.
            target_prefix_kv: optional target keys/values of prompt + prefix minus its last token, per row (from
                :meth:`~rayspec.models.cache.DecoderCache.export_rows`), so the target does not recompute them.
        """
        b = target_enc.states.shape[0]
        prompt = list(self.target.prompt_ids)
        prefixes = prefixes or [[] for _ in range(b)]
        width = self.opt.max_draft * (1 + (self.opt.branch_max + 1) * (self.opt.tree_branches if self.opt.tree else 0))
        tcache = self.target.new_cache(target_enc, len(prompt) + max(caps) + width + 2)
        dcache = self.draft.new_cache(draft_enc, len(prompt) + max(caps) + self.opt.max_draft + self.opt.branch_max + 2)
        rows = [_Row(i, int(c), Hypothesis(list(p), False, "draft"), prompt + list(p))
                for i, (c, p) in enumerate(zip(caps, prefixes))]
        if target_prefix_kv is not None:
            tcache.import_rows(target_prefix_kv)
            for r, n in zip(rows, tcache.lengths.tolist()):
                if n != len(r.seq) - 1:
                    raise ValueError(f"prefix keys/values cover {n} positions, expected {len(r.seq) - 1}")
                r.target_len = n
        live = [r for r in rows if r.room > 0]
        if len(live) < len(rows):
            idx = torch.tensor([r.index for r in live], dtype=torch.long, device=tcache.lengths.device)
            tcache, dcache = tcache.select(idx), dcache.select(idx)
        while live:
            self._draft_trunk(live, dcache)
            if self.opt.tree and self.opt.tree_branches:
                self._draft_branches(live, dcache)
            self._verify(live, tcache)
            dcache.crop(torch.tensor([r.draft_len for r in live], device=dcache.lengths.device))
            keep = [k for k, r in enumerate(live) if not (r.hyp.finished or r.room <= 0)]
            if len(keep) < len(live):
                idx = torch.tensor(keep, dtype=torch.long, device=tcache.lengths.device)
                tcache, dcache = tcache.select(idx), dcache.select(idx)
                live = [live[k] for k in keep]
        return [r.hyp for r in rows]

    # ------------------------------------------------------------------ drafting
    def _feed(self, model: WhisperASR, cache: DecoderCache, chunks: list[list[int]]) -> torch.Tensor:
        """Feed ragged token lists (one per row, each non-empty); commit them; return logits at each row's last."""
        dev = cache.lengths.device
        counts = torch.tensor([len(c) for c in chunks], device=dev)
        width = int(counts.max())
        tokens = torch.tensor([c + [self.eos] * (width - len(c)) for c in chunks], device=dev)
        logits = model.decode(cache, tokens)
        cache.commit(torch.arange(width, device=dev).expand(len(chunks), -1), counts)
        return logits[torch.arange(len(chunks), device=dev), counts - 1]

    def _top2(self, model: WhisperASR, logits: torch.Tensor, first: list[bool]):
        first_t = torch.tensor(first, device=logits.device)
        probs = model.suppress(logits, first=first_t).float().softmax(-1)
        p, tok = probs.topk(2, dim=-1)
        return p.tolist(), tok.tolist()

    def _draft_trunk(self, live: list[_Row], dcache: DecoderCache) -> None:
        opt = self.opt
        for r in live:
            r.trunk, r.trunk_p1, r.trunk_alt, r.fed, r.branches = [], [], [], 0, []
            r.drafting = True
        logits = self._feed(self.draft, dcache, [r.seq[r.draft_len :] for r in live])
        for r in live:
            r.draft_len = len(r.seq)
            r.hyp.stats.draft_forward_passes += 1
        while True:
            first = [len(r.hyp.tokens) + len(r.trunk) == 0 for r in live]
            p, tok = self._top2(self.draft, logits, first)
            for k, r in enumerate(live):
                if not r.drafting:
                    continue
                r.trunk.append(tok[k][0])
                r.trunk_p1.append(p[k][0])
                r.trunk_alt.append(tok[k][1])
                limit = min(opt.max_draft, r.room)
                if tok[k][0] == self.eos or len(r.trunk) >= limit or p[k][0] < opt.threshold:
                    r.drafting = False
                elif opt.recycle and r.old_suffix:
                    j = _rejoin(r.trunk, r.old_suffix)
                    if j is not None:
                        reused = r.old_suffix[j:]
                        if self.eos in reused:
                            reused = reused[: reused.index(self.eos) + 1]
                        reused = reused[: limit - len(r.trunk)]
                        r.trunk += reused
                        r.trunk_p1 += [None] * len(reused)
                        r.trunk_alt += [self.eos] * len(reused)
                        r.drafting = False
            if not any(r.drafting for r in live):
                break
            # One batched draft pass: every row feeds its next unfed trunk token (rows done drafting keep feeding
            # their recycled tokens, which keeps those keys/values valid for the next round, or padding).
            feed = []
            for r in live:
                if r.fed < len(r.trunk):
                    feed.append([r.trunk[r.fed]])
                    r.fed += 1
                else:
                    feed.append([self.eos])
            for r in live:
                if r.drafting:
                    r.hyp.stats.draft_forward_passes += 1
            logits = self._feed(self.draft, dcache, feed)

    def _draft_branches(self, live: list[_Row], dcache: DecoderCache) -> None:
        """Second pass: branches from the 2nd-best token at the least confident trunk positions, drafted together."""
        opt = self.opt
        starts = []  # (row position in live, trunk index i, first branch token)
        for k, r in enumerate(live):
            cand = [i for i, p in enumerate(r.trunk_p1) if p is not None and p < opt.tree_threshold
                    and r.trunk_alt[i] != r.trunk[i] and i <= r.fed]
            cand = sorted(cand, key=lambda i: r.trunk_p1[i])[: opt.tree_branches]
            starts += [(k, i, r.trunk_alt[i]) for i in sorted(cand)]
        if not starts:
            return
        dev = dcache.lengths.device
        rows_idx = torch.tensor([k for k, _, _ in starts], device=dev)
        lengths = torch.tensor([live[k].draft_len + i for k, i, _ in starts], device=dev)
        fork = dcache.fork(rows_idx, lengths)
        branches = [[tok] for _, _, tok in starts]
        active = []
        for (k, i, tok), br in zip(starts, branches):
            r = live[k]
            active.append(tok != self.eos and min(opt.branch_max, r.room - i) > 1)
        while any(active):
            logits = self._feed(self.draft, fork, [[br[-1]] for br in branches])
            for (k, _, _), on in zip(starts, active):
                if on:
                    live[k].hyp.stats.draft_forward_passes += 1
            first = [False] * len(branches)
            p, tok = self._top2(self.draft, logits, first)
            for n, ((k, i, _), br) in enumerate(zip(starts, branches)):
                if not active[n]:
                    continue
                r = live[k]
                br.append(tok[n][0])
                limit = min(opt.branch_max, r.room - i)
                if tok[n][0] == self.eos or len(br) >= limit or p[n][0] < opt.threshold:
                    active[n] = False
                    continue
                # Re-join the trunk (same or adjacent position): reuse the rest of the trunk.
                j = _rejoin(br[1:], r.trunk[i + 1 :])
                if j is not None:
                    br += r.trunk[i + 1 + j :][: limit - len(br)]
                    active[n] = False
        for (k, i, _), br in zip(starts, branches):
            live[k].branches.append((i, br))

    # ------------------------------------------------------------------ verification
    def _verify(self, live: list[_Row], tcache: DecoderCache) -> None:
        dev = tcache.lengths.device
        # Per row: context tokens (unseen by the target; the last is the root), then tree nodes with parents.
        layouts = []
        for r in live:
            ctx = r.seq[r.target_len :]
            tokens, parent, depth = list(ctx), list(range(-1, len(ctx) - 1)), list(range(len(ctx)))
            root = len(ctx) - 1
            seq_of = [0] * len(tokens)  # which candidate sequence (0 = trunk, n = branch n) a node belongs to
            trunk_nodes = []
            for i, t in enumerate(r.trunk):
                parent.append(trunk_nodes[-1] if trunk_nodes else root)
                trunk_nodes.append(len(tokens))
                tokens.append(t)
                depth.append(depth[root] + i + 1)
                seq_of.append(0)
            for n, (i, br) in enumerate(r.branches, 1):
                prev = trunk_nodes[i - 1] if i > 0 else root
                for m, t in enumerate(br):
                    parent.append(prev)
                    prev = len(tokens)
                    tokens.append(t)
                    depth.append(depth[root] + i + m + 1)
                    seq_of.append(n)
            layouts.append((tokens, parent, depth, root, seq_of))
        q = max(len(lay[0]) for lay in layouts)
        tok_t = torch.full((len(live), q), self.eos, dtype=torch.long, device=dev)
        anc_t = torch.eye(q, dtype=torch.bool, device=dev).repeat(len(live), 1, 1)
        dep_t = torch.zeros((len(live), q), dtype=torch.long, device=dev)
        first = torch.zeros((len(live), q), dtype=torch.bool, device=dev)
        for k, (tokens, parent, depth, root, _) in enumerate(layouts):
            n = len(tokens)
            tok_t[k, :n] = torch.tensor(tokens)
            dep_t[k, :n] = torch.tensor(depth)
            for a in range(n):
                p = parent[a]
                if p >= 0:
                    anc_t[k, a] |= anc_t[k, p]
            for a in range(root, n):
                first[k, a] = len(live[k].hyp.tokens) + depth[a] - depth[root] == 0
        logits = self.target.decode(tcache, tok_t, anc_t, dep_t)
        best = self.target.suppress(logits, first=first).argmax(-1).tolist()

        keeps, counts = [], []
        for k, (r, (tokens, parent, depth, root, seq_of)) in enumerate(zip(live, layouts)):
            children: dict[int, list[int]] = {}
            for a in range(root + 1, len(tokens)):
                children.setdefault(parent[a], []).append(a)
            path, cur = [], root
            while True:
                nxt = [c for c in children.get(cur, []) if tokens[c] == best[k][cur]]
                if not nxt:
                    break
                cur = nxt[0]
                path.append(cur)
            accepted = [tokens[a] for a in path]
            emitted = accepted + [best[k][cur]]
            s = r.hyp.stats
            s.target_forward_passes += 1
            s.rounds += 1
            s.draft_tokens_proposed += len(tokens) - root - 1
            s.draft_tokens_accepted += len(accepted)
            keeps.append(list(range(root + 1)) + path)
            counts.append(root + 1 + len(path))
            # Recycling: the rejected continuation of the sequence the accepted path followed.
            followed = r.trunk
            if path and seq_of[path[-1]]:
                i, br = r.branches[seq_of[path[-1]] - 1]
                followed = r.trunk[:i] + br
            r.old_suffix = followed[len(accepted) + 1 :] if len(accepted) < len(followed) else []
            # Draft rollback: the draft cache is valid along the trunk tokens it was fed.
            common = 0
            while common < min(len(accepted), r.fed) and accepted[common] == r.trunk[common]:
                common += 1
            r.target_len = len(r.seq) + len(accepted)
            r.draft_len = len(r.seq) + common
            for t in emitted:
                if t == self.eos:
                    r.hyp.finished = True
                    break
                r.hyp.tokens.append(t)
                r.seq.append(t)
                if r.room <= 0:
                    break
        width = max(len(kp) for kp in keeps)
        keep_t = torch.tensor([kp + [0] * (width - len(kp)) for kp in keeps], device=dev)
        tcache.commit(keep_t, torch.tensor(counts, device=dev))


def speculative_decode(
    target: WhisperASR,
    target_enc: EncoderOutput,
    draft: WhisperASR,
    draft_enc: EncoderOutput,
    caps: Sequence[int],
    options: SpeculationOptions = SpeculationOptions(),
    prefixes: Optional[list[list[int]]] = None,
    target_prefix_kv: Optional[list] = None,
) -> list[Hypothesis]:
    """Exact speculative decoding of a batch: the same tokens as :func:`~rayspec.decoding.ar.greedy_decode`.

    Args:
        target, target_enc: the target model and its encoder output for the batch (``B`` rows).
        draft, draft_enc: the draft model (same tokenizer) and its encoder output for the same rows.
        caps: ``B`` caps on generated tokens (EOS not counted).
        options: :class:`SpeculationOptions`.
        prefixes, target_prefix_kv: start after already decided tokens (see :meth:`SpeculativeDecoder.decode`).

    Returns:
        ``B`` hypotheses (route "draft") with NFE, draft passes, proposed/accepted tokens and rounds.
    """
    return SpeculativeDecoder(target, draft, options).decode(target_enc, draft_enc, caps, prefixes, target_prefix_kv)
