"""A proposer whose draft is the CTC head's greedy hypothesis, re-aligned after every correction: exact
speculation with no draft decoder at all.

SSD (../shared/seeds/ssd-ctc-self-speculative.txt, section 2) verifies the CTC hypothesis once and then decodes
token by token from the verified prefix. Here the hypothesis keeps drafting: each round proposes the part of it not
yet emitted (plus EOS), the target verifies it in one pass with greedy acceptance, and after the target's correction
the proposer re-joins the hypothesis where the correction suggests (a substitution, an insertion or a deletion, as
SpecASR IV.B re-joins a rejected draft; a punctuation token the target adds before a hypothesis word is an
insertion: a CTC head hears no commas). The first round proposes the whole hypothesis; after that the draft length
adapts per row (doubling after a fully kept draft, twice the kept length after a rejection, as transformers'
assisted generation adapts its candidate count), because a wide verification pass of a hypothesis that has
diverged costs more than it saves. The output is the target's greedy output; CTC drafts come free with the encoder.
"""

from __future__ import annotations

import string
from functools import lru_cache

from ..spec.loop import DraftRequest, Feedback, Proposal
from ..spec.tree import DraftTree


MIN_DRAFT = 2  # draft length after a rejection of the first proposed token


class CTCProposer:
    """Drafts the rest of each row's CTC hypothesis (see the module docstring).

    Args:
        hypotheses: per batch row (row keys ``0 .. B-1``), the CTC hypothesis in the target's token ids
            (:attr:`~rayspec.decoding.ssd.CTCDrafts.tokens`); more rows join with :meth:`admit`.
        eos: the target's EOS id; prompt_len: tokens of the decoder prompt (not part of the hypotheses).
        max_draft: most draft tokens per round.
        punctuation: token ids that are punctuation only (:func:`punctuation_tokens`): such a correction before a
            hypothesis token is taken as an insertion (the hypothesis continues where it was).
    """

    def __init__(self, hypotheses: list[list[int]], eos: int, prompt_len: int, max_draft: int = 64,
                 punctuation: frozenset = frozenset()) -> None:
        self.eos, self.prompt_len, self.max_draft, self.punctuation = eos, prompt_len, max_draft, punctuation
        self.hyps: dict = {}  # per row key: its hypothesis
        self.ptr: dict = {}  # next hypothesis position to propose
        self.sent: dict = {}  # tokens proposed last round
        self.emitted: dict = {}  # tokens emitted when last proposing
        self.budget: dict = {}  # draft length of the next round
        self.accepted: dict = {}  # draft tokens the target kept last round
        self.admit([], list(range(len(hypotheses))), hypotheses)

    def admit(self, slots: list[int], ids: list, hypotheses: list[list[int]]) -> None:
        """Take new rows ``ids`` with their CTC hypotheses (continuous batching; the state is kept per row key, so
        the cache ``slots`` they go to do not matter here)."""
        for key, hyp in zip(ids, hypotheses):
            self.hyps[key], self.ptr[key], self.sent[key], self.emitted[key] = hyp, 0, 0, 0
            self.budget[key] = self.max_draft

    def propose(self, requests: list[DraftRequest]) -> list[Proposal]:
        """Rows held but not requested are finished: their state is dropped."""
        for key in set(self.hyps) - {r.index for r in requests}:
            for state in (self.hyps, self.ptr, self.sent, self.emitted, self.budget):
                del state[key]
            self.accepted.pop(key, None)
        out = []
        for r in requests:
            i, hyp = r.index, self.hyps[r.index]
            emitted = r.seq[self.prompt_len :]
            if i in self.accepted:  # re-align after last round: kept tokens, then the target's own token
                k = self.accepted.pop(i)
                self.ptr[i] += k
                if self.sent[i]:  # (a round without a draft leaves the draft length as it was)
                    full = k >= self.sent[i]
                    self.budget[i] = min(self.max_draft, 2 * self.sent[i] if full else max(MIN_DRAFT, 2 * k))
                new = emitted[self.emitted[i] + k :]
                if new:
                    self.ptr[i] = _rejoin(hyp, self.ptr[i], new[0], self.punctuation)
            draft = hyp[self.ptr[i] :] + [self.eos]
            draft = draft[: min(self.budget[i], r.room + 1)] if r.speculate else []
            self.sent[i], self.emitted[i] = len(draft), len(emitted)
            out.append(Proposal(DraftTree.chain(draft)))
        return out

    def update(self, feedback: list[Feedback]) -> None:
        for f in feedback:
            self.accepted[f.index] = len(f.accepted)


def _rejoin(hyp: list[int], pos: int, correction: int, punctuation: frozenset = frozenset()) -> int:
    """Hypothesis position to continue from after the target emitted ``correction`` where ``hyp[pos]`` was
    proposed (or would come next): a match continues at ``pos + 1``; a deletion (the target skipped ``hyp[pos]``:
    ``hyp[pos + 1] == correction``) at ``pos + 2``; a repeat inserted by the target (``hyp[pos - 1] ==
    correction``) or punctuation inserted before a hypothesis token that is not punctuation at ``pos``; anything
    else is taken as a substitution (``pos + 1``)."""
    if pos < len(hyp) and hyp[pos] == correction:
        return pos + 1
    if pos + 1 < len(hyp) and hyp[pos + 1] == correction:
        return pos + 2
    if pos > 0 and pos < len(hyp) and hyp[pos - 1] == correction:
        return pos
    if correction in punctuation and pos < len(hyp) and hyp[pos] not in punctuation:
        return pos
    return pos + 1


@lru_cache(maxsize=8)
def punctuation_tokens(tokenizer) -> frozenset:
    """Ids of ``tokenizer``'s tokens whose text is ASCII punctuation only (",", ".", "?!", ...), for
    :class:`CTCProposer`'s insertion rule (computed once per tokenizer)."""
    texts = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    return frozenset(i for i, t in enumerate(texts) if t and all(c in string.punctuation for c in t))
