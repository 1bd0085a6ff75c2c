"""Sampled speculative decoding: one rejection sampler, pluggable acceptance ratios (token, relaxed, group).

Notation: ``target_probs`` is the target's distribution ``p`` (Leviathan et al.) and ``draft_probs`` the draft's
``q`` at each position, both after temperature. The sampler walks each row's draft chain, keeps tokens while the
ratio's test passes, then emits one more token: a recovery sample at the first rejection, or a bonus sample from
the target after a full accept. Ratios:

* :class:`TokenRatio` (``sd``): keep ``x`` with ``min(1, p(x) / q(x))``, recover from ``norm(max(0, p - q))``.
  Output distributed exactly as the target's (Leviathan et al. 2023, arXiv:2211.17192, Algorithm 1 / Theorem 3.5;
  Chen et al. 2023, arXiv:2302.01318).
* :class:`RelaxedRatio` (``ssd``): keep with ``min(1, p(x) / q(x)) + beta``: faster, biased (the relaxation the PCG
  paper compares against: PCG, Yanuka et al. 2025, arXiv:2511.13732, section 3).
* :class:`GroupRatio` (``pcg``): Principled Coarse-Graining: acceptance over Acoustic Similarity Groups, exact in
  the distribution over groups (PCG paper, section 2): overlapping groups ``G`` of tokens whose target input
  embeddings have cosine above ``theta``; each token splits its mass equally over its ``N(t)`` groups, so
  ``P_c(G) = sum_{t in G} p(t) / N(t)`` (same for ``Q_c``). A draft token ``x`` is kept with probability
  ``min(1, P_c(K) / Q_c(K))`` for ``K`` drawn uniformly from ``x``'s groups; after a rejection a group is drawn
  from ``norm(max(0, P_c - Q_c))`` and a token of it with probability ``p(t) / N(t) / P_c(K)``. The paper draws the
  group by thinning (its Algorithm 1's GroupResidualSampler) so as not to enumerate groups; with a few hundred
  groups ``P_c`` and ``Q_c`` are one small matmul, so the residual is sampled directly: the same distribution in
  one draw instead of up to ``1 / TV`` rounds of three.

All draws come from a :class:`~rayspec.spec_decode.rng.CounterRNG`, so results are reproducible and batch-invariant.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from .rng import ACCEPT, GROUP, RECOVER, RESIDUAL, CounterRNG, sample


class AcceptanceRatio(Protocol):
    """The acceptance test and recovery distribution of :func:`rejection_sample`."""

    def accept_prob(self, target_probs: torch.Tensor, draft_probs: torch.Tensor, tokens: torch.Tensor,
                    rng: CounterRNG) -> torch.Tensor:
        """Probability of keeping each draft token: float ``[B, K]`` from ``[B, K, V]`` probabilities and int64
        ``[B, K]`` tokens."""
        ...

    def recover(self, target_probs: torch.Tensor, draft_probs: torch.Tensor, rng: CounterRNG,
                offsets: torch.Tensor) -> torch.Tensor:
        """The token after a rejection at position ``offsets[b]``: int64 ``[B]`` from ``[B, V]`` probabilities."""
        ...


class TokenRatio:
    """Token-level speculative sampling (``sd``), exact in distribution."""

    def accept_prob(self, target_probs, draft_probs, tokens, rng):
        """``min(1, p(x) / q(x))`` per draft token: float ``[B, K]``."""
        p = target_probs.gather(-1, tokens[..., None])[..., 0]
        q = draft_probs.gather(-1, tokens[..., None])[..., 0]
        return (p / q.clamp_min(1e-30)).clamp(max=1.0)

    def recover(self, target_probs, draft_probs, rng, offsets):
        """A draw from ``norm(max(0, p - q))`` (from ``p`` where the residual is empty): int64 ``[B]``."""
        residual = (target_probs - draft_probs).clamp_min(0)
        mass = residual.sum(-1, keepdim=True)
        residual = torch.where(mass > 0, residual, target_probs)
        return sample(residual, rng.at(RECOVER, offsets))


@dataclass(frozen=True)
class RelaxedRatio(TokenRatio):
    """``ssd``: keep with ``min(1, p / q) + beta`` (lossy; ``beta = 0`` is ``sd``)."""

    beta: float = 0.3

    def accept_prob(self, target_probs, draft_probs, tokens, rng):
        """``min(1, p(x) / q(x) + beta)`` per draft token: float ``[B, K]``."""
        return (super().accept_prob(target_probs, draft_probs, tokens, rng) + self.beta).clamp(max=1.0)


def similarity_groups(embeddings: torch.Tensor, theta: float) -> torch.Tensor:
    """Acoustic Similarity Groups (PCG section 2): for each token ``t`` the set ``{t' : cos(e_t, e_t') > theta}``
    (``t`` itself included), duplicates kept once.

    Args:
        embeddings: float ``[V, D]``, the target's input embeddings of the tokens.
        theta: cosine threshold (1 or more: every group is a single token, PCG reduces to ``sd``).

    Returns:
        bool ``[G, V]`` membership, ``G <= V``.
    """
    e = torch.nn.functional.normalize(embeddings.float(), dim=-1)
    member = (e @ e.T) > theta
    member |= torch.eye(len(e), dtype=torch.bool, device=e.device)
    return torch.unique(member, dim=0)


class GroupRatio:
    """``pcg``: acceptance over Acoustic Similarity Groups (see the module docstring).

    Args:
        groups: bool ``[G, V]`` from :func:`similarity_groups`.
    """

    def __init__(self, groups: torch.Tensor) -> None:
        self.groups = groups.float()  # [G, V]
        self.per_token = self.groups.sum(0)  # [V] N(t) >= 1
        self.weight = self.groups / self.per_token  # [G, V] w(t) = 1/N(t) where t in G

    def coarse(self, probs: torch.Tensor) -> torch.Tensor:
        """Group masses ``[..., G]`` of token probabilities ``[..., V]``: ``sum_{t in G} probs(t) / N(t)``."""
        return probs @ self.weight.T

    def _pick_group(self, tokens: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """A group of each token, uniformly among its ``N(t)``: int64 ``[...]`` from int64 ``[...]``."""
        member = self.groups.T[tokens]  # [..., G]
        return sample(member, u)

    def accept_prob(self, target_probs, draft_probs, tokens, rng):
        """``min(1, P_c(K) / Q_c(K))`` per draft token, ``K`` one of its groups drawn uniformly: float ``[B, K]``."""
        k = self._pick_group(tokens, rng.uniform(GROUP, tokens.shape[1]))  # [B, K]
        p_c = self.coarse(target_probs).gather(-1, k[..., None])[..., 0]
        q_c = self.coarse(draft_probs).gather(-1, k[..., None])[..., 0]
        return (p_c / q_c.clamp_min(1e-30)).clamp(max=1.0)

    def recover(self, target_probs, draft_probs, rng, offsets):
        """A group from ``norm(max(0, P_c - Q_c))``, then a token of it with probability ``p(t) / N(t) / P_c(G)``:
        int64 ``[B]``."""
        p_c, q_c = self.coarse(target_probs), self.coarse(draft_probs)  # [B, G]
        residual = (p_c - q_c).clamp_min(0)
        chosen = sample(torch.where(residual.sum(-1, keepdim=True) > 0, residual, p_c), rng.at(RESIDUAL, offsets))
        within = target_probs * self.weight[chosen]  # p(t) / N(t) on the chosen group's tokens
        return sample(within, rng.at(RECOVER, offsets))


@dataclass
class SampledAcceptance:
    """Outcome of :func:`rejection_sample`.

    Attributes:
        accepted: int64 ``[B]``, kept draft tokens per row (``0 .. num_draft[b]``).
        next_tokens: int64 ``[B]``, the token after them (a recovered token, or the bonus sample after a full
            accept).
    """

    accepted: torch.Tensor  # [B]
    next_tokens: torch.Tensor  # [B]


def rejection_sample(target_probs: torch.Tensor, draft_probs: torch.Tensor, draft_tokens: torch.Tensor,
                     num_draft: torch.Tensor, rng: CounterRNG, ratio: AcceptanceRatio = TokenRatio()
                     ) -> SampledAcceptance:
    """Speculative sampling over ragged draft chains (Leviathan et al. 2023, arXiv:2211.17192, Algorithm 1).

    Args:
        target_probs: float ``[B, K + 1, V]``, the target's distribution before each draft token and after the last.
        draft_probs: float ``[B, K, V]``, the draft's distribution each draft token was sampled from.
        draft_tokens: int64 ``[B, K]``; entries at or past ``num_draft[b]`` are padding.
        num_draft: int64 ``[B]``, real draft tokens per row (``0 .. K``).
        rng: draws per row at the rows' current positions (position ``j`` of the chain is ``rng.positions + j``).
        ratio: the acceptance test and recovery distribution.

    Returns:
        :class:`SampledAcceptance`.
    """
    b, k = draft_tokens.shape
    dev = target_probs.device
    keep = rng.uniform(ACCEPT, k) < ratio.accept_prob(target_probs[:, :k], draft_probs, draft_tokens, rng)
    keep &= torch.arange(k, device=dev)[None, :] < num_draft[:, None]
    accepted = torch.cumprod(keep.long(), dim=1).sum(1)  # [B] leading kept tokens
    rows = torch.arange(b, device=dev)
    p_at = target_probs[rows, accepted]  # [B, V] target at the first rejected (or the bonus) position
    full = accepted >= num_draft
    if k:
        recovered = ratio.recover(p_at, draft_probs[rows, accepted.clamp(max=k - 1)], rng, accepted)
    else:
        recovered = torch.zeros_like(accepted)
    bonus = sample(p_at, rng.at(RECOVER, accepted))
    return SampledAcceptance(accepted, torch.where(full, bonus, recovered))
