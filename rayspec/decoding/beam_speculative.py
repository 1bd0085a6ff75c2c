"""Exact speculation under beam search: several beam-search steps from one target pass, with the tokens, order and
scores of plain beam search (:mod:`rayspec.decoding.beam`).

A round, for every live audio at once:

1. Draft: every live beam gets a draft chain, its guess of the beam's next tokens (:class:`LookupDrafter`: the
   continuation of the beam's tail in a reference token sequence of its audio, e.g. the CTC head's hypothesis that
   comes free with the encoder; any drafter keeps the result exact).
2. Verify: one target pass over each beam row's newest token followed by its draft (a causal chain per row, as the
   verify loop's chains; ``1 + m`` new positions per row). It yields the filtered log-probabilities (suppression,
   timestamp rules per node) of the token after the beam *and* after each of the beam's drafted extensions.
3. Simulate beam search on the host, step by step: a step needs the next-token log-probabilities of every current
   beam, which exist while each beam is its pass row's beam extended by a prefix of that row's draft. After a step,
   each kept beam is its source beam plus one token; where that token is the source's next draft token the new
   beam is again on a drafted path, and the next step can be taken from the same pass. The round stops at the
   first step that keeps a beam off the drafted paths (or that ends the audio's search): the steps taken are
   exactly plain beam search's steps, computed from the same log-probabilities.
4. Commit: each kept beam's cache row becomes its source row with the positions of the beam's drafted prefix kept
   (committed, then gathered into the beams' rows with :meth:`~rayspec.models.cache.DecoderCache.reorder` and cut
   back with ``crop``); its newest token is fed in the next round.

So a round costs one (wider) target pass and advances one step or more: plain beam search is the case of empty
drafts. The tokens equal plain beam search's as long as a node's logits in a multi-token pass equal a one-token
step's; in float32 they differ in the last bits (the same caveat as every exact method against ``ar``), which the
tests check does not change a result.
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from ..models.encoded import EncoderOutput
from ..models.whisper import WhisperASR
from .beam import BeamOptions, BeamSearch
from .common import Hypothesis

ROUTE = "beam-spec"
DEFAULT_MAX_DRAFT = 6  # draft tokens per beam and round
LOOKUP_NGRAM = 3  # longest beam tail matched in the reference


class LookupDrafter:
    """Drafts a beam's next tokens from a reference token sequence of its audio (prompt-lookup decoding: Saxena
    2023; here the reference is e.g. the CTC hypothesis, :func:`~rayspec.decoding.ssd.ctc_drafts`).

    The beam's last ``n`` tokens (``n`` = :data:`LOOKUP_NGRAM` down to 1) are looked up in the reference; of their
    occurrences the one ending nearest the beam's own length is taken, and the reference tokens after it are the
    draft. An empty beam drafts the reference's start; a beam whose tail is nowhere in the reference drafts nothing.

    Args:
        references: per audio (row index of the batch), token ids without prompt or EOT.
        max_draft: most draft tokens per beam and round.
    """

    def __init__(self, references: Sequence[Sequence[int]], max_draft: int = DEFAULT_MAX_DRAFT) -> None:
        if max_draft < 0:
            raise ValueError(f"max_draft must be >= 0, got {max_draft}")
        self.references = [list(r) for r in references]
        self.max_draft = max_draft

    def propose(self, audio: int, tokens: Sequence[int], room: int) -> list[int]:
        """Draft tokens for a beam of audio ``audio`` whose generated tokens are ``tokens``; at most ``room``."""
        ref, m = self.references[audio], min(self.max_draft, room)
        if m <= 0 or not ref:
            return []
        if not tokens:
            return ref[:m]
        for n in range(min(LOOKUP_NGRAM, len(tokens)), 0, -1):
            tail = list(tokens[-n:])
            ends = [i + n for i in range(len(ref) - n) if ref[i : i + n] == tail]  # a continuation must follow
            if ends:
                end = min(ends, key=lambda e: (abs(e - len(tokens)), e))
                return ref[end : end + m]
        return []


class SpeculativeBeamSearch(BeamSearch):
    """Beam search that verifies drafts for every beam in one target pass per round (see the module docstring).

    Args:
        target: the target model; options: the beam settings; drafter: any object with
            ``propose(audio, tokens, room) -> list[int]`` (:class:`LookupDrafter`); max_draft: most of a draft's
            tokens verified per beam and round (the rest are cut).
    """

    route = ROUTE

    def __init__(self, target: WhisperASR, options: BeamOptions, drafter, max_draft: int = DEFAULT_MAX_DRAFT
                 ) -> None:
        super().__init__(target, options)
        self.drafter = drafter
        self.max_draft = max_draft

    def _step(self, live, cache, out):
        rows = cache.batch_size
        by_row = self._by_row(live, rows)
        drafts = []
        for a, j in by_row:
            tokens = a.beams[j].tokens
            # a beam of L tokens takes at most cap - L more steps: logits after L .. cap - 1 tokens
            room = min(self.max_draft, a.cap - len(tokens) - 1)
            draft = self.drafter.propose(a.index, tokens, room) if room > 0 else []
            drafts.append([int(x) for x in draft[:room] if x != self.eot])
        width = 1 + max(len(d) for d in drafts)
        chains = np.full((rows, width), self.eot, dtype=np.int64)  # padding: never attended to, never committed
        for k, ((a, j), d) in enumerate(zip(by_row, drafts)):
            chains[k, : 1 + len(d)] = [a.beams[j].tokens[-1], *d]
        hidden = self._decode(live, cache, chains)  # [R, 1 + m, D]
        values, ids = self._logprobs(hidden, by_row, drafts)  # [R, 1 + m, C]
        base = cache.host_lengths.copy()
        cache.commit(np.tile(np.arange(width), (rows, 1)), np.asarray([1 + len(d) for d in drafts]))

        plan = []  # (audio, per new beam: (source row, drafted tokens its cache row keeps))
        for a in live:
            s = a.stats
            s.target_forward_passes += 1
            s.rounds += 1
            s.draft_tokens_proposed += sum(len(drafts[r]) for r in a.rows)
            at = [(r, 0) for r in a.rows]  # per beam: (pass row, draft tokens consumed)
            steps = 0
            while True:
                sources = self.decoder.update(a, np.stack([values[r, d] for r, d in at]),
                                              np.stack([ids[r, d] for r, d in at]))
                steps += 1
                if self.decoder.done(a):
                    out[a.index] = self.decoder.finalize(a, self.route)
                    break
                nxt = []
                for beam, src in zip(a.beams, sources):
                    r, d = at[src]
                    on_path = d < len(drafts[r]) and drafts[r][d] == beam.tokens[-1]
                    nxt.append((r, d + 1) if on_path else None)
                if any(x is None for x in nxt):
                    plan.append((a, [at[src] for src in sources]))
                    break
                at = nxt
            s.draft_tokens_accepted += steps - 1

        gather, lengths = np.arange(rows), cache.host_lengths.copy()
        for a, sources in plan:
            slots = a.rows[: len(sources)]
            for slot, (r, d) in zip(slots, sources):
                gather[slot] = r
                lengths[slot] = base[r] + d + 1  # the row's newest token and d drafted tokens
            a.rows = slots
        cache.reorder(gather)
        cache.crop(lengths)
        return self._compact(live, plan, cache)


def speculative_beam_decode(target: WhisperASR, enc: EncoderOutput, caps: Sequence[int], drafter,
                            options: BeamOptions = BeamOptions(), prompts: Optional[Sequence[Sequence[int]]] = None,
                            max_draft: int = DEFAULT_MAX_DRAFT) -> list[Hypothesis]:
    """:func:`~rayspec.decoding.beam.beam_decode` with several search steps per target pass where ``drafter``'s
    drafts allow (module docstring): the same hypotheses (tokens, ``finished``, ``sum_logprob``), route
    "beam-spec"; ``stats.target_forward_passes`` counts the passes (the prompt pass included), ``stats.rounds`` the
    drafted rounds, ``draft_tokens_proposed`` the drafts sent (all beams), ``draft_tokens_accepted`` the extra steps
    taken from them.

    Args:
        drafter: ``propose(audio, tokens, room) -> list[int]`` per beam (:class:`LookupDrafter`); max_draft: most
            draft tokens verified per beam and round; other arguments as :func:`~rayspec.decoding.beam.beam_decode`.

    Raises:
        ValueError: as :func:`~rayspec.decoding.beam.beam_decode`.
    """
    return SpeculativeBeamSearch(target, options, drafter, max_draft).decode(enc, caps, prompts)
