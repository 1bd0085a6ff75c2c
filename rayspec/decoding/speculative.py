"""Exact, batched draft-model speculative decoding with SpecASR's three techniques: the verifying side.

Source: SpecASR (../shared/seeds/specasr.txt): IV.A adaptive single-sequence prediction, IV.B draft sequence
recycling, IV.C two-pass sparse token tree; tree attention after SpecInfer. Verification is exact greedy acceptance
(Leviathan et al. 2023 with temperature 0): the output equals the target's own greedy output token for token.

One round, for every live row of the batch at once (rows accept different numbers of tokens):

1. Draft: a proposer (:class:`~rayspec.decoding.proposer.DraftProposer`, in this process or behind a Ray actor)
   returns a trunk and branches per row (SpecASR IV.A-C; see :mod:`rayspec.decoding.proposer`).
2. Verify: the target scores the root (its last unseen token), the trunk and every branch in ONE pass under a tree
   attention mask. Walking from the root, a child is accepted while its token equals the target's argmax at its
   parent; the longest accepted root-to-leaf path wins and the target's argmax after it is the bonus token.
3. Commit: the target cache keeps the root and the accepted path (compacted); the next request tells the proposer
   how much of its cache is still valid (the longest trunk prefix it fed that was accepted); EOS or the cap ends a
   row, which leaves the batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Protocol, Sequence

import torch

from ..models.cache import DecoderCache
from ..models.whisper import EncoderOutput, WhisperASR
from .common import Hypothesis
from .proposer import DraftProposal, DraftProposer, DraftRequest, SpeculationOptions, check_compatible


class Proposer(Protocol):
    """What the verifier needs from a drafting side: :class:`~rayspec.decoding.proposer.DraftProposer` in
    process, or ``actors.drafter.RemoteProposer`` for a proposer hosted by a Ray actor."""

    def propose(self, requests: list[DraftRequest]) -> list[DraftProposal]: ...


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
    draft: DraftProposal = field(default_factory=DraftProposal)  # this round's proposal

    @property
    def room(self) -> int:
        return self.cap - len(self.hyp.tokens)

    def request(self) -> DraftRequest:
        return DraftRequest(self.index, list(self.seq), self.draft_len, self.room, list(self.old_suffix))


class SpeculativeDecoder:
    """Batched draft-then-verify decoding of one batch (see the module docstring for the algorithm).

    Args:
        target: the target model.
        proposer: the drafting side for the same batch rows (it must share the target's tokenizer).
        options: :class:`SpeculationOptions` (the proposer's; they size the verification tree).
    """

    def __init__(self, target: WhisperASR, proposer: Proposer, options: SpeculationOptions) -> None:
        self.target, self.proposer, self.opt = target, proposer, options
        self.eos = target.eos_token_id

    @torch.inference_mode()
    def decode(
        self,
        target_enc: EncoderOutput,
        caps: Sequence[int],
        prefixes: Optional[list[list[int]]] = None,
        target_prefix_kv: Optional[list] = None,
    ) -> list[Hypothesis]:
        """Decode a batch; returns one hypothesis per row (route "draft"), identical to AR greedy's tokens.

        Args:
            target_enc: the target's encoder output (``B`` rows); caps: ``B`` caps on generated tokens.
            prefixes: optional per-row tokens already decided (e.g. a verified CTC prefix plus the target's next
                token); decoding continues after them.
            target_prefix_kv: optional target keys/values of prompt + prefix minus its last token, per row (from
                :meth:`~rayspec.models.cache.DecoderCache.export_rows`), so the target does not recompute them.

        Raises:
            ValueError: prefix keys/values that do not match the prefixes.
        """
        b = target_enc.states.shape[0]
        prompt = list(self.target.prompt_ids)
        prefixes = prefixes or [[] for _ in range(b)]
        tcache = self.target.new_cache(target_enc, len(prompt) + max(caps) + self.opt.nodes_per_round + 2)
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
            rows_t = torch.tensor([r.index for r in live], dtype=torch.long, device=tcache.lengths.device)
            tcache = tcache.select(rows_t)
        while live:
            for r, d in zip(live, self.proposer.propose([r.request() for r in live])):
                r.draft = d
                r.hyp.stats.draft_forward_passes += d.passes
            self._verify(live, tcache)
            keep = [k for k, r in enumerate(live) if not (r.hyp.finished or r.room <= 0)]
            if len(keep) < len(live):
                tcache = tcache.select(torch.tensor(keep, dtype=torch.long, device=tcache.lengths.device))
                live = [live[k] for k in keep]
        return [r.hyp for r in rows]

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
            for i, t in enumerate(r.draft.trunk):
                parent.append(trunk_nodes[-1] if trunk_nodes else root)
                trunk_nodes.append(len(tokens))
                tokens.append(t)
                depth.append(depth[root] + i + 1)
                seq_of.append(0)
            for n, (i, br) in enumerate(r.draft.branches, 1):
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
            trunk = r.draft.trunk
            followed = trunk
            if path and seq_of[path[-1]]:
                i, br = r.draft.branches[seq_of[path[-1]] - 1]
                followed = trunk[:i] + br
            r.old_suffix = followed[len(accepted) + 1 :] if len(accepted) < len(followed) else []
            # Draft rollback: the draft cache is valid along the trunk tokens it was fed.
            common = 0
            while common < min(len(accepted), r.draft.fed) and accepted[common] == trunk[common]:
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
    check_compatible(target, draft)
    proposer = DraftProposer(draft, draft_enc, caps, options)
    return SpeculativeDecoder(target, proposer, options).decode(target_enc, caps, prefixes, target_prefix_kv)
