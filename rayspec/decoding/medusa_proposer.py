"""The Medusa proposer: a sparse token tree from the Medusa heads' top candidates, read from the target's own hidden
state of the last verification (Cai et al. 2024, arXiv:2401.10774, sections 2.1.1-2.1.2; Whisper-Medusa,
Segal-Feldman et al. 2024, arXiv:2409.15869).

After each verification the loop hands back the target's hidden state at the end of the kept path (the state that
predicted the row's newest token); head ``k`` turns it into candidates for the ``k``-th token after that one. The
tree is Medusa's sparse tree: a fixed set of paths of candidate ranks, more children at shallow depths. The first
round of a row has no hidden state yet and proposes nothing (a plain target step). No draft model, no draft KV
cache, no extra pass: the heads run on the target's side, read out over their candidate vocabulary when they carry
one (:class:`~rayspec.models.medusa.MedusaHeads`). Heads with a cross-attention block (Medusa-Block) also read the
target's keys/values of its last decoder layer, which the loop hands over from its own KV cache (``needs_cross``).
"""

from __future__ import annotations

import functools
from typing import Optional, Sequence

import torch

from ..models.medusa import MedusaHeads
from ..models.whisper import WhisperASR
from ..spec_decode.loop import DraftRequest, Feedback, Proposal
from ..spec_decode.tree import DraftTree

SPARSE_TREE: tuple[tuple[int, ...], ...] = (
    (0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 1), (0, 0, 0, 0),
)
"""Candidate paths of a sparse tree over 4 heads (the default off a CPU): ``(r1, r2, ...)`` is the rank-``r1``
candidate of head 1, then rank-``r2`` of head 2 below it."""
CPU_TREE: tuple[tuple[int, ...], ...] = tuple(p for p in SPARSE_TREE if len(p) == 1)
"""The default on a CPU: head 1's three best candidates. On a CPU a verification pass costs more with every node,
so the shallow tree wins although it saves fewer passes. Chosen on a dev set the heads never saw (speechocean762
train rows 1000-1059 and 60 Piper-read LJSpeech text-only sentences outside every drafter's training set; decoding
alone, batch 1, 2 threads, 2 round-robin runs, whisper-base + its bundled heads): depth 1 1.36-1.39x AR's decoding
speed (1.59x fewer passes), depth 2 1.27-1.30x, depth 3 1.30x, the whole sparse tree 1.23-1.27x (1.76x fewer)."""


def default_tree(device: torch.device) -> tuple[tuple[int, ...], ...]:
    """The candidate tree :class:`MedusaOptions` uses unless given one: :data:`CPU_TREE` on a CPU, else
    :data:`SPARSE_TREE`."""
    return CPU_TREE if torch.device(device).type == "cpu" else SPARSE_TREE


@functools.lru_cache(maxsize=4)
def load_heads(path: str, device: str, dtype: torch.dtype) -> MedusaHeads:
    """Medusa heads from ``path`` on ``device`` in ``dtype``, loaded once per process."""
    return MedusaHeads.from_pretrained(path, device, dtype)


def check_tree(tree: Sequence[Sequence[int]], num_heads: int) -> None:
    """Check a Medusa tree: candidate paths, each a sequence of top-k ranks per head (``(0, 1)``: head 1's best
    token, then head 2's second best).

    Raises:
        ValueError: an empty path, a path deeper than ``num_heads``, or one whose prefix is not a path of ``tree``.
    """
    paths = {tuple(p) for p in tree}
    for p in paths:
        if not p or len(p) > num_heads or (len(p) > 1 and p[:-1] not in paths):
            raise ValueError(f"bad Medusa tree path {p} (prefixes must be paths too; depth <= {num_heads} heads)")


