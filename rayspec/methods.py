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
from .decoding.common import DEFAULT_MAX_TOKENS_PER_SECOND, Hypothesis
from .decoding.beam import BeamOptions
from .decoding.fallback import FallbackOptions
from .decoding.ctc_proposer import CTC_MAX_DRAFT, CTCProposer, continuation_tokens, punctuation_tokens
from .decoding.medusa_proposer import MedusaOptions, MedusaProposer, load_heads
from .decoding.proposer import DraftProposer, SpeculationOptions
from .decoding.speculative import draft_loop
from .decoding.ssd import CTCDrafts, SSDDecoder, SSDOptions
from .models.registry import default_drafter
from .models.encoded import EncoderOutput
from .models.whisper import WhisperASR
from .runner.static_step import DEFAULT_MAX_BATCH, STATIC_STEP_MODES
from .spec_decode.acceptance import GREEDY, AcceptanceRule
from .spec_decode.loop import Admission, Proposer, VerifyLoop

TIMESTAMPS = ("none", "segment", "word")
ProposerFactory = Callable[[list[int], list[int]], Proposer]
"""``(rows, caps) -> proposer`` over those rows (indices into the batch, in that order) with those token caps."""

@dataclass
class DecodeOptions:
    """What decoder to run and how (see ``rayspec transcribe --help``).

    Attributes:
        method: a :data:`~rayspec.methods.METHODS` name: "ar" (target greedy), "draft" (draft-model speculative
            decoding, exact) or "ssd" (CTC gating, verification and fallback; exact only with ``ssd.exact`` and the
            gate off).
        max_tokens_per_second: cap on generated tokens per second of audio (against runaway repetition).
        speculation: options of the draft method (:class:`~rayspec.decoding.speculative.SpeculationOptions`).
        ssd: options of the ssd method (:class:`~rayspec.decoding.ssd.SSDOptions`).
        medusa: options of the medusa method (:class:`~rayspec.decoding.medusa_proposer.MedusaOptions`).
        vad: skip recordings without speech (empty text, route "no_speech"); long recordings are cut in pauses
            either way.
        segments: fill each row's ``segments`` column (start, end, text of every decoded segment).
        timestamps: "none", "segment" (decode with Whisper's timestamp tokens, every method under its timestamp
            rules, :mod:`rayspec.spec_decode.timestamps`; ``segments`` then holds the timed segments) or "word" (also
            ``words``: openai/whisper's word timing from the alignment heads, :func:`rayspec.timing.word_timestamps`,
            one extra target pass per batch).
        refine_words: with ``timestamps="word"``, a word start that falls in non-speech (frame energy over 15 dB below
            the row's loudest frame) moves forward to the word's first speech frame (:mod:`rayspec.activity`; never past
            the word itself); False keeps openai/whisper's recipe alone.
        long_form: how a recording longer than the model's window is decoded: "vad" (cut in pauses, the windows
            decoded independently) or "sequential" (Whisper's own algorithm, :mod:`rayspec.longform`: each window
            starts where the previous one's last complete segment ended; timed segments).
        condition_on_previous_text: with ``long_form="sequential"``, each window's prompt carries the text decoded
            before it (``<|startofprev|>``), as Whisper's ``condition_on_previous_text``.
        language: the decoder prompt's language code for multilingual models ("en"), or "auto": detected per
            segment from one decoder pass over ``<|startoftranscript|>`` (openai/whisper's ``detect_language``).
        task: "transcribe" or "translate" (into English; multilingual models).
        no_speech_threshold: a segment whose ``<|nospeech|>`` probability in the target's first pass exceeds this
            is dropped (route "no_speech"; openai/whisper's ``no_speech_threshold``, applied without its log-prob
            condition); None keeps every segment.
        compression_ratio_threshold: rows whose text's zlib compression ratio exceeds this are flagged
            ``repetitive`` (openai/whisper's hallucination statistic; the text is kept).
        speculate_max_rows: speculative methods verify drafts only in rounds with at most this many live rows; in
            larger rounds they take plain target steps (vLLM's ``disable_by_batch_size``; the tokens are the same
            either way). 0: no limit; None: the device's default (:func:`~rayspec.spec_decode.loop.speculate_max_rows`:
            2 on a CPU, where a wide verification pass over many rows costs more than the steps it saves).
        short_window_s: 0 (the default) runs a stock Whisper's encoder over its whole 30 s window, the exact
            reference; ``S > 0`` cuts each batch's window to its longest row + 2 s, at least ``S`` seconds
            (:meth:`~rayspec.models.whisper.WhisperASR.short_window`): lossy (``mode`` "lossy"), and the
            no-speech gate is off (``<|nospeech|>``'s probability rises in a short window: four AN4 clips of
            spelled words, 2.8-5 s, were dropped at 0.65-0.73; VAD still drops recordings without speech). Every
            method stays exact against ``ar`` at the same setting.
        static_steps: "auto" (static-shape decoder steps on a CUDA device with ``cuda_graphs``, none on a CPU),
            "on" (on any device; graphs only on CUDA) or "off" (:mod:`rayspec.runner.static_step`). The tokens are
            the same either way.
        cuda_graphs: capture each (batch bucket, query bucket) step as a CUDA graph when the model loads.
        max_graph_batch: the largest batch bucket with static steps and graphs; larger batches run dynamically.
        temperatures: the temperatures tried in order (openai/whisper's temperature fallback,
            :mod:`rayspec.decoding.fallback`); ``(0.0,)``: greedy only. Above 0 a row samples with the seeded
            Gumbel-max trick (:mod:`rayspec.spec_decode.gumbel`): for one ``seed`` every exact method samples the same
            tokens at any batch size.
        best_of: samples per row at a fallback temperature above 0 (the likeliest is kept).
        log_prob_threshold: fallback when a row's average log-probability is below this (None: never).
        seed: the seed of every sampled row (mixed with the utterance id, segment and attempt).
        initial_prompt: text the decoder reads before each segment (``<|startofprev|>`` + its tokens, openai/whisper's
            ``prompt`` / faster-whisper's ``initial_prompt``: vocabulary, spelling, style); None: none.
        hotwords: faster-whisper's ``hotwords``: words put in the same place, to make them likelier.
        beam_size: above 1, rows at temperature 0 decode with beam search (:mod:`rayspec.decoding.beam`,
            openai/whisper's ``BeamSearchDecoder``) instead of greedily; every method then returns the beam search's
            hypotheses: ``ctc-draft`` speculates under it exactly (each beam drafts from the CTC hypothesis,
            :mod:`rayspec.decoding.beam_speculative`) where ``speculate_max_rows`` allows all the beams (on a CPU
            it does not: measured slower), the others decode plain beam search.
        patience, length_penalty: beam search's (openai/whisper's ``patience`` and ``length_penalty``; the length
            penalty also ranks fallback samples).
        prefix: text each file's transcript starts with (faster-whisper's ``prefix``: its first segment's tokens
            are decided, the decoder goes on after them, and the text includes them); None: none.
    """

    method: str = "ar"
    max_tokens_per_second: float = DEFAULT_MAX_TOKENS_PER_SECOND
    speculation: Optional[SpeculationOptions] = None
    ssd: Optional[SSDOptions] = None
    medusa: Optional[MedusaOptions] = None
    vad: bool = True
    segments: bool = False
    timestamps: str = "none"
    refine_words: bool = True
    long_form: str = "vad"
    condition_on_previous_text: bool = True
    language: str = "en"
    task: str = "transcribe"
    no_speech_threshold: Optional[float] = 0.6
    compression_ratio_threshold: float = 2.4
    short_window_s: float = 0.0
    speculate_max_rows: Optional[int] = None
    static_steps: str = "auto"
    cuda_graphs: bool = True
    max_graph_batch: int = DEFAULT_MAX_BATCH
    temperatures: tuple[float, ...] = (0.0,)
    best_of: int = 5
    log_prob_threshold: Optional[float] = -1.0
    seed: int = 0
    initial_prompt: Optional[str] = None
    hotwords: Optional[str] = None
    beam_size: int = 1
    patience: float = 1.0
    length_penalty: Optional[float] = None
    prefix: Optional[str] = None

    def __post_init__(self):
        if self.prefix and self.method == "ssd":
            raise ValueError("--prefix works with ar, draft, ctc-draft and medusa, not ssd (its gate decides whole "
                             "transcripts)")
        if self.prefix and self.timestamps != "none":
            raise ValueError("--prefix needs --timestamps none")
        self.temperatures = self.fallback.temperatures  # validated (FallbackOptions)
        self.beam  # validated (BeamOptions)
        if self.method == "ssd" and self.temperatures[0] > 0:
            raise ValueError("method ssd decodes at temperature 0 first (its gate and verification are greedy); "
                             "start --temperature at 0")
        if self.method == "medusa" and self.medusa is not None and self.medusa.acceptance != "greedy" \
                and max(self.temperatures) > 0:
            raise ValueError("sampling (temperature > 0) needs --acceptance greedy")
        if self.speculate_max_rows is not None and self.speculate_max_rows < 0:
            raise ValueError(f"speculate_max_rows must be >= 0 (0: no limit), got {self.speculate_max_rows}")
        if self.static_steps not in STATIC_STEP_MODES:
            raise ValueError(f"static_steps must be one of {', '.join(STATIC_STEP_MODES)}, got {self.static_steps!r}")
        if self.max_graph_batch < 1:
            raise ValueError(f"max_graph_batch must be >= 1, got {self.max_graph_batch}")
        if self.short_window_s < 0:
            raise ValueError(f"short_window_s must be >= 0 (0: the full window), got {self.short_window_s}")
        if self.method not in METHODS:
            raise ValueError(f"unknown method {self.method!r}; choose from {', '.join(sorted(METHODS))}")
        if self.timestamps not in TIMESTAMPS:
            raise ValueError(f"unknown timestamps {self.timestamps!r}: {', '.join(TIMESTAMPS)}")
        if self.long_form not in ("vad", "sequential"):
            raise ValueError(f"unknown long_form {self.long_form!r}: vad or sequential")
        if self.long_form == "sequential" and self.timestamps == "word":
            raise ValueError("long_form='sequential' gives segment timestamps; word timestamps need long_form='vad'")
        if self.long_form == "sequential" and self.method == "ssd":
            raise ValueError("long_form='sequential' supports ar, draft, medusa and ctc-draft, not ssd")
        if self.task not in ("transcribe", "translate"):
            raise ValueError(f"unknown task {self.task!r}: transcribe or translate")
        if self.method == "ssd" and self.ssd is None:
            self.ssd = SSDOptions()
        if self.method == "draft" and self.speculation is None:
            self.speculation = SpeculationOptions()
        if self.method == "medusa" and self.medusa is None:
            self.medusa = MedusaOptions()

    @property
    def fallback(self) -> FallbackOptions:
        """The temperature-fallback options (:class:`~rayspec.decoding.fallback.FallbackOptions`)."""
        return FallbackOptions(tuple(self.temperatures), self.best_of, self.compression_ratio_threshold,
                               self.log_prob_threshold, self.no_speech_threshold, self.length_penalty, self.seed)

    @property
    def beam(self) -> BeamOptions:
        """The beam-search options (:class:`~rayspec.decoding.beam.BeamOptions`)."""
        return BeamOptions(self.beam_size, self.patience, self.length_penalty)

    @property
    def mode(self) -> str:
        """"exact" when the output is provably the target's greedy output, else "lossy"."""
        return "exact" if METHODS[self.method].exact(self) and not self.short_window_s else "lossy"


