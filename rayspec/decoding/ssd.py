"""Self-speculative decoding with a CTC drafter: CTC gating -> one-pass verification -> fallback from the verified
prefix (Saon et al. 2026, arXiv:2603.11243, section 2, eq. 2-7; batching as section 3.2).

Per utterance:

1. Gate (eq. 2-3): the greedy CTC hypothesis over the target's own encoder states is final, with no target decoder
   pass, if every frame's CTC entropy is below ``tau_ctc`` (route "ctc").
2. Verify (eq. 4-5): the hypothesis, re-tokenized with the target's tokenizer and followed by EOS, is scored in ONE
   teacher-forced target pass (logits only at the hypothesis positions). It is accepted if every token's probability
   exceeds ``tau_slm`` (route "verified"); with ``exact`` if every token is the target's argmax. Verifying the
   closing EOS too (beyond the paper) rejects hypotheses the target would continue.
3. Fallback (eq. 6-7): from the longest verified prefix, the target's own next token is already known from the
   verification logits; decoding continues from there, reusing the verification pass's KV cache for the prefix
   (route "fallback"), with greedy AR (the paper's fallback), draft-model speculation, or (beyond the paper; the
   default) the rest of the CTC hypothesis re-aligned after the target's token and verified under the same rule
   each round (:class:`~rayspec.decoding.ctc_proposer.CTCProposer`: what ``ctc-draft`` does, there with greedy
   acceptance).

A batch decoded on its own (:meth:`SSDDecoder.decode`, what ``rayspec transcribe`` runs per batch) continues in the
verification pass's own cache: nothing is copied and the cross-attention keys/values are computed once, as for AR.
Otherwise phase 1 (gate + verify) and phase 2 (fallback) are batched separately (section 3.2): utterances that fail
verification park their prefix keys/values in CPU memory and continue in a fallback batch of their own
(:meth:`SSDDecoder.fallback`), or, with continuous batching, join one fallback stream pooled across the corpus
(:meth:`SSDDecoder.admission`): a batch's parked rows fill the slots other batches' rows free, so the fallback runs
in full batches however few rows of each batch fail. A batch of more rows than the row cap allows
(:func:`~rayspec.spec_decode.loop.speculate_max_rows`: 2 on a CPU) skips the verification pass, which scores every
row's whole hypothesis and there costs more than the passes it saves; its rows start the fallback from the prompt,
and in exact mode with the gate off the CTC head runs only for the rows that speculate (:meth:`CTCDrafts.deferred`).

With ``exact=True`` and ``tau_ctc=0`` (gate off) the output equals the target's greedy output for any ``tau_slm``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import numpy as np

import torch

from ..models.ctc import CTCHead
from ..models.encoded import EncoderOutput
from ..models.whisper import WhisperASR
from ..spec_decode.acceptance import accept_tree, score_tree
from ..spec_decode.loop import Admission, Proposer, VerifyLoop, speculate_max_rows
from ..spec_decode.timestamps import EXTRA_NODES, apply_rules, rule_bounds
from ..spec_decode.tree import DraftTree, TokenTrees
from .common import Hypothesis
from .ctc_proposer import CTC_MAX_DRAFT
from .options import SSDOptions
from .speculative import draft_loop


def retokenize(ctc_ids: list[int], ctc: CTCHead, target: WhisperASR) -> list[int]:
    """CTC hypothesis (token ids of the CTC head's vocabulary) -> text -> the target tokenizer's ids."""
    text = target.tokenizer.decode(ctc_ids, skip_special_tokens=True)
    return target.tokenizer(text, add_special_tokens=False).input_ids if text else []


@dataclass
class CTCDrafts:
    """The CTC drafter's output for a batch of ``B`` rows (SSD eq. 1-3).

    A deferred batch (:meth:`deferred`) runs the CTC head only for the rows whose hypotheses are asked for
    (:meth:`hypotheses`), in one pass per call: exact SSD above the row cap reads a row's hypothesis only when the
    fallback speculates for it (:func:`defers_drafts`), and at batch 16 most rows never do. Pickling (crossing
    Ray's object store to a target actor, which has no CTC head) drafts the rows still missing first.

    Attributes:
        tokens: per row, the greedy CTC hypothesis re-tokenized with the target's tokenizer (token ids); None for a
            row of a deferred batch not drafted yet.
        entropy: per row, the largest frame entropy of the CTC posteriors (nats; the gate's statistic); None where
            not computed (a deferred batch's rows: its gate is off).
        source: a deferred batch's ``rows -> hypotheses`` (the head over those rows), None once every row is drafted
            up front.
    """

    tokens: list[Optional[list[int]]]
    entropy: list[Optional[float]]
    source: Optional[Callable[[list[int]], list[list[int]]]] = field(default=None, repr=False, compare=False)

    @classmethod
    def deferred(cls, ctc: CTCHead, target: WhisperASR, enc: EncoderOutput) -> "CTCDrafts":
        """A batch whose rows are drafted when :meth:`hypotheses` asks for them (no entropies)."""

        @torch.inference_mode()
        def source(rows: list[int]) -> list[list[int]]:
            at = torch.tensor(rows, device=enc.states.device)
            hyps, _ = ctc.draft(enc.states.index_select(0, at), enc.lengths.index_select(0, at.to(enc.lengths.device)),
                                entropy=False)
            return [retokenize(ids, ctc, target) for ids in hyps]

        n = len(enc.lengths)
        return cls([None] * n, [None] * n, source)

    def hypotheses(self, rows: Sequence[int]) -> list[list[int]]:
        """The hypotheses of ``rows`` (indices), drafting those not drafted yet in one head pass."""
        missing = sorted({i for i in rows if self.tokens[i] is None})
        if missing:
            for i, h in zip(missing, self.source(missing)):
                self.tokens[i] = h
        return [self.tokens[i] for i in rows]

    def __len__(self) -> int:
        return len(self.tokens)

    def select(self, rows: Sequence[int]) -> "CTCDrafts":
        """The rows ``rows`` (indices, repeats allowed); a deferred batch's selection drafts through this one."""
        rows = list(rows)
        source = None if self.source is None else (lambda rs: self.hypotheses([rows[r] for r in rs]))
        return CTCDrafts([self.tokens[i] for i in rows], [self.entropy[i] for i in rows], source)

    def __getstate__(self) -> dict:
        if self.source is not None:
            self.hypotheses(range(len(self.tokens)))
        return {**self.__dict__, "source": None}


def defers_drafts(options: SSDOptions, rows: int, max_rows: int) -> bool:
    """Whether a batch of ``rows`` rows needs its CTC hypotheses only where the fallback speculates
    (:meth:`CTCDrafts.deferred`): exact mode with the gate off (no entropy is read) and no verification pass (off,
    or a batch above the row cap ``max_rows``, :func:`~rayspec.spec_decode.loop.speculate_max_rows`; 0: no cap).
    A lossy CTC fallback's tokens depend on where its proposer re-aligns each row's hypothesis, which starts with
    the row's first draft, so there every row is drafted up front."""
    skips = not options.verify or (rows > 1 and 0 < max_rows < rows)
    return options.tau_ctc <= 0 and skips and (options.exact or options.fallback != "ctc")


@torch.inference_mode()
def ctc_drafts(ctc: CTCHead, target: WhisperASR, enc: EncoderOutput, deferred: bool = False) -> CTCDrafts:
    """Run the CTC head over the target's encoder states (``[B, S, D]``): greedy hypotheses and gate entropies;
    ``deferred``: only later, for the rows asked for (:meth:`CTCDrafts.deferred`)."""
    if deferred:
        return CTCDrafts.deferred(ctc, target, enc)
    hyps, entropy = ctc.draft(enc.states, enc.lengths)
    return CTCDrafts([retokenize(ids, ctc, target) for ids in hyps], entropy)


@dataclass
class _Parked:
    """A gate- and verification-rejected utterance waiting for the fallback phase."""

    index: int  # row in the batch
    length: int  # real encoder positions
    start: Hypothesis  # verified prefix + the target's next token (route "fallback", the pass counted), or empty
    kv: Optional[list]  # target keys/values of prompt + prefix minus its last token (per layer (k, v) [H, n, Dh]), CPU
    cap: int


class SSDDecoder:
    """CTC-gated self-speculative decoding of utterances (see the module docstring).

    The CTC drafts come from :func:`ctc_drafts` (run where the encoder runs: in process, or on the drafting actor).

    Args:
        target: the target model; options: :class:`SSDOptions`.
        max_rows: the draft fallback speculates only in rounds with at most this many rows
            (:class:`~rayspec.spec_decode.loop.VerifyLoop`; None: the device's default).
    """

    def __init__(self, target: WhisperASR, options: SSDOptions, max_rows: Optional[int] = None):
        self.target, self.opt, self.max_rows = target, options, max_rows

    @torch.inference_mode()
    def first_pass(self, enc: EncoderOutput, caps: Sequence[int], drafts: CTCDrafts):
        """Phase 1 for one batch: gate and verify; the parked rows' prefix keys/values are copied to CPU memory
        (``_Parked.kv``) for a fallback batch of their own or the corpus-wide stream.

        Args:
            enc: the target's encoder output (``B`` rows); caps: ``B`` token caps; drafts: the batch's CTC drafts.

        Returns:
            ``(hypotheses, parked)``: a hypothesis or None per row, and the rows left for :meth:`fallback`.
        """
        out, parked, cache, prefix = self._verify(enc, caps, drafts)
        if parked and cache is not None:
            kvs = cache.export_rows([k for k, _ in prefix], [n for _, n in prefix])
            for park, kv in zip(parked, kvs):
                park.kv = kv
        return out, parked

    @torch.inference_mode()
    def decode(self, enc: EncoderOutput, caps: Sequence[int], drafts: CTCDrafts,
               proposers: Optional[Callable[[list[_Parked]], Optional[Proposer]]] = None) -> list[Hypothesis]:
        """Both phases for one batch, the fallback continuing in the verification pass's own KV cache: a parked
        row's prefix keys/values stay where the verification wrote them and the cross-attention keys/values are not
        computed again (:meth:`first_pass` + :meth:`fallback` copy the one out and recompute the other: what a
        fallback batch of rows from other batches needs, not a batch decoded on its own).

        Args:
            enc, caps, drafts: as :meth:`first_pass`.
            proposers: for ``fallback="draft"`` or ``"ctc"``, the proposer over the parked rows given, in that order
                (see :meth:`fallback`).

        Returns:
            ``B`` hypotheses (routes "ctc", "verified", "fallback", or "ar" without verification).

        Raises:
            ValueError: ``fallback="draft"`` or ``"ctc"`` without ``proposers``.
        """
        if self.opt.fallback != "ar" and proposers is None:
            raise ValueError(f"fallback={self.opt.fallback!r} needs a proposer")
        out, parked, cache, prefix = self._verify(enc, caps, drafts, self._room())
        if not parked:
            return out
        if cache is None:  # no verification pass (the gate + AR ablation, or a batch above the row cap)
            hyps = self.fallback(enc, parked, proposers(parked) if proposers else None)
        else:
            # the cache keeps each parked row's prompt + prefix (minus the target's token after it): the rest of
            # the verification pass's positions and the decided rows go
            counts = np.zeros(cache.batch_size, dtype=np.int64)
            counts[[k for k, _ in prefix]] = [n for _, n in prefix]
            cache.commit(np.broadcast_to(np.arange(int(counts.max())), (len(counts), int(counts.max()))), counts)
            by_row = dict(zip((k for k, _ in prefix), parked))
            order = cache.drop([k for k in range(cache.batch_size) if k not in by_row])
            parked = [by_row[k] for k in order]
            proposer = proposers(parked) if proposers else None
            sub = enc.select(torch.tensor([x.index for x in parked], device=enc.states.device))
            hyps = self.loop(proposer).decode(sub, [x.cap for x in parked], [x.start for x in parked], cache=cache)
        for x, h in zip(parked, hyps):
            out[x.index] = h
        return out

    def _verify(self, enc: EncoderOutput, caps: Sequence[int], drafts: CTCDrafts, room: Optional[int] = None):
        """Gate and verify one batch (eq. 2-7). ``room``: draft positions the cache must also hold for a fallback
        that continues in it (None: room for the verification pass only).

        Returns:
            ``(hypotheses, parked, cache, prefix)``: as :meth:`first_pass` (``kv`` None), the verification pass's
            cache (rows: the verified rows, in batch order; pending positions uncommitted), or None where nothing
            was verified, and per parked row ``(cache row, positions of prompt + prefix to keep)``.
        """
        t, eos = self.target, self.target.eos_token_id
        entropy, hyps_ctc = drafts.entropy, drafts.tokens
        out: list[Optional[Hypothesis]] = [None] * len(caps)
        parked: list[_Parked] = []
        todo = []
        for i, e in enumerate(entropy):
            if e is not None and e < self.opt.tau_ctc:
                h = hyps_ctc[i]
                out[i] = Hypothesis(h[: caps[i]], len(h) <= caps[i], "ctc")
            elif not self.opt.verify:
                start = Hypothesis([], False, "ar")
                start.stats.ctc_entropy = e
                parked.append(_Parked(i, int(enc.lengths[i]), start, None, caps[i]))
            else:
                todo.append(i)
        for i, h in enumerate(out):
            if h is not None:
                h.stats.ctc_entropy = entropy[i]
                h.stats.sum_logprob = None  # decided without a target pass
        if len(todo) > 1 and 0 < speculate_max_rows(t.device, self.max_rows) < len(todo):
            # a batch too large for a verification pass to pay (scoring every row's whole hypothesis costs what
            # several one-token steps of the batch do): the rows start the fallback from the prompt, which
            # speculates (fallback="ctc" or "draft") in its rounds of few rows, as the row cap says
            for i in todo:
                start = Hypothesis([], False, "fallback")
                start.stats.ctc_entropy, start.stats.accepted_prefix = entropy[i], 0
                parked.append(_Parked(i, int(enc.lengths[i]), start, None, caps[i]))
            todo = []
        if not todo:
            return out, parked, None, []
        drafts.hypotheses(todo)  # (a deferred batch: drafted now)
        sub = enc.select(torch.tensor(todo, device=enc.states.device))
        prompts = sub.row_prompts(t.prompt_ids)
        p = len(prompts[0])
        tt = t.timestamp_tokens
        stamped = [tt is not None and tt.in_timestamp_mode(q) for q in prompts]
        # In timestamp mode the hypothesis gets the usual first timestamp, <|0.00|>, before it
        seqs = [(([tt.begin] if on else []) + hyps_ctc[i])[: caps[i]] for i, on in zip(todo, stamped)]
        # One target pass scores each hypothesis + EOS as a chain after the prompt (eq. 4); eq. 5-6 pick the
        # verified prefix, and the target's argmax after it is known from the same pass (eq. 7).
        trees = TokenTrees.build(prompts, [DraftTree.chain(s + [eos]) for s in seqs])
        capacity = int(trees.sizes.max()) + 1
        if room is not None:  # the fallback's: prompt + cap + its draft nodes (VerifyLoop.decode)
            capacity = max(capacity, max(map(len, prompts)) + max(caps[i] for i in todo) + room + 2)
        cache = t.new_cache(sub, capacity)
        dev = trees.to_device(eos, np.full(len(todo), p - 1), cache.device)
        raw = t.decode(cache, dev.tokens, dev.ancestors, dev.depths)
        no_speech = t.no_speech_probability(raw[:, 0])  # node 0 is <|startoftranscript|>
        no_speech = [None] * len(todo) if no_speech is None else no_speech.tolist()
        logits = t.suppress(raw, first=dev.host["first"])
        if any(stamped):  # the timestamp rules at every node (rayspec.spec_decode.timestamps)
            bounds = rule_bounds(dev.host, [[]] * len(todo), stamped, tt)
            logits = apply_rules(logits, bounds, tt)  # in place: raw is not read after this
        result = accept_tree(dev.host, score_tree(logits, dev, self.opt.rule))
        keep_len = []
        for k, (i, s) in enumerate(zip(todo, seqs)):
            n, j = len(s) + 1, len(result.paths[k])
            if j == n:
                h = Hypothesis(list(s), True, "verified")
                h.stats.target_forward_passes = 1
                h.stats.accepted_prefix = len(s)
                h.stats.no_speech_prob = no_speech[k]
                out[i] = h
                keep_len.append(None)
                continue
            nxt = int(result.next_tokens[k])  # the target's own token after the verified prefix
            prefix = s[:j] + ([] if nxt == eos else [nxt])
            if nxt == eos or len(prefix) >= caps[i]:
                h = Hypothesis(prefix[: caps[i]], nxt == eos, "fallback")
                h.stats.target_forward_passes = 1
                h.stats.accepted_prefix = j
                h.stats.no_speech_prob = no_speech[k]
                out[i] = h
                keep_len.append(None)
                continue
            keep_len.append(p + j)
            start = Hypothesis(prefix, False, "fallback")
            start.stats.target_forward_passes = 1  # the verification pass
            start.stats.accepted_prefix = j
            start.stats.ctc_entropy = entropy[i]
            start.stats.no_speech_prob = no_speech[k]
            parked.append(_Parked(i, int(enc.lengths[i]), start, None, caps[i]))
        for i in todo:
            if out[i] is not None:
                out[i].stats.ctc_entropy = entropy[i]
        for h in [out[i] for i in todo if out[i] is not None] + [x.start for x in parked if x.start.tokens]:
            h.stats.sum_logprob = None  # verified under the threshold rule: log-probabilities not kept
        return out, parked, cache, [(k, n) for k, n in enumerate(keep_len) if n is not None]

    @torch.inference_mode()
    def fallback(self, enc: EncoderOutput, parked: list[_Parked], proposer: Optional[Proposer] = None
                 ) -> list[Hypothesis]:
        """Phase 2 for one batch of parked rows: continue after each prefix (AR or draft speculation).

        Args:
            enc: the encoder output :meth:`first_pass` got (the parked rows' states are read from it).
            parked: rows from :meth:`first_pass`, in the order to decode them (e.g. sorted by length).
            proposer: for ``fallback="draft"`` a draft proposer, for ``"ctc"`` a
                :class:`~rayspec.decoding.ctc_proposer.CTCProposer` of the rows' CTC hypotheses, over exactly these
                rows, in this order.

        Raises:
            ValueError: ``fallback="draft"`` or ``"ctc"`` without a proposer.
        """
        if self.opt.fallback != "ar" and proposer is None:
            raise ValueError(f"fallback={self.opt.fallback!r} needs a proposer")
        rows = [x.index for x in parked]
        # every row in batch order (a batch above the row cap): the encoder output as it is, not a copy of it
        sub = enc if rows == list(range(len(enc.lengths))) else enc.select(torch.tensor(rows, device=enc.states.device))
        return self.loop(proposer).decode(sub, [x.cap for x in parked], [x.start for x in parked],
                                          [x.kv for x in parked])

    def _room(self) -> int:
        """The most draft nodes a fallback round verifies (timestamp nodes included): cache room past the cap."""
        if self.opt.fallback == "ar":
            return 0
        nodes = CTC_MAX_DRAFT if self.opt.fallback == "ctc" else self.opt.speculation.nodes_per_round
        return nodes + EXTRA_NODES

    def loop(self, proposer: Optional[Proposer] = None) -> VerifyLoop:
        """The fallback's verify loop: greedy AR, draft-model speculation over ``proposer``, or the CTC proposer
        ``proposer`` verified with the options' rule."""
        if self.opt.fallback == "draft":
            return draft_loop(self.target, proposer, self.opt.speculation, self.max_rows)
        if self.opt.fallback == "ctc":
            return VerifyLoop(self.target, proposer, self.opt.rule, max_nodes=CTC_MAX_DRAFT, route="fallback",
                              max_rows=self.max_rows)
        return VerifyLoop(self.target)

    @torch.inference_mode()
    def admission(self, ids: list, enc: EncoderOutput, caps: Sequence[int], drafts: CTCDrafts,
                  draft_enc: Optional[EncoderOutput] = None) -> Admission:
        """One batch for the corpus-wide fallback stream (:meth:`~rayspec.spec_decode.loop.VerifyLoop.decode_stream` of
        :meth:`loop`): gate + verify it now (:meth:`first_pass`); the rows decided there come back finished at
        once, the parked rows continue from their verified prefixes (keys/values imported, not recomputed).

        Args:
            ids: ``B`` row keys; enc, caps, drafts: as :meth:`first_pass`; draft_enc: the draft model's encoder
                output for the batch (``fallback="draft"``; with ``"ctc"`` the proposer gets the CTC hypotheses).
        """
        hyps, parked = self.first_pass(enc, caps, drafts)
        start: list[Optional[Hypothesis]] = list(hyps)
        kv: list = [None] * len(caps)
        for x in parked:
            start[x.index], kv[x.index] = x.start, x.kv
        extra = drafts if self.opt.fallback == "ctc" else draft_enc
        return Admission(list(ids), enc, list(caps), extra, start, kv)
