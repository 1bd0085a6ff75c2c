"""The decoding method registry: every method's name, what it needs, whether it is exact and how it decodes.

The CLI's ``--method`` choices and help, the drafting side (which models to load, what to compute next to the
target's encoder), the target side (which decoder runs) and Serve/jobs/bench all read :data:`METHODS`, so a method
is defined in one place. Each method is a proposer (or none) over the shared verify loop
(:class:`~rayspec.spec_decode.loop.VerifyLoop`) and an acceptance rule; adding one takes its proposer module and one
:class:`Method` entry here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from .decoding.ar import greedy_decode
from .decoding.common import Hypothesis
from .decoding.options import METHOD_SUMMARIES, DecodeOptions
from .decoding.ctc_proposer import CTC_MAX_DRAFT, CTCProposer, continuation_tokens, punctuation_tokens
from .decoding.medusa_proposer import MedusaProposer, load_heads
from .decoding.proposer import DraftProposer
from .decoding.speculative import draft_loop
from .decoding.ssd import CTCDrafts, SSDDecoder
from .models.registry import default_drafter
from .models.encoded import EncoderOutput
from .models.whisper import WhisperASR
from .spec_decode.acceptance import GREEDY, AcceptanceRule
from .spec_decode.loop import Admission, Proposer, VerifyLoop

ProposerFactory = Callable[[list[int], list[int]], Proposer]
"""``(rows, caps) -> proposer`` over those rows (indices into the batch, in that order) with those token caps."""

@dataclass
class Encoded:
    """What the drafting side computes for a batch of ``B`` waveforms, and the target side decodes from.

    Attributes:
        target: the target's encoder output (``states`` ``[B, S, D]`` in the model dtype, ``lengths`` int64 ``[B]``).
        caps: ``B`` caps on generated tokens (from the audio durations).
        ctc: the CTC drafts (method "ssd"), else None.
        draft: the encoder output the draft model reads (method "draft", or "ssd" with the draft fallback): its own,
            or ``target`` itself for a decoder-only draft; else None.
        keys: ``B`` stable row keys (seed sampled rows), or None (the row indices).
        drafted: False where the drafting side skipped the method's drafter because nothing would read its drafts
            (beam search that does not speculate, :func:`~rayspec.pipeline.beam_speculates`): rows decoded again
            later (fallback, sampled requests) then decode with ``ar``, the same tokens.
    """

    target: EncoderOutput
    caps: list[int]
    ctc: Optional[CTCDrafts] = None
    draft: Optional[EncoderOutput] = None
    keys: Optional[list[str]] = None
    drafted: bool = True

    def to(self, device, dtype: Optional[torch.dtype] = None) -> "Encoded":
        """The same batch with its tensors on ``device`` (CPU before crossing Ray's object store) and the target's
        encoder states cast to ``dtype`` if given."""
        target = self.target.to(device, dtype)
        draft = target if self.draft is self.target else self.draft.to(device) if self.draft else None
        return Encoded(target, self.caps, self.ctc, draft, self.keys, self.drafted)

    def select(self, rows: list[int]) -> "Encoded":
        """The rows ``rows`` (indices; repeats allowed) of this batch."""
        def pick(enc: Optional[EncoderOutput]) -> Optional[EncoderOutput]:
            return None if enc is None else enc.select(torch.tensor(rows, device=enc.states.device))
        target = pick(self.target)
        draft = target if self.draft is self.target else pick(self.draft)
        ctc = None if self.ctc is None else self.ctc.select(rows)
        return Encoded(target, [self.caps[i] for i in rows], ctc, draft,
                       None if self.keys is None else [self.keys[i] for i in rows], self.drafted)

    def key(self, row: int) -> str:
        """The stable key of row ``row`` (seeds its sampling): its utterance id and segment, else its index."""
        return self.keys[row] if self.keys is not None else str(row)


@dataclass(frozen=True)
class Method:
    """One decoding method.

    Attributes:
        name: the ``--method`` value (one sentence on it for ``--help``: :attr:`summary`).
        decode: ``(target, options, encoded, proposers) -> hypotheses`` for one encoded batch (the target side).
        needs_ctc: the drafting side runs the CTC head over the target's encoder states (SSD's drafter).
        needs_draft: ``options -> bool``, whether a draft model proposes (then the drafting side also encodes with
            the draft model, unless it is decoder-only, and serves its proposals).
        exact: ``options -> bool``, whether the output provably equals the target's greedy output.
        stream: ``(target, options, draft model or None, max_cap) -> VerifyLoop`` for continuous batching (rows
            join as others finish, :meth:`~rayspec.spec_decode.loop.VerifyLoop.decode_stream`; the proposer has ``admit``).
        admission: ``(target, options, row keys, encoded batch) -> Admission``, how an encoded batch joins the
            stream (default: every row starts from the prompt).
        continuous: whether corpus runs (``rayspec transcribe``) batch continuously by default; Serve always does.
    """

    name: str
    decode: Callable[["WhisperASR", "DecodeOptions", "Encoded", Optional["ProposerFactory"]], list[Hypothesis]]
    stream: Callable[["WhisperASR", "DecodeOptions", Optional["WhisperASR"], int], VerifyLoop]
    needs_ctc: bool = False
    needs_draft: Callable[["DecodeOptions"], bool] = lambda options: False
    exact: Callable[["DecodeOptions"], bool] = lambda options: True
    admission: Callable[["WhisperASR", "DecodeOptions", list, "Encoded"], Admission] = (
        lambda target, options, ids, encoded: Admission(ids, encoded.target, encoded.caps, encoded.draft))
    continuous: bool = True

    @property
    def summary(self) -> str:
        """One sentence on the method for ``--help`` (:data:`~rayspec.decoding.options.METHOD_SUMMARIES`)."""
        return METHOD_SUMMARIES[self.name]


def _ar(target, options, encoded, proposers):
    return greedy_decode(target, encoded.target, encoded.caps)


def _draft(target, options, encoded, proposers):
    caps = encoded.caps
    loop = draft_loop(target, proposers(list(range(len(caps))), caps), options.speculation, options.speculate_max_rows)
    return loop.decode(encoded.target, caps)


def _draft_stream(target, options, draft, max_cap):
    return draft_loop(target, DraftProposer(draft, None, [max_cap], options.speculation), options.speculation,
                      options.speculate_max_rows)


def _ctc_proposer(target: WhisperASR, hypotheses) -> CTCProposer:
    return CTCProposer(hypotheses, target.eos_token_id, len(target.prompt_ids), CTC_MAX_DRAFT,
                       punctuation_tokens(target.tokenizer), continuation_tokens(target.tokenizer))


def _ctc_draft_loop(target, hypotheses, max_rows=None):
    return VerifyLoop(target, _ctc_proposer(target, hypotheses), max_nodes=CTC_MAX_DRAFT, route="ctc-draft",
                      max_rows=max_rows)


def _ctc_draft(target, options, encoded, proposers):
    return _ctc_draft_loop(target, encoded.ctc.tokens, options.speculate_max_rows).decode(encoded.target, encoded.caps)


def _medusa_loop(target, options, draft=None, max_cap=0):
    opt = options.medusa
    heads = load_heads(opt.heads or default_drafter(target.name, "medusa"), str(target.device), target.dtype)
    rule = (AcceptanceRule("typical", epsilon=opt.epsilon, delta=opt.delta) if opt.acceptance == "typical"
            else GREEDY)
    tree = opt.tree_for(target.device)
    return VerifyLoop(target, MedusaProposer(target, heads, tree), rule, max_nodes=len(tree), route="medusa",
                      max_rows=options.speculate_max_rows)


def _medusa(target, options, encoded, proposers):
    return _medusa_loop(target, options).decode(encoded.target, encoded.caps)


def _ssd(target, options, encoded, proposers):
    # Gate + verify the batch; the rejected rows continue in the verification pass's cache (SSDDecoder.decode).
    def proposer(parked):
        if options.ssd.fallback == "draft":
            return proposers([x.index for x in parked], [x.cap for x in parked])
        if options.ssd.fallback == "ctc":
            return _ctc_proposer(target, encoded.ctc.select([x.index for x in parked]))
        return None

    decoder = SSDDecoder(target, options.ssd, options.speculate_max_rows)
    return decoder.decode(encoded.target, encoded.caps, encoded.ctc, proposer)


def _ssd_stream(target, options, draft, max_cap):
    # One fallback stream for the corpus: each batch's parked rows fill the slots other rows free (SSD 3.2).
    ssd = options.ssd
    proposer = None
    if ssd.fallback == "draft":
        proposer = DraftProposer(draft, None, [max_cap], ssd.speculation)
    elif ssd.fallback == "ctc":
        proposer = _ctc_proposer(target, [])
    return SSDDecoder(target, ssd, options.speculate_max_rows).loop(proposer)


def _ssd_admission(target, options, ids, encoded):
    return SSDDecoder(target, options.ssd).admission(ids, encoded.target, encoded.caps, encoded.ctc, encoded.draft)


METHODS: dict[str, Method] = {m.name: m for m in (
    Method("ar", _ar,
           stream=lambda target, options, draft, max_cap: VerifyLoop(target)),
    Method("draft", _draft, needs_draft=lambda options: True, stream=_draft_stream),
    Method("ssd", _ssd, needs_ctc=True,
           needs_draft=lambda options: options.ssd.fallback == "draft",
           exact=lambda options: options.ssd.exact and options.ssd.tau_ctc <= 0, stream=_ssd_stream,
           admission=_ssd_admission),
    Method("ctc-draft", _ctc_draft, needs_ctc=True,
           stream=lambda target, options, draft, max_cap: _ctc_draft_loop(target, [], options.speculate_max_rows),
           admission=lambda target, options, ids, encoded: Admission(ids, encoded.target, encoded.caps,
                                                                      encoded.ctc.tokens),
           # Measured slower in a corpus stream (bench-ssd.md, AN4 test, batch 16: 0.92x vs 1.11x of AR); probably
           # (not profiled) because each newcomer's first round drafts its whole hypothesis and a round is as wide
           # as its widest row. That was speculating at every batch size; at the default row cap static and
           # continuous measured the same (bench/ssd-rowcap, LJSpeech, batch 16: 1.06x of AR each).
           continuous=False),
    Method("medusa", _medusa,
           exact=lambda options: options.medusa.acceptance == "greedy", stream=_medusa_loop),
)}
assert set(METHODS) == set(METHOD_SUMMARIES), "every method needs a summary and an implementation"