@dataclass
class Encoded:
    """What the drafting side computes for a batch of ``B`` waveforms, and the target side decodes from.

    Attributes:
        target: the target's encoder output (``states`` ``[B, S, D]`` in the model dtype, ``lengths`` int64 ``[B]``).
        caps: ``B`` caps on generated tokens (from the audio durations).
        ctc: the CTC drafts (method "ssd"), else None.
        draft: the encoder output the draft model reads (method "draft", or "ssd" with the draft fallback): its own,
            or ``target`` itself for a decoder-only draft; else None.
    """

    target: EncoderOutput
    caps: list[int]
    ctc: Optional[CTCDrafts] = None
    draft: Optional[EncoderOutput] = None
    keys: Optional[list[str]] = None

    def to(self, device, dtype: Optional[torch.dtype] = None) -> "Encoded":
        """The same batch with its tensors on ``device`` (CPU before crossing Ray's object store) and the target's
        encoder states cast to ``dtype`` if given."""
        target = self.target.to(device, dtype)
        draft = target if self.draft is self.target else self.draft.to(device) if self.draft else None
        return Encoded(target, self.caps, self.ctc, draft, self.keys)

    def select(self, rows: list[int]) -> "Encoded":
        """The rows ``rows`` (indices; repeats allowed) of this batch."""
        def pick(enc: Optional[EncoderOutput]) -> Optional[EncoderOutput]:
            return None if enc is None else enc.select(torch.tensor(rows, device=enc.states.device))
        target = pick(self.target)
        draft = target if self.draft is self.target else pick(self.draft)
        ctc = None if self.ctc is None else CTCDrafts([self.ctc.tokens[i] for i in rows],
                                                       [self.ctc.entropy[i] for i in rows])
        return Encoded(target, [self.caps[i] for i in rows], ctc, draft,
                       None if self.keys is None else [self.keys[i] for i in rows])

    def key(self, row: int) -> str:
        """The stable key of row ``row`` (seeds its sampling): its utterance id and segment, else its index."""
        return self.keys[row] if self.keys is not None else str(row)


