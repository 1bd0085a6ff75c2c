"""Acceptance rules: which draft tokens the target keeps, and the token it emits after them.

One module for every method, as vLLM's one rejection sampler serves all its proposers:

* Tree rules, deterministic given the target's logits at every tree node (:func:`accept_tree`):
  - ``greedy``: a node is kept if its token is the target's argmax at its parent. The longest kept root path is the
    target's own greedy continuation (Leviathan et al. 2023, arXiv:2211.17192, at temperature 0; tree verification
    after SpecInfer, arXiv:2305.09781; SpecASR IV.C).
  - ``threshold``: kept if the target's probability of the token exceeds ``tau`` (SSD, CTC self-speculative decoding,
    Saon et al. 2026, arXiv:2603.11243, section 2, eq. 5; on a chain the verified prefix ends at the first
    failing token, eq. 6), and with ``exact`` also the argmax.
  - ``typical``: kept if its probability exceeds ``min(epsilon, delta * exp(-H))`` with ``H`` the entropy of the
    target's distribution at the parent (Medusa's typical acceptance, Cai et al. 2024, arXiv:2401.10774, section
    2.3.1; Whisper-Medusa uses it). The longest kept path wins.
  - ``topk``: kept if its token is among the target's ``top_k`` most likely at the parent (PredGen's top-k
    verifier, Li & Grover 2025, arXiv:2506.15556, section 3.1.1).

  In all four the emitted token after the path is the target's argmax at its last node (the "bonus" token), so
  ``greedy`` is exact and the others are lossy with a threshold.
* Sampled decoding with draft probabilities (rejection sampling with token, relaxed or group-level ratios) lives in
  :mod:`rayspec.spec_decode.sampling`.

Host/device split: the per-node statistics are computed on the device and read back in ONE transfer
(:func:`score_tree`), the path search then runs on the host over the trees' padded numpy layout.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional


import numpy as np
import torch

from .gumbel import token_logprobs, vocab_argmax
from .timestamps import apply_rules
from .tree import DeviceTrees

RULES = ("greedy", "threshold", "typical", "topk")
LAZY_MARGIN = 1e-3  # relative: a token logit this close below the bound still counts as a possible argmax


@dataclass(frozen=True)
class AcceptanceRule:
    """Which draft tokens a tree verification keeps (see the module docstring).

    Attributes:
        kind: "greedy", "threshold", "typical" or "topk".
        tau: ``threshold``: keep tokens whose target probability is above this (SSD eq. 5).
        exact: ``threshold``: also require the target's argmax.
        epsilon, delta: ``typical``: keep tokens with probability above ``min(epsilon, delta * exp(-H))``.
        top_k: ``topk``: keep tokens among the target's ``top_k`` most likely.
    """

    kind: str = "greedy"
    tau: float = 0.1
    exact: bool = True
    epsilon: float = 0.09
    delta: float = 0.3
    top_k: int = 3

    def __post_init__(self):
        if self.kind not in RULES:
            raise ValueError(f"unknown acceptance rule {self.kind!r}; choose from {', '.join(RULES)}")

    @property
    def lossless(self) -> bool:
        """Whether the rule keeps only the target's own argmax tokens (greedy, or threshold with ``exact``): then
        the output does not depend on which rounds verify drafts."""
        return self.kind == "greedy" or (self.kind == "threshold" and self.exact)


GREEDY = AcceptanceRule()


def score_tree(logits: torch.Tensor, trees: DeviceTrees, rule: AcceptanceRule,
               extra: Optional[torch.Tensor] = None, best: Optional[torch.Tensor] = None) -> np.ndarray:
    """Per node: whether it passes ``rule`` given its parent, and the target's argmax at the node.

    Args:
        logits: float ``[B, Q, V]``, the target's logits at every padded tree node (suppression applied).
        trees: the same trees on the device.
        extra: optional int64 ``[K, B, Q]`` per-node values to read back in the same transfer.
        best: ``logits.argmax(-1)`` (int64 ``[B, Q]``) where the caller has it already (an argmax over the
            vocabulary costs as much as a log-softmax on a CPU); None: computed here.

    Returns:
        int64 ``[2 (+ K), B, Q]`` on the host: ``[0]`` 1 where the node's token passes at its parent (meaningless for
        context nodes and padding), ``[1]`` the argmax token at the node, then ``extra``. One device-to-host transfer.
    """
    best = vocab_argmax(logits) if best is None else best  # [B, Q]
    at_parent = best.gather(1, trees.parents)  # [B, Q]
    if rule.kind == "greedy":
        ok = trees.tokens == at_parent
    elif rule.kind == "topk":
        top = logits.topk(rule.top_k, dim=-1).indices  # [B, Q, k]
        top_parent = top.gather(1, trees.parents[..., None].expand(-1, -1, rule.top_k))  # [B, Q, k]
        ok = (top_parent == trees.tokens[..., None]).any(-1)
    else:
        logp = torch.log_softmax(logits.float(), dim=-1)  # [B, Q, V]
        v = logp.shape[-1]
        # log p(token | parent) read in place (the threshold rule needs no [B, Q, V] copy at the parents)
        tok_lp = logp.view(logp.shape[0], -1).gather(1, trees.parents * v + trees.tokens)  # [B, Q]
        if rule.kind == "threshold":
            ok = tok_lp > (math.log(rule.tau) if rule.tau > 0 else -math.inf)
            if rule.exact:
                ok &= trees.tokens == at_parent
        else:
            lp_parent = logp.gather(1, trees.parents[..., None].expand(-1, -1, v))  # [B, Q, V]
            entropy = -(lp_parent.exp() * lp_parent).sum(-1)  # [B, Q], nats
            floor = torch.minimum(torch.full_like(entropy, rule.epsilon), rule.delta * torch.exp(-entropy))
            ok = (tok_lp.exp() > floor) | (trees.tokens == at_parent)
    out = torch.stack([ok.long(), best])
    return (out if extra is None else torch.cat([out, extra])).cpu().numpy()


def score_greedy_lazily(hidden: torch.Tensor, trees: DeviceTrees, head, rules=None) -> np.ndarray:
    """:func:`score_tree` for the ``greedy`` rule, projecting to the vocabulary only at the nodes that can matter.

    A node matters if it is a row's root or if its parent matters and its token may be the argmax there. A token
    cannot be the argmax where some other token's logit is larger, so a cheap lower bound of the largest logit (the
    head's ``shortlist_bound``: the largest over the few thousand most common tokens) rules most rejected draft
    nodes out, and everything below them, without their ``V``-way projection. Every node the accepted path or the
    emitted token is read from matters, so the result equals :func:`score_tree` on the full logits wherever
    :func:`accept_tree` reads it: exact, as long as the bound and the token logits (computed apart from the full
    projection, so rounded differently) are compared with a margin (:data:`LAZY_MARGIN`, relative). Where a batch
    drafts many nodes per row and most are rejected (a Medusa tree, a long chain), this saves most of the output
    projection, the largest product of a Whisper decoder pass.

    Args:
        hidden: float32 ``[B, Q, D]``, the target's final hidden states at every padded tree node.
        trees: the same trees on the device (with ``host``).
        head: the target's output head: ``token_logits(hidden, tokens, first)``, ``shortlist_bound(hidden)``,
            ``project(hidden)`` and ``suppress(logits, first)`` (:class:`~rayspec.models.whisper.WhisperASR`).
        rules: optional ``(bounds, tt)``: Whisper's timestamp rules (:func:`~rayspec.spec_decode.timestamps.rule_bounds`'
            int64 ``[4, B, Q]`` host bounds and the timestamp tokens). At a parent where the rules ban no text token
            the shortlist bound still bounds the best allowed token (a forced timestamp bans all text, so a text
            token below the bound loses either way); a token the rules ban at its parent cannot be the argmax; an
            allowed timestamp, or EOS where only timestamps and EOS are allowed, may be (it is projected).

    Returns:
        int64 ``[3, B, Q]``: ``[:2]`` as :func:`score_tree`, with argmax ``-1`` at the nodes that do not matter (and
        verdict 0 below them); ``[2]`` the bits of float64 log-probabilities of each node's argmax
        (:func:`~rayspec.spec_decode.gumbel.token_logprobs`; ``scores[2].view(np.float64)``), NaN where the node does
        not matter.
    """
    lay = trees.host
    b, q = lay["tokens"].shape
    first = torch.from_numpy(lay["first"]).to(hidden.device)  # [B, Q]
    at_parent = trees.parents[..., None].expand(-1, -1, hidden.shape[-1])
    parent_first = first.gather(1, trees.parents)  # [B, Q] begin-suppression applies at the parent
    token = head.token_logits(hidden.gather(1, at_parent), trees.tokens, parent_first)  # [B, Q] at the parent
    bound = head.shortlist_bound(hidden).gather(1, trees.parents)  # [B, Q] at the parent
    maybe = (token >= bound - LAZY_MARGIN * (bound.abs() + 1)).cpu().numpy()
    parents, roots = lay["parents"], lay["roots"]
    if rules is not None:
        bounds, tt = rules
        at = np.maximum(parents, 0)
        text_hi, ts_lo, ts_hi, on = (x[np.arange(b)[:, None], at] for x in bounds)  # the rules at each parent
        tok = lay["tokens"]
        stamp = tok >= tt.begin
        allowed = np.where(stamp, (tok >= ts_lo) & (tok <= ts_hi), tok >= text_hi)
        # text open: the bound holds for every token but a timestamp; after a segment's end: EOS, specials and
        # timestamps compete; at the first position: timestamps alone
        maybe = np.where(on > 0, allowed & np.where(text_hi == 0, maybe | stamp, (text_hi == tt.eot) | stamp),
                         maybe)
    rows = np.arange(b)
    matters = _reachable(lay, maybe)
    matters[rows, roots] = True
    flat = torch.from_numpy(np.flatnonzero(matters)).to(hidden.device)
    logits = head.suppress(head.project(hidden.reshape(b * q, -1)[flat]), first.reshape(-1)[flat])
    if rules is not None:
        picked = np.flatnonzero(matters)
        logits = apply_rules(logits[None].contiguous(), rules[0].reshape(4, -1)[:, picked][:, None], rules[1])[0]
    best = np.full(b * q, -1, dtype=np.int64)
    top = logits.argmax(-1)
    best[flat.cpu().numpy()] = top.cpu().numpy()
    best = best.reshape(b, q)
    logprob = np.full(b * q, np.nan)
    logprob[flat.cpu().numpy()] = token_logprobs(logits, top).cpu().numpy()
    ok = (parents >= 0) & (lay["tokens"] == best[rows[:, None], np.maximum(parents, 0)])
    return np.stack([ok.astype(np.int64), best, logprob.view(np.int64).reshape(b, q)])


def _reachable(layout: dict, passes: np.ndarray) -> np.ndarray:
    """bool ``[B, Q]``: the draft nodes whose whole path from their row's root (root excluded) passes, given bool
    ``[B, Q]`` per-node verdicts and the trees' padded host layout."""
    parents, roots, sizes = layout["parents"], layout["roots"], layout["sizes"]
    b, q = passes.shape
    node = np.arange(q)[None, :]
    good = passes & (node > roots[:, None]) & (node < sizes[:, None])  # [B, Q] passing real draft nodes
    rows = np.arange(b)
    for j in range(q):  # parents come first: one pass in node order
        p = parents[:, j]
        good[:, j] &= np.where(p >= 0, good[rows, np.maximum(p, 0)], False) | (p == roots)
    return good