class MedusaProposer:
    """Proposes Medusa token trees for the rows of one batch (see the module docstring).

    Args:
        target: the target (its output projection and suppress lists score the heads); heads: its Medusa heads.
        tree: candidate paths (:data:`SPARSE_TREE`, :data:`CPU_TREE`); cut to the number of heads.

    Raises:
        ValueError: a malformed tree.
    """

    needs_hidden = True

    def __init__(self, target: WhisperASR, heads: MedusaHeads,
                 tree: Sequence[Sequence[int]] = SPARSE_TREE) -> None:
        self.target, self.heads = target, heads
        self.needs_cross = heads.cross_block is not None  # the loop hands its cross-attention over (Medusa-Block)
        self.tree = sorted({tuple(p) for p in tree if len(p) <= heads.num_heads}, key=lambda p: (len(p), p))
        check_tree(self.tree, heads.num_heads)
        self.top = 1 + max(max(p) for p in self.tree)
        self.depth = max(len(p) for p in self.tree)
        self.hidden: dict[int, torch.Tensor] = {}
        self._zero: Optional[torch.Tensor] = None  # [D], the block's input for a row without a hidden state yet
        self.readout = heads.readout(target.model.proj_out.weight)  # [S, D], None: the whole vocabulary

    @torch.inference_mode()
    def propose(self, requests: list[DraftRequest], cross: Optional[tuple] = None) -> list[Proposal]:
        """One token tree per row that has a hidden state and may speculate (the others: an empty proposal).

        Args:
            cross: for heads with a block (``needs_cross``), the loop cache's ``cross()``: per decoder layer the
                target's keys/values ``[B, H, S, Dh]`` of the requested rows, in request order, and their mask.
        """
        ready = [r for r in requests if r.index in self.hidden and r.speculate]
        out = {r.index: Proposal() for r in requests}
        if ready:
            if self.needs_cross:  # every row goes through the block (zeros where not ready): no copy of the cache
                h = torch.stack([self.hidden.get(r.index, self._zero) for r in requests])  # [B, D]
                ks, vs, mask = cross
                states = self.heads(h[:, None], (ks[-1], vs[-1], mask))[: self.depth, :, 0]  # [K, B, D]
                pick = [k for k, r in enumerate(requests) if r.index in self.hidden and r.speculate]
                if len(pick) < len(requests):
                    states = states[:, pick]  # [K, R, D]
            else:
                h = torch.stack([self.hidden[r.index] for r in ready])  # [R, D]
                states = self.heads(h)[: self.depth]  # [K, R, D]
            if self.readout is None:
                logits = self.target.suppress(self.target.project(states))  # [K, R, V]
                cand = logits.topk(self.top, dim=-1).indices  # [K, R, top]
            else:  # the candidate vocabulary holds only tokens the target emitted (none it suppresses)
                top = self.heads.logits(states, self.readout).topk(self.top, dim=-1).indices  # [K, R, top]
                cand = self.heads.vocab[top]
            cand = cand.permute(1, 0, 2).tolist()  # one device read: [R][K][top]
            for r, c in zip(ready, cand):
                node: dict[tuple[int, ...], int] = {}
                tokens, parents = [], []
                for path in self.tree:
                    if len(path) >= r.room:  # the row cannot emit this deep (the bonus token comes first)
                        continue
                    node[path] = len(tokens)
                    tokens.append(c[len(path) - 1][path[-1]])
                    parents.append(node[path[:-1]] if len(path) > 1 else -1)
                out[r.index] = Proposal(DraftTree(tuple(tokens), tuple(parents)))
        return [out[r.index] for r in requests]

    def admit(self, slots: list[int], ids: list, extra=None) -> None:
        """New rows (continuous batching) need nothing here: a row is drafted from the round after its first
        target pass, once its hidden state has come back."""

    def update(self, feedback: list[Feedback]) -> None:
        """Keep each row's target hidden state at its last committed token (float ``[d_model]``): the heads' input
        of the next round."""
        self.hidden = {f.index: f.hidden for f in feedback}
        if feedback and self._zero is None:
            self._zero = torch.zeros_like(feedback[0].hidden)