@dataclass(frozen=True)
class Method:
    """One decoding method.

    Attributes:
        name: the ``--method`` value.
        summary: one sentence for ``--help``.
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
    summary: str
    decode: Callable[["WhisperASR", "DecodeOptions", "Encoded", Optional["ProposerFactory"]], list[Hypothesis]]
    stream: Callable[["WhisperASR", "DecodeOptions", Optional["WhisperASR"], int], VerifyLoop]
    needs_ctc: bool = False
    needs_draft: Callable[["DecodeOptions"], bool] = lambda options: False
    exact: Callable[["DecodeOptions"], bool] = lambda options: True
    admission: Callable[["WhisperASR", "DecodeOptions", list, "Encoded"], Admission] = (
        lambda target, options, ids, encoded: Admission(ids, encoded.target, encoded.caps, encoded.draft))
    continuous: bool = True


def _ar(target, options, encoded, proposers):
    return greedy_decode(target, encoded.target, encoded.caps)


def _draft(target, options, encoded, proposers):
    caps = encoded.caps
    loop = draft_loop(target, proposers(list(range(len(caps))), caps), options.speculation, options.speculate_max_rows)
    return loop.decode(encoded.target, caps)


def _draft_stream(target, options, draft, max_cap):
    return draft_loop(target, DraftProposer(draft, None, [max_cap], options.speculation), options.speculation,
                      options.speculate_max_rows)


def _ctc_proposer(target: WhisperASR, hypotheses: list[list[int]]) -> CTCProposer:
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
            return _ctc_proposer(target, [encoded.ctc.tokens[x.index] for x in parked])
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
    Method("ar", "target greedy, one target pass per token", _ar,
           stream=lambda target, options, draft, max_cap: VerifyLoop(target)),
    Method("draft", "a draft model proposes tokens (SpecASR; token trees with --tree), the target verifies them in "
                    "one pass; output identical to ar", _draft, needs_draft=lambda options: True, stream=_draft_stream),
    Method("ssd", "the CTC head's hypothesis is gated by entropy, verified by the target in one pass, and decoding "
                  "falls back from the verified prefix (lossy unless --exact and --tau-ctc 0)", _ssd, needs_ctc=True,
           needs_draft=lambda options: options.ssd.fallback == "draft",
           exact=lambda options: options.ssd.exact and options.ssd.tau_ctc <= 0, stream=_ssd_stream,
           admission=_ssd_admission),
    Method("ctc-draft", "the CTC head's hypothesis is the draft of every round, re-aligned after each correction "
                        "of the target; output identical to ar, no draft model", _ctc_draft, needs_ctc=True,
           stream=lambda target, options, draft, max_cap: _ctc_draft_loop(target, [], options.speculate_max_rows),
           admission=lambda target, options, ids, encoded: Admission(ids, encoded.target, encoded.caps,
                                                                      encoded.ctc.tokens),
           # Measured slower in a corpus stream (bench-ssd.md, AN4 test, batch 16: 0.92x vs 1.11x of AR); probably
           # (not profiled) because each newcomer's first round drafts its whole hypothesis and a round is as wide
           # as its widest row. That was speculating at every batch size; at the default row cap static and
           # continuous measured the same (bench/ssd-rowcap, LJSpeech, batch 16: 1.06x of AR each).
           continuous=False),
    Method("medusa", "Medusa heads on the target's own hidden state propose a sparse token tree, verified in one "
                     "pass; greedy acceptance is identical to ar, --acceptance typical is lossy", _medusa,
           exact=lambda options: options.medusa.acceptance == "greedy", stream=_medusa_loop),
)}