@dataclass
class AcceptedPaths:
    """The outcome of verifying ``B`` token trees.

    Attributes:
        paths: per row, the row-local node indices of the kept draft path, root excluded (``[]``: none kept).
        next_tokens: int64 ``[B]``, the target's token after each path (bonus or correction).
    """

    paths: list[list[int]]
    next_tokens: np.ndarray  # [B]

    @property
    def accepted(self) -> np.ndarray:
        """int64 ``[B]``, kept draft tokens per row."""
        return np.asarray([len(p) for p in self.paths], dtype=np.int64)


def accept_tree(layout: dict, scores: np.ndarray) -> AcceptedPaths:
    """The longest root path of passing draft nodes per row (ties: the first in node order).

    Args:
        layout: the trees' padded host layout (:meth:`TokenTrees.padded`, e.g. ``DeviceTrees.host``);
        scores: int64 ``[2, B, Q]`` from :func:`score_tree`.
    """
    best = scores[1]
    parents, depths, roots = layout["parents"], layout["depths"], layout["roots"]
    b = len(roots)
    rows = np.arange(b)
    good = _reachable(layout, scores[0].astype(bool))
    score = np.where(good, depths, -1)
    end = np.where(score.max(1) >= 0, score.argmax(1), roots)  # [B] last node of each kept path
    paths = []
    for k in range(b):
        path, n = [], int(end[k])
        while n != roots[k]:
            path.append(n)
            n = int(parents[k, n])
        paths.append(path[::-1])
    return AcceptedPaths(paths, best[rows, end])
