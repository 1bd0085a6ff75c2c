"""Ray-free corpus transcription: audio -> batches -> drafting side -> target side -> result rows.

Each batch goes through two sides that only exchange plain data:

- :class:`Drafter` (the drafting side): loads audio, computes features, runs the target's encoder and the drafter
  (the CTC head for "ssd", the draft model's encoder for "draft" unless the draft is decoder-only)
  -> :class:`EncodedBatch`; during decoding it also
  answers draft proposals (:class:`~rayspec.decoding.proposer.DraftProposer`).
- :class:`TargetDecoder` (the target side): runs the target decoder (AR, verification, fallback) -> result rows.

:class:`Transcriber` runs both in one process (the CLI, bench and Serve replicas); ``actors/`` hosts them on separate
Ray actors and ``jobs/transcribe.py`` streams batches between them through the object store.

Faults stay with their row: a bad file becomes one row with ``error``/``error_code`` set and empty text; a batch
whose encoding or decoding raises is redone utterance by utterance (:meth:`Transcriber.transcribe`), so only the
utterance that fails alone becomes an error row. Recordings longer than the model's window are cut in pauses
(:mod:`rayspec.vad`), decoded as rows of the same batch and re-joined; recordings without speech get empty text
(route "no_speech") without a decoder pass.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field, replace
from typing import Any, Iterable, Iterator, Optional

import numpy as np
import torch

from .audio import AudioError, AudioLimits, load_audio
from .batching import BatchBudget
from .compute import as_compute_type, label as compute_type_label, synchronize
from .decoding.common import DecodeStats, Hypothesis, compression_ratio, token_cap
from .decoding.beam import beam_decode
from .decoding.beam_speculative import DEFAULT_MAX_DRAFT as BEAM_MAX_DRAFT, LookupDrafter, speculative_beam_decode
from .decoding.fallback import decode_with_fallback
from .decoding.proposer import DraftProposer, SpeculationOptions, check_compatible
from .decoding.ssd import ctc_drafts, defers_drafts
from .longform import decode_sequential
from .manifest import RequestOptions, Utterance
from .decoding.options import DecodeOptions
from .methods import METHODS, Encoded, ProposerFactory
from .models.ctc import CTCHead
from .models.errors import ModelLoadError
from .models.registry import DEFAULT_TARGET, default_drafter
from .models.encoded import EncoderOutput
from .models.whisper import WhisperASR
from .results import ResultRow
from .runs import budget_rows, internal_error_row
from .runner.static_step import prepare_static_steps
from .spec_decode.gumbel import row_seed
from .spec_decode import loop as verify_loop
from .spec_decode.loop import Proposer, speculate_max_rows
from .spec_decode.rule import round_pays, seed_costs
from .activity import speech_activity
from .timing import clip_times, parse_segments, word_timestamps
from .vad import SegmentOptions, has_speech, segments

def needs_draft(options: DecodeOptions) -> bool:
    """Whether ``options`` use a draft model (method "draft", or "ssd" with the draft fallback)."""
    return METHODS[options.method].needs_draft(options)


BEAM_ACCEPTED = 0.12
"""Beam-search steps beyond the first that a speculating round of ``ctc-draft`` takes (whisper-base, 12 LJSpeech
clips, beam 5, batch 1: 11% fewer target passes than plain beam search, and 0.81x its speed on a CPU)."""


def beam_speculates(target: WhisperASR, options: DecodeOptions, rows: int) -> bool:
    """Whether a beam search over ``rows`` rows speculates (:mod:`rayspec.decoding.beam_speculative`): method
    ``ctc-draft`` where a round over all the beams pays by the speculation rule's seeded costs
    (:func:`~rayspec.spec_decode.rule.round_pays` with :data:`BEAM_ACCEPTED` steps gained a round; the target's
    warm-up pass costs where static steps measured them: never on a CPU, where a pass over every beam's draft costs
    far more than 1.12 one-token steps), or, with ``speculate_max_rows`` given, where that cap allows every beam as
    a live row. Any other beam search reads no drafts, so its batch skips the drafter (:func:`encode_audio`)."""
    if options.method != "ctc-draft":
        return False
    beams = rows * options.beam_size
    if options.speculate_max_rows is not None or not verify_loop.COST_RULE:
        limit = speculate_max_rows(target.device, options.speculate_max_rows)
        return not limit or limit >= beams
    cost = seed_costs(target.device.type, "ctc-draft", getattr(target, "static_steps", None), BEAM_MAX_DRAFT)
    return round_pays(cost(beams, False), cost(beams, True), beams, beams, BEAM_ACCEPTED)


@torch.inference_mode()
def encode_audio(target: WhisperASR, options: DecodeOptions, audios: list[np.ndarray], durations: list[float],
                 draft: Optional[WhisperASR] = None, ctc=None, keys: Optional[list[str]] = None,
                 requests: Optional[list[Optional[RequestOptions]]] = None,
                 firsts: Optional[list[bool]] = None) -> Encoded:
    """The drafting side of one batch: features, the target's encoder, and the CTC head or the draft's encoder (a
    decoder-only draft shares the target's encoder states).

    Args:
        audios: ``B`` mono float32 waveforms at the target's sample rate; durations: their lengths in seconds.
        keys: ``B`` stable row keys (utterance id and segment) that seed sampled rows; default the row indices.
        requests: ``B`` online requests' own options (prompt, temperature, language) or None: ``options``'.
        firsts: ``B`` flags, whether a row is its file's first segment (``options.prefix`` starts those; default
            all).

    Raises:
        ModelLoadError: a language the model does not have.
    """
    feats, lengths = target.features(audios, mel_padding=options.mel_padding)
    enc = target.encode(target.short_window(feats, lengths, options.short_window_s), lengths)
    requests = requests if requests and any(r is not None for r in requests) else None
    enc.prompts = row_prompts(target, options, enc, requests)
    if options.timestamps == "word":  # the word-timing pass reuses the decoder's cross-attention keys/values
        enc.cross = {}
    prompt_lengths = ([len(p) for p in enc.prompts] if enc.prompts is not None else
                      [len(target.prompt_ids) + len(conditioning(target, options))] * len(audios))
    caps = [token_cap(d, options.max_tokens_per_second, target.max_target_positions - n - 1)
            for d, n in zip(durations, prompt_lengths)]
    if options.prefix:  # decided tokens of each file's first segment (they count against its cap)
        tokens = text_tokens(target, options.prefix)[: target.max_target_positions // 2 - 1]
        enc.prefixes = [tokens if firsts is None or firsts[r] else [] for r in range(len(audios))]
        caps = [min(c + len(p), target.max_target_positions - n - 1)
                for c, p, n in zip(caps, enc.prefixes, prompt_lengths)]
    # under a beam search that does not speculate, the drafter's work would go unread
    drafted = options.beam_size == 1 or beam_speculates(target, options, len(audios))
    out = Encoded(enc, caps, keys=keys, drafted=drafted)
    enc.sampling = first_sampling(options, out, requests)
    if METHODS[options.method].needs_ctc and drafted:  # exact ssd above the row cap: drafted where it speculates
        defer = (options.method == "ssd" and options.beam_size == 1 and
                 defers_drafts(options.ssd, len(audios), speculate_max_rows(target.device, options.speculate_max_rows)))
        out.ctc = ctc_drafts(ctc, target, enc, deferred=defer)
    if needs_draft(options) and drafted:  # a decoder-only draft reads the target's encoder states (no second encoder)
        out.draft = draft.encode(*draft.features(audios, mel_padding=options.mel_padding)) if draft.has_encoder else enc
    return out


def row_prompts(target: WhisperASR, options: DecodeOptions, enc: EncoderOutput,
                requests: Optional[list[Optional[RequestOptions]]] = None) -> Optional[list[list[int]]]:
    """The decoder prompt of each encoded row: :func:`conditioning` tokens, then Whisper's prompt in the language
    detected per row with ``language="auto"`` (one decoder pass), else ``options.language`` (English-only models
    take "en" or "auto" and need no pass); a row's request may set its own prompt text and language. None where
    detection needs the decoder and this process has released it (a drafter actor): the target side then detects
    (:func:`decode_encoded`).

    Raises:
        ModelLoadError: a language or task the model does not have.
    """
    b = enc.states.shape[0]
    stamps = options.timestamps != "none"
    before = conditioning(target, options)
    if options.language == "auto" and target.multilingual:
        if not target.has_decoder:
            return None
        prompts = [before + target.prompt_for(c, options.task, stamps)
                   for c in target.detect_language(enc, options.task)[0]]
    else:
        language = None if options.language == "auto" else options.language
        prompts = [before + target.prompt_for(language, options.task, stamps)] * b
    for r, req in enumerate(requests or []):
        if req is not None and (req.prompt is not None or req.language):
            own = conditioning(target, options, req.prompt) if req.prompt is not None else before
            main = prompts[r][len(before):]
            if req.language:
                main = target.prompt_for(None if req.language == "auto" else req.language, options.task, stamps)
            prompts[r] = own + main
    return prompts


def conditioning(target: WhisperASR, options: DecodeOptions, prompt: Optional[str] = None) -> list[int]:
    """The tokens before ``<|startoftranscript|>``: ``<|startofprev|>``, then ``options.hotwords`` (at most half the
    decoder's context, faster-whisper's ``hotwords``) and the prompt text (``prompt``, else
    ``options.initial_prompt``: its last tokens that fit, openai/whisper's ``prompt``), each encoded with a leading
    space; none without either.

    Raises:
        ModelLoadError: a model without ``<|startofprev|>`` given a prompt.
    """
    text = options.initial_prompt if prompt is None else prompt
    if not (text or options.hotwords):
        return []
    tok = target.tokenizer
    prev = tok.convert_tokens_to_ids("<|startofprev|>")
    if not isinstance(prev, int) or prev == tok.unk_token_id:
        raise ModelLoadError(f"{target.name or 'the model'} has no <|startofprev|> token: no prompts")
    half = target.max_target_positions // 2 - 1
    hot = text_tokens(target, options.hotwords)[:half] if options.hotwords else []
    return [prev] + hot + (text_tokens(target, text)[-half:] if text else [])


def text_tokens(target: WhisperASR, text: str) -> list[int]:
    """``text`` as Whisper tokenizes a prompt, a prefix or hotwords: with a leading space, no special tokens."""
    return target.tokenizer(" " + text.strip(), add_special_tokens=False).input_ids


def first_sampling(options: DecodeOptions, encoded: Encoded,
                   requests: Optional[list[Optional[RequestOptions]]] = None) -> Optional[list[tuple[float, int]]]:
    """Each row's ``(temperature, seed)`` for its first decoding (a request's temperature above 0, else the first of
    ``options.temperatures``), None where every row decodes greedily."""
    temps = [options.temperatures[0]] * len(encoded.caps)
    for r, req in enumerate(requests or []):
        if req is not None and req.temperature:
            temps[r] = float(req.temperature)
    if max(temps) <= 0:
        return None
    return [(t, row_seed(options.seed, encoded.key(i), 0, 0)) for i, t in enumerate(temps)]


def local_proposers(draft: WhisperASR, encoded: Encoded, options: SpeculationOptions) -> ProposerFactory:
    """Proposers over ``encoded``'s rows with ``draft`` in this process."""

    def make(rows: list[int], caps: list[int]) -> Proposer:
        sub = encoded.draft.select(torch.tensor(rows, device=encoded.draft.states.device))
        return DraftProposer(draft, sub, caps, options)

    return make


@torch.inference_mode()
def decode_encoded(target: WhisperASR, options: DecodeOptions, encoded: Encoded,
                   proposers: Optional[ProposerFactory] = None) -> list[Hypothesis]:
    """The target side of one batch: the configured decoder over ``encoded`` (see :class:`DecodeOptions`).

    Args:
        proposers: where draft proposals come from (method "draft" and the ssd draft fallback).

    Raises:
        ValueError: a method that needs draft proposals without ``proposers``.
    """
    if needs_draft(options) and proposers is None and options.beam_size == 1:
        raise ValueError(f"method {options.method!r} with these options needs a draft proposer")
    if encoded.target.prompts is None:  # encoded where the decoder was released: detect the language here
        encoded.target.prompts = row_prompts(target, options, encoded.target)
    if options.beam_size > 1:
        hyps = _beam_first(target, options, encoded, proposers)
    else:
        hyps = METHODS[options.method].decode(target, options, encoded, proposers)
    return fallback(target, options, encoded, hyps, proposers)


def _beam(target: WhisperASR, options: DecodeOptions, encoded: Encoded) -> list[Hypothesis]:
    """Beam search over ``encoded``'s rows; a row's prefix ends its prompt and starts its tokens. With a CTC
    hypothesis at hand (``ctc-draft``), the search speculates exactly: each beam drafts from it
    (:mod:`rayspec.decoding.beam_speculative`), the same hypotheses in fewer target passes."""
    enc = encoded.target
    prefixes = enc.row_prefixes()
    prompts = [p + f for p, f in zip(enc.row_prompts(target.prompt_ids), prefixes)]
    caps = [c - len(f) for c, f in zip(encoded.caps, prefixes)]
    prompts = prompts if enc.prefixes is not None else None
    if encoded.ctc is not None and beam_speculates(target, options, len(caps)):
        hyps = speculative_beam_decode(target, enc, caps, LookupDrafter(encoded.ctc.tokens), options.beam, prompts)
    else:
        hyps = beam_decode(target, enc, caps, options.beam, prompts)
    for h, f in zip(hyps, prefixes):
        h.tokens[:0] = f
    return hyps


def _beam_first(target: WhisperASR, options: DecodeOptions, encoded: Encoded,
                proposers: Optional[ProposerFactory]) -> list[Hypothesis]:
    """The first decoding with ``options.beam_size > 1``: beam search for the rows at temperature 0, the method
    (``ar`` without proposers) for rows an online request samples."""
    greedy = [i for i, (t, _) in enumerate(encoded.target.row_sampling()) if t <= 0]
    hyps: list[Optional[Hypothesis]] = [None] * len(encoded.caps)
    if greedy:
        sub = encoded.select(greedy) if len(greedy) < len(hyps) else encoded
        for i, h in zip(greedy, _beam(target, options, sub)):
            hyps[i] = h
    if len(greedy) == len(hyps):
        return hyps
    sampled = [i for i in range(len(hyps)) if hyps[i] is None]
    for i, h in zip(sampled, decode_rows(target, options, encoded, sampled, proposers)):
        hyps[i] = h
    return hyps


def decode_rows(target: WhisperASR, options: DecodeOptions, encoded: Encoded, rows: list[int],
                proposers: Optional[ProposerFactory] = None,
                sampling: Optional[list[tuple[float, int]]] = None) -> list[Hypothesis]:
    """Decode the batch rows ``rows`` (indices, repeats allowed) again, with the batch's method: ``ar`` for ssd
    (whose gate and verification are greedy) and for a draft method without ``proposers``; ``sampling``: the rows'
    ``(temperature, seed)`` (None: as encoded); a batch encoded without its drafter (``encoded.drafted``) decodes
    with ``ar``."""
    method = ("ar" if options.method == "ssd" or not encoded.drafted or (needs_draft(options) and proposers is None)
              else options.method)
    sub = encoded.select(rows)
    if sampling is not None:
        sub.target.sampling = sampling
    sub_proposers = None if method == "ar" or proposers is None else (
        lambda rs, caps: proposers([rows[r] for r in rs], caps))
    return METHODS[method].decode(target, replace(options, method=method), sub, sub_proposers)


def fallback(target: WhisperASR, options: DecodeOptions, encoded: Encoded, hyps: list[Hypothesis],
             proposers: Optional[ProposerFactory] = None) -> list[Hypothesis]:
    """Temperature fallback over one decoded batch (:func:`~rayspec.decoding.fallback.decode_with_fallback`): the
    failing rows re-decode together at the next temperature (:func:`decode_rows`)."""
    if len(options.temperatures) < 2:
        return hyps

    def redo(rows: list[int], t: float, attempt: int, copies: int) -> list[Hypothesis]:
        picked = [i for i in rows for _ in range(copies)]
        sampling = [(t, row_seed(options.seed, encoded.key(i), attempt, j)) for i in rows for j in range(copies)]
        greedy = [(0.0, 0)] * len(picked)
        return decode_rows(target, options, encoded, picked, proposers, sampling if t > 0 else greedy)

    return decode_with_fallback(hyps, redo, target.decode_text, options.fallback)


def speculation_options(options: DecodeOptions) -> SpeculationOptions:
    """The draft-speculation options in effect (the ssd fallback's under method "ssd")."""
    if options.method == "ssd":
        return options.ssd.speculation
    return options.speculation


def decode_batch(target: WhisperASR, options: DecodeOptions, audios: list[np.ndarray], durations: list[float],
                 draft: Optional[WhisperASR] = None, ctc=None, timings: Optional[dict] = None,
                 keys: Optional[list[str]] = None) -> list[Hypothesis]:
    """Drafting and target side of one batch of waveforms in this process (the target's sample rate).

    Used by :class:`Transcriber` and ``rayspec bench`` alike, so benchmarks time exactly what jobs run.

    Args:
        timings: if given, seconds are added to its ``"encode"`` (the drafting side: features, encoders, CTC head)
            and ``"decode"`` (the target side, draft passes included) entries, each phase ended by a device
            synchronisation on CUDA (:func:`~rayspec.compute.synchronize`).
        keys: ``B`` stable keys that seed sampled rows (e.g. utterance ids; default the row indices).
    """
    t0 = time.perf_counter()
    encoded = encode_audio(target, options, audios, durations, draft, ctc, keys)
    if timings is not None:  # the encoder's queued GPU work is the encode side's
        synchronize(target.device)
    t1 = time.perf_counter()
    proposers = local_proposers(draft, encoded, speculation_options(options)) if needs_draft(options) else None
    hyps = decode_encoded(target, options, encoded, proposers)
    if timings is not None:
        synchronize(target.device)
        timings["encode"] = timings.get("encode", 0.0) + t1 - t0
        timings["decode"] = timings.get("decode", 0.0) + time.perf_counter() - t1
    return hyps


def stream_decode(target: WhisperASR, options: DecodeOptions, batches: Iterable[tuple[Any, Encoded]], slots: int,
                  draft: Optional[WhisperASR] = None) -> Iterator[tuple[tuple[Any, int], Hypothesis]]:
    """Continuous batching over encoded batches in this process: up to ``slots`` rows decode at once, and a
    finished row's slot is refilled from the next batch before the next decoder pass
    (:meth:`~rayspec.spec_decode.loop.VerifyLoop.decode_stream`). ``batches`` is read lazily (encode on demand).

    Args:
        batches: ``(key, encoded batch)`` pairs (on the target's device and dtype), longest first preferably (later
            rows then fit the first rows' cross-attention cache without growing it), or None for "nothing ready now"
            (an online queue; see :meth:`~rayspec.spec_decode.loop.VerifyLoop.decode_stream`).
        draft: the draft model for method "draft".

    Yields:
        ``((key, row), hypothesis)`` per encoded row as it finishes.
    """
    method = METHODS[options.method]
    # a row's prompt + cap never exceed the decoder's positions (encode_audio), whatever its <|startofprev|> text
    limit = target.max_target_positions - len(target.prompt_ids) - 1
    loop = method.stream(target, options, draft, limit)
    rows = (None if item is None else
            method.admission(target, options, [(item[0], r) for r in range(len(item[1].caps))], item[1])
            for item in batches)
    return loop.decode_stream(rows, slots, limit)


@dataclass
class EncodedBatch:
    """A batch of utterances after the drafting side; what travels to the target side (Ray's object store).

    The encoder rows are speech segments: one per utterance within the model's window, several (consecutive) for a
    longer one, none for an utterance with an error or without speech.

    Attributes:
        utterances: the batch (``U`` utterances).
        errors: ``U`` entries, why the utterance's audio could not be used (None if it could).
        error_codes: ``U`` entries, the stable code of each error (:class:`~rayspec.audio.AudioError` ``code``).
        durations: ``U`` entries, seconds of audio per utterance (0 for errors).
        encoded: the segments' :class:`Encoded` (``R`` rows), None if there are none.
        owners: ``R`` entries, the utterance index of each encoded row.
        spans: ``R`` entries, ``(start, end)`` seconds of each encoded row within its utterance.
        activity: with word timestamps refined (``DecodeOptions.refine_words``), ``R`` entries: each row's speech
            frames (:func:`~rayspec.activity.speech_activity`, bool ``[F]``); else empty.
        draft_model: name of the draft model ("" without one); encode_s: wall seconds spent here.
        part, parts: this batch is part ``part`` of ``parts`` of one batch of utterances
            (:meth:`Drafter.encode_parts`): ``owners``, ``spans``, ``activity`` and ``encoded`` are then this part's
            rows only; :class:`PartJoiner` joins the parts' decoded rows.
    """

    utterances: list[Utterance]
    errors: list[Optional[str]]
    error_codes: list[Optional[str]]
    durations: list[float]
    encoded: Optional[Encoded]
    owners: list[int] = field(default_factory=list)
    spans: list[tuple[float, float]] = field(default_factory=list)
    draft_model: str = ""
    encode_s: float = 0.0
    activity: list[np.ndarray] = field(default_factory=list)
    part: int = 0
    parts: int = 1


def merge_hypotheses(hyps: list[Hypothesis], separator: list[int]) -> Hypothesis:
    """One hypothesis from the consecutive segments of an utterance: tokens joined by ``separator`` (e.g. the space
    token), counters and log-probabilities added (the largest CTC entropy, no-speech probability and temperature),
    finished only if every segment ended with EOS."""
    if len(hyps) == 1:
        return hyps[0]
    tokens: list[int] = []
    for h in hyps:
        if tokens and h.tokens:
            tokens += separator
        tokens += h.tokens
    stats = DecodeStats()
    for h in hyps:
        s = h.stats
        stats.target_forward_passes += s.target_forward_passes
        stats.draft_forward_passes += s.draft_forward_passes
        stats.draft_tokens_proposed += s.draft_tokens_proposed
        stats.draft_tokens_accepted += s.draft_tokens_accepted
        stats.rounds += s.rounds
        if s.accepted_prefix is not None:
            stats.accepted_prefix = (stats.accepted_prefix or 0) + s.accepted_prefix
        if s.ctc_entropy is not None:
            stats.ctc_entropy = max(stats.ctc_entropy or 0.0, s.ctc_entropy)
        if s.no_speech_prob is not None:
            stats.no_speech_prob = max(stats.no_speech_prob or 0.0, s.no_speech_prob)
        stats.sum_logprob = None if None in (stats.sum_logprob, s.sum_logprob) else stats.sum_logprob + s.sum_logprob
        stats.scored_tokens += s.scored_tokens
        stats.temperature = max(stats.temperature, s.temperature)
    routes = {h.route for h in hyps}
    return Hypothesis(tokens, all(h.finished for h in hyps), routes.pop() if len(routes) == 1 else "mixed", stats)


class Drafter:
    """The drafting side: loads audio, runs the target's encoder and the drafter (CTC head or draft model).

    In process it feeds :class:`TargetDecoder` directly (:class:`Transcriber`); on Ray it is hosted by
    ``actors.drafter.DrafterActor`` and its :class:`EncodedBatch` travels through the object store.

    Args:
        target: target model name or directory (default ``whisper-base``; see
            :func:`~rayspec.models.registry.resolve_model`); its encoder runs here.
        draft: draft model directory for ``method="draft"`` and the ssd draft fallback (default: the draft bundled
            for the target, :func:`~rayspec.models.registry.default_drafter`).
        ctc: CTC head directory for ``method="ssd"`` / ``"ctc-draft"`` (default: the one bundled for the target).
        options: decoder choice and options; device: torch device; dtype: model dtype (fp32 is the exact reference),
            or a compute type name (``auto``: resolved here, :mod:`rayspec.compute`);
            encoder_dtype: the encoders' compute dtype if not ``dtype`` (a lossy speed option, e.g. bfloat16 on CPU).
        limits: audio byte/duration limits (default :class:`~rayspec.audio.AudioLimits`: 25 MB, 50 ms to 4 h; audio
            longer than the target's window is segmented).

    Raises:
        ValueError: unknown method, or a draft that does not share the target's tokenizer.
        ModelLoadError: a model directory that cannot be loaded.
    """

    def __init__(self, target: Optional[str] = None, draft: Optional[str] = None,
                 options: DecodeOptions = DecodeOptions(), ctc: Optional[str] = None, device: str = "cpu",
                 dtype: torch.dtype | str = torch.float32, limits: Optional[AudioLimits] = None,
                 encoder_dtype: Optional[torch.dtype] = None) -> None:
        self.options = options
        chosen = as_compute_type(dtype, device)
        dtype = chosen.dtype
        self.target = WhisperASR.from_pretrained(target or DEFAULT_TARGET, device, dtype, encoder_dtype, lean=True)
        self.target.pack_for_inference(chosen.int8)
        self.target.prompt_for(None if options.language == "auto" else options.language, options.task,
                               options.timestamps != "none")  # checked
        self.draft = self.ctc = None
        if METHODS[options.method].needs_ctc:
            self.ctc = CTCHead.from_pretrained(ctc or default_drafter(self.target.name, "ctc"), device).to(dtype)
        if options.method == "medusa" and not options.medusa.heads:  # fail here, not in every batch
            default_drafter(self.target.name, "medusa")
        if needs_draft(options):
            self.draft = WhisperASR.from_pretrained(draft or default_drafter(self.target.name, "draft"), device, dtype,
                                                    encoder_dtype, lean=True).pack_for_inference(chosen.int8)
            check_compatible(self.target, self.draft)
            prepare_static_steps(self.draft, options.static_steps, options.cuda_graphs, options.max_graph_batch,
                                 head=False)
        self.limits = limits or AudioLimits()

    @property
    def sample_rate(self) -> int:
        return self.target.sample_rate

    def encode(self, utterances: list[Utterance], audios: Optional[list[np.ndarray]] = None) -> EncodedBatch:
        """Load, segment and encode one batch, all its rows at once (:meth:`encode_parts` in one part); unusable
        audio becomes an ``errors`` entry, never an exception.

        Args:
            utterances: the batch; audios: their waveforms if already loaded (mono float32 at :attr:`sample_rate`),
                else each utterance's ``audio`` path is loaded with the drafter's limits.

        Raises:
            Exception: whatever the feature extractor or an encoder raises for the batch as a whole (callers redo
                the batch utterance by utterance; see :meth:`Transcriber.transcribe`).
        """
        return next(self.encode_parts(utterances, audios, None))

    def encode_parts(self, utterances: list[Utterance], audios: Optional[list[np.ndarray]] = None,
                     part_rows: Optional[int] = None) -> Iterator[EncodedBatch]:
        """Load and segment one batch, then encode its rows (speech segments) a part at a time, each part as it is
        asked for: a long recording's windows go through the encoders, and on to the decoder, in bounded groups,
        while its waveform is held once.

        Args:
            utterances, audios: as :meth:`encode`.
            part_rows: rows per part; a batch's rows up to ``max(part_rows, len(utterances))`` come in one part (a
                batch planned one row per utterance stays whole), so only recordings longer than the model's window
                split a batch. None: one part.

        Yields:
            :class:`EncodedBatch` parts in order (``part`` 0 .. ``parts - 1``): each with the batch's utterances,
            errors and durations, and its own rows (``owners``, ``spans``, ``encoded``; row keys and first-segment
            flags as in the whole batch); one part without rows where no utterance has speech. Join their decoded
            rows with :class:`PartJoiner`.

        Raises:
            Exception: as :meth:`encode`, from the part being encoded.
        """
        t0 = time.perf_counter()
        rate = self.sample_rate
        window = SegmentOptions(max_seconds=self.target.max_audio_seconds)
        errors: list[Optional[str]] = [None] * len(utterances)
        codes: list[Optional[str]] = [None] * len(utterances)
        durations = [0.0] * len(utterances)
        pieces, owners, spans = [], [], []
        for i, u in enumerate(utterances):
            try:
                audio = load_audio(u.source, rate, self.limits) if audios is None else audios[i]
            except AudioError as exc:
                errors[i], codes[i] = str(exc), exc.code
                continue
            durations[i] = len(audio) / rate
            if durations[i] <= window.max_seconds:
                if self.options.vad and not has_speech(audio, rate):
                    continue
                cuts = [(0, len(audio))]
            else:
                cuts = segments(audio, rate, window)
            for a, b in cuts:
                pieces.append(audio[a:b])  # views: the waveform is held once
                owners.append(i)
                spans.append((a / rate, b / rate))
        name = self.draft.name if self.draft else ""
        if not pieces:
            yield EncodedBatch(list(utterances), errors, codes, durations, None, [], [], name,
                               time.perf_counter() - t0)
            return
        segment, seen = [], {}  # each row's segment index within its utterance
        for i in owners:
            seen[i] = seen.get(i, -1) + 1
            segment.append(seen[i])
        keys = [f"{utterances[i].id}\x1f{k}" for i, k in zip(owners, segment)]  # id, segment: seeds sampled rows
        size = max(part_rows or len(pieces), len(utterances))
        parts = -(-len(pieces) // size)
        for p, s in enumerate(range(0, len(pieces), size)):
            e = s + size
            rows = pieces[s:e]
            encoded = encode_audio(self.target, self.options, rows, [len(x) / rate for x in rows], self.draft,
                                   self.ctc, keys[s:e], [utterances[i].request for i in owners[s:e]],
                                   [k == 0 for k in segment[s:e]])
            synchronize(self.target.device)  # encode_s holds the encoder's GPU work, not the decoder's first round
            activity = ([speech_activity(x, rate) for x in rows]
                        if self.options.timestamps == "word" and self.options.refine_words else [])
            for r in range(s, min(e, len(pieces))):
                pieces[r] = None  # encoded: the part no longer holds its samples
            yield EncodedBatch(list(utterances), errors, codes, durations, encoded, owners[s:e], spans[s:e], name,
                               time.perf_counter() - t0, activity, p, parts)
            t0 = time.perf_counter()

    def proposers(self, encoded: Encoded) -> ProposerFactory:
        """Draft proposers over a batch this drafter encoded (in this process)."""
        return local_proposers(self.draft, encoded, speculation_options(self.options))


@dataclass
class DecodedRow:
    """One encoded row after the target side: its hypothesis, its words with ``timestamps="word"`` (dicts with
    seconds from the utterance's start, else None) and the language its prompt named (None: an English-only model)."""

    hyp: Hypothesis
    words: Optional[list[dict]] = None
    language: Optional[str] = None


class PartJoiner:
    """Joins the decoded parts of batches that :meth:`Drafter.encode_parts` split: a batch's result rows once all its
    parts are in (they may finish in any order); a whole batch's rows at once.

    Args:
        decoder: the :class:`TargetDecoder` whose :meth:`~TargetDecoder.join` makes the rows.
    """

    def __init__(self, decoder: "TargetDecoder") -> None:
        self.decoder = decoder
        self.parts: dict[Any, dict[int, tuple[EncodedBatch, list[DecodedRow], float]]] = {}

    def add(self, key: Any, batch: EncodedBatch, decoded: list[DecodedRow], seconds: float
            ) -> Optional[list[ResultRow]]:
        """Add part ``batch.part`` of the batch ``key`` with its rows decoded and its wall seconds; returns the
        batch's result rows (one per utterance) once its last part is in, else None."""
        if batch.parts == 1:
            return self.decoder.join(batch, decoded, seconds)
        got = self.parts.setdefault(key, {})
        got[batch.part] = (replace(batch, encoded=None, activity=[]), decoded, seconds)  # its rows' places only
        if len(got) < batch.parts:
            return None
        del self.parts[key]
        ordered = [got[p] for p in range(batch.parts)]
        whole = replace(batch, encoded=None, owners=[i for b, _, _ in ordered for i in b.owners],
                        spans=[x for b, _, _ in ordered for x in b.spans], activity=[], part=0, parts=1)
        return self.decoder.join(whole, [d for _, ds, _ in ordered for d in ds], sum(t for _, _, t in ordered))


class TargetDecoder:
    """The target side: decodes :class:`EncodedBatch` es with the target model and writes result rows.

    Args:
        target: the target model (loaded, e.g. with :meth:`WhisperASR.from_pretrained`).
        options: decoder choice and options (the drafter's).
    """

    def __init__(self, target: WhisperASR, options: DecodeOptions) -> None:
        self.target, self.options = target, options
        encoder = target.encoder_dtype if getattr(target.model.model, "encoder", None) is not None else None
        self._compute_type = compute_type_label(target.dtype, encoder, target.int8)
        # static-shape steps (and on CUDA their graphs) captured now, before any job: rayspec.runner.static_step
        self.static_steps = prepare_static_steps(target, options.static_steps, options.cuda_graphs,
                                                 options.max_graph_batch)

    def decode(self, batch: EncodedBatch, proposers: Optional[ProposerFactory] = None) -> list[ResultRow]:
        """One result row per utterance of ``batch`` (a whole batch, :meth:`Drafter.encode`): error rows for the audio
        the drafting side could not use, empty text (route "no_speech") for utterances without speech segments,
        segment texts re-joined."""
        decoded, seconds = self.decode_part(batch, proposers)
        return self.join(batch, decoded, seconds)

    def decode_part(self, batch: EncodedBatch, proposers: Optional[ProposerFactory] = None
                    ) -> tuple[list[DecodedRow], float]:
        """The decoded rows of ``batch`` (a whole batch or one part of one, :meth:`Drafter.encode_parts`) and the wall
        seconds spent on it (its encoding included); :meth:`join` or :class:`PartJoiner` makes result rows of them."""
        if batch.encoded is None:
            return [], 0.0
        t0 = time.perf_counter()
        encoded = batch.encoded.to(self.target.device, self.target.dtype)
        hyps = decode_encoded(self.target, self.options, encoded, proposers)
        batch.encoded.target.prompts = encoded.target.prompts  # as decoded (the language detected here, if it was)
        return self.decoded(batch, hyps), batch.encode_s + time.perf_counter() - t0

    def decode_stream(self, batches: Iterable[Optional[tuple[Any, EncodedBatch]]], slots: int,
                      draft: Optional[WhisperASR] = None,
                      pending: Optional[dict] = None) -> Iterator[tuple[Any, list[ResultRow]]]:
        """Continuous batching over encoded batches (:func:`stream_decode`): up to ``slots`` rows decode at once, and
        a finished row's slot is refilled from the next batch before the next decoder pass. Batches without encoded
        rows (errors, no speech) yield their rows as they are read.

        Args:
            batches: ``(key, batch)`` pairs, read lazily, longest first preferably; or None for "nothing ready now"
                (an online queue: the stream ends once nothing is decoding). The parts of a batch
                (:meth:`Drafter.encode_parts`) come as consecutive pairs under the batch's key.
            draft: the draft model for method "draft" (in this process).
            pending: if given, holds ``key -> batch`` for the batches begun and not yet finished (on an exception:
                the batches to redo).

        Yields:
            ``(key, rows)`` once per batch, as its last row finishes (not in input order); a batch's wall seconds
            (shared out over its rows' ``decode_s``) are those since the previous batch (or part) finished.
        """
        t = self.target
        pending = {} if pending is None else pending
        if self.options.beam_size > 1:  # an audio's beams are rows of one search: batch by batch, not continuous
            yield from self._decode_batches(batches, draft, pending)
            return
        live: dict[Any, EncodedBatch] = {}  # (key, part) -> the part, while its rows decode
        hyps: dict[Any, list[Optional[Hypothesis]]] = {}
        ready: list[tuple[Any, list[ResultRow]]] = []  # batches with nothing to decode
        joiner = PartJoiner(self)
        clock = [time.perf_counter()]

        def source():
            for item in batches:
                if item is None:
                    yield None
                    continue
                key, eb = item
                if eb.encoded is None:
                    done = joiner.add(key, eb, [], eb.encode_s)
                    if done is not None:
                        ready.append((key, done))
                    continue
                encoded = eb.encoded.to(t.device, t.dtype)
                if encoded.target.prompts is None:  # encoded where the decoder was released: detect the language here
                    encoded.target.prompts = row_prompts(t, self.options, encoded.target)
                eb.encoded.target.prompts = encoded.target.prompts
                pending.setdefault(key, eb)
                live[key, eb.part], hyps[key, eb.part] = eb, [None] * len(eb.owners)
                yield (key, eb.part), encoded

        for ((k, p), r), h in stream_decode(t, self.options, source(), slots, draft):
            hyps[k, p][r] = h
            if all(x is not None for x in hyps[k, p]):
                eb = live.pop((k, p))
                done = self._fallback(eb, hyps.pop((k, p)), draft)
                now = time.perf_counter()
                # wall time since the previous batch finished (it holds this batch's encoding when that ran inside
                # the stream; adding encode_s would count it twice)
                rows = joiner.add(k, eb, self.decoded(eb, done), now - clock[0])
                clock[0] = now
                if rows is not None:
                    pending.pop(k)
                    yield k, rows
            while ready:
                yield ready.pop()
        yield from ready

    def _decode_batches(self, batches, draft: Optional[WhisperASR], pending: dict
                        ) -> Iterator[tuple[Any, list[ResultRow]]]:
        """:meth:`decode_stream`'s batches (and parts) decoded one after another (beam search); None (nothing ready)
        ends it."""
        joiner = PartJoiner(self)
        for item in batches:
            if item is None:
                return
            key, eb = item
            pending.setdefault(key, eb)
            proposers = None
            if eb.encoded is not None and draft is not None and needs_draft(self.options):
                proposers = local_proposers(draft, eb.encoded.to(self.target.device, self.target.dtype),
                                            speculation_options(self.options))
            rows = joiner.add(key, eb, *self.decode_part(eb, proposers))
            if rows is not None:
                pending.pop(key)
                yield key, rows

    def _fallback(self, batch: EncodedBatch, hyps: list[Hypothesis], draft: Optional[WhisperASR]
                  ) -> list[Hypothesis]:
        """Temperature fallback for a batch the stream decoded (:func:`fallback`; its failing rows in one batch)."""
        if len(self.options.temperatures) < 2:
            return hyps
        encoded = batch.encoded.to(self.target.device, self.target.dtype)
        proposers = (local_proposers(draft, encoded, speculation_options(self.options))
                     if draft is not None and needs_draft(self.options) else None)
        return fallback(self.target, self.options, encoded, hyps, proposers)

    def decoded(self, batch: EncodedBatch, hyps: list[Hypothesis]) -> list[DecodedRow]:
        """Per encoded row of ``batch`` (a whole batch or a part), its hypothesis with its words (``timestamps="word"``:
        one batched teacher-forced target pass over the batch's encoder states) and its prompt's language."""
        words = self._words(batch, hyps)
        prompts = batch.encoded.target.prompts if batch.encoded is not None else None
        return [DecodedRow(h, None if words is None else words[r],
                           None if prompts is None else self._language(prompts[r])) for r, h in enumerate(hyps)]

    def join(self, batch: EncodedBatch, decoded: list[DecodedRow], seconds: float) -> list[ResultRow]:
        """The result rows of ``batch``'s utterances from its encoded rows decoded (``R``, in the order of
        ``batch.owners``: all the rows of its utterances) and the wall seconds spent on them (shared out by
        duration)."""
        rows = [self._row(u, None, 0.0, batch.draft_model, error=e, code=c) if e else
                self._row(u, Hypothesis([], True, "no_speech"), 0.0, batch.draft_model, duration=d)
                for u, e, c, d in zip(batch.utterances, batch.errors, batch.error_codes, batch.durations)]
        owned: dict[int, list[int]] = {}
        for r, i in enumerate(batch.owners):
            owned.setdefault(i, []).append(r)
        total = sum(batch.durations[i] for i in owned) or 1.0
        hyps = [d.hyp for d in decoded]
        for i, rs in owned.items():
            d = batch.durations[i]
            spoken = [r for r in rs if not self._no_speech(hyps[r])]
            h = merge_hypotheses([hyps[r] for r in rs], self._separator)
            if not spoken:  # every segment is silence by the target's own judgement (its passes still count)
                h = Hypothesis([], True, "no_speech", h.stats)
            elif len(spoken) < len(rs):  # text of the spoken segments, counters of all
                h = Hypothesis(merge_hypotheses([hyps[r] for r in spoken], self._separator).tokens, h.finished,
                               h.route, h.stats)
            rows[i] = self._row(batch.utterances[i], h, seconds * d / total, batch.draft_model, duration=d)
            rows[i].language = decoded[rs[0]].language
            if self.options.timestamps != "none":
                rows[i].segments = clip_times([seg for r in spoken for seg in parse_segments(
                    hyps[r].tokens, self.target.timestamp_tokens, self.target.decode_text, batch.spans[r][0],
                    batch.spans[r][1] - batch.spans[r][0])], d)
                if decoded[rs[0]].words is not None:
                    rows[i].words = clip_times([w for r in spoken for w in decoded[r].words], d)
            elif self.options.segments:
                rows[i].segments = [{"start_s": batch.spans[r][0], "end_s": batch.spans[r][1],
                                     "text": self.target.decode_text(hyps[r].tokens)} for r in spoken]
        return rows

    def _words(self, batch: EncodedBatch, hyps: list[Hypothesis]) -> Optional[list[list[dict]]]:
        """With ``timestamps="word"``, per encoded row its words (one batched teacher-forced target pass)."""
        if self.options.timestamps != "word" or batch.encoded is None or not hyps:
            return None
        enc = batch.encoded.target.to(self.target.device, self.target.dtype)
        return word_timestamps(self.target, enc, [h.tokens for h in hyps], [a for a, _ in batch.spans],
                               batch.activity or None)

    def _no_speech(self, h: Hypothesis) -> bool:
        threshold = None if self.options.short_window_s else self.options.no_speech_threshold  # see DecodeOptions
        return threshold is not None and h.stats.no_speech_prob is not None and h.stats.no_speech_prob > threshold

    def _language(self, prompt: list[int]) -> Optional[str]:
        """The language code named in a decoder prompt (None for English-only models)."""
        codes = {i: c for c, i in self.target.languages.items()}
        return next((codes[t] for t in prompt if t in codes), None)

    @functools.cached_property
    def _separator(self) -> list[int]:
        """Token ids that join two segments' texts (a space)."""
        tok = self.target.tokenizer
        return tok(" ", add_special_tokens=False).input_ids if tok is not None else []

    def _row(self, u: Utterance, h: Optional[Hypothesis], seconds: float, draft_model: str, duration=None,
             error=None, code=None) -> ResultRow:
        row = ResultRow(
            id=u.id, corpus=u.corpus, audio=u.audio, reference=u.text,
            duration_s=duration if duration else u.duration_s,
            model=self.target.name, draft_model=draft_model, method=self.options.method,
            mode=self.options.mode, compute_type=self._compute_type, error=error, error_code=code, decode_s=seconds,
        )
        if h is not None:
            s = h.stats
            row.text = self.target.decode_text(h.tokens)
            row.route, row.num_tokens, row.finished = h.route, len(h.tokens), h.finished
            row.target_forward_passes, row.draft_forward_passes = s.target_forward_passes, s.draft_forward_passes
            row.draft_tokens_proposed, row.draft_tokens_accepted = s.draft_tokens_proposed, s.draft_tokens_accepted
            row.rounds, row.accepted_prefix, row.ctc_entropy = s.rounds, s.accepted_prefix, s.ctc_entropy
            row.no_speech_prob = s.no_speech_prob
            row.avg_logprob, row.temperature = s.avg_logprob, s.temperature
            row.compression_ratio = compression_ratio(row.text)
            row.repetitive = row.compression_ratio > self.options.compression_ratio_threshold
        return row


class Transcriber:
    """Drafting and target side in one process: transcribes batches of utterances.

    Args: as :class:`Drafter` (the target model is loaded once and shared by both sides).

    Attributes:
        part_rows: the default rows of a part of a batch (:meth:`Drafter.encode_parts`): as many of the target's
            windows as the default :class:`~rayspec.batching.BatchBudget` holds (whisper-base: 12).
    """

    def __init__(self, target: Optional[str] = None, draft: Optional[str] = None,
                 options: DecodeOptions = DecodeOptions(), ctc: Optional[str] = None, device: str = "cpu",
                 dtype: torch.dtype | str = torch.float32, limits: Optional[AudioLimits] = None,
                 encoder_dtype: Optional[torch.dtype] = None) -> None:
        self.drafter = Drafter(target, draft, options, ctc, device, dtype, limits, encoder_dtype)
        self.decoder = TargetDecoder(self.drafter.target, options)
        self.options = options
        self.part_rows = budget_rows(BatchBudget(), self.target)
        self.warm_up_s = self.warm_up() if self.target.device.type == "cuda" else 0.0

    def set_options(self, options: DecodeOptions) -> None:
        """Decode with ``options`` from now on (the Python call's per-call options, :mod:`rayspec.api`).

        Raises:
            ValueError: another method than the loaded one (its drafter is not loaded), or a language or task the
                target cannot take.
        """
        if options.method != self.options.method:
            raise ValueError(f"this model was loaded for method {self.options.method!r}, not {options.method!r}: "
                             "load it again with that method")
        self.target.prompt_for(None if options.language == "auto" else options.language, options.task,
                               options.timestamps != "none")  # checked
        self.options = self.drafter.options = self.decoder.options = options

    def warm_up(self, seconds: float = 1.0) -> float:
        """Decode ``seconds`` of noise with the configured method (no VAD), so that a GPU's one-time costs (CUDA
        context, cuBLAS handles and workspaces, kernel selection of the encoder's shapes) are paid at load, before
        the first job: Serve replicas and Ray actors built on a :class:`Transcriber` call it when they start (on a
        CUDA device; the static steps' graphs were captured by :class:`TargetDecoder` already). Returns wall s."""
        t0 = time.perf_counter()
        noise = 0.01 * np.random.default_rng(0).standard_normal(int(seconds * self.sample_rate)).astype(np.float32)
        decode_batch(self.target, replace(self.options, vad=False), [noise], [seconds], self.draft, self.ctc)
        return time.perf_counter() - t0

    @property
    def target(self) -> WhisperASR:
        return self.drafter.target

    @property
    def draft(self) -> Optional[WhisperASR]:
        return self.drafter.draft

    @property
    def ctc(self) -> Optional[CTCHead]:
        return self.drafter.ctc

    @property
    def limits(self) -> AudioLimits:
        return self.drafter.limits

    @property
    def sample_rate(self) -> int:
        return self.drafter.sample_rate

    def decode(self, audios: list[np.ndarray], durations: list[float]) -> tuple[list[Hypothesis], float]:
        """Decode a batch of waveforms with the configured method. Returns hypotheses and wall seconds."""
        t0 = time.perf_counter()
        hyps = decode_batch(self.target, self.options, audios, durations, self.draft, self.ctc)
        return hyps, time.perf_counter() - t0

    def transcribe(self, utterances: list[Utterance], audios: Optional[list[np.ndarray]] = None,
                   part_rows: Optional[int] = None) -> list[ResultRow]:
        """Transcribe one batch; every utterance yields exactly one row, whatever happens.

        Bad audio becomes an error row. If the batch as a whole raises (in feature extraction, an encoder or the
        decoder), each utterance is redone alone, so only one that also fails alone becomes an error row (code
        "internal", with the exception's type and message).

        Args:
            utterances: the batch; audios: their waveforms if already loaded (see :meth:`Drafter.encode`).
            part_rows: the rows of a batch longer than that (a long recording's windows) are encoded and decoded
                that many at a time (:meth:`Drafter.encode_parts`); default :attr:`part_rows`.
        """
        try:
            if self.options.long_form == "sequential":
                return self._sequential(utterances, audios)
            joiner = PartJoiner(self.decoder)
            for part in self.drafter.encode_parts(utterances, audios, part_rows or self.part_rows):
                proposers = self.drafter.proposers(part.encoded) if part.encoded and self.draft else None
                rows = joiner.add(0, part, *self.decoder.decode_part(part, proposers))
            return rows
        except Exception as exc:  # noqa: BLE001 - isolated below, row by row
            if len(utterances) == 1:
                return [internal_error_row(utterances[0], exc, self.options.method)]
            return [row for i, u in enumerate(utterances)
                    for row in self.transcribe([u], None if audios is None else [audios[i]], part_rows)]


    def _sequential(self, utterances: list[Utterance], audios: Optional[list[np.ndarray]]) -> list[ResultRow]:
        """:meth:`transcribe` with Whisper's sequential long-form algorithm (:func:`~rayspec.longform.decode_sequential`:
        every file's windows in one continuous batch); bad audio becomes an error row."""
        t0 = time.perf_counter()
        rate, dec = self.sample_rate, self.decoder
        name = self.draft.name if self.draft else ""
        rows: list[Optional[ResultRow]] = [None] * len(utterances)
        loaded, where = [], []
        for i, u in enumerate(utterances):
            try:
                loaded.append(load_audio(u.source, rate, self.limits) if audios is None else audios[i])
                where.append(i)
            except AudioError as exc:
                rows[i] = dec._row(u, None, 0.0, name, error=str(exc), code=exc.code)
        if loaded:
            def encode(options, waveforms, durations, keys):
                return encode_audio(self.target, options, waveforms, durations, self.draft, self.ctc, keys)

            def decode(options, encoded):
                proposers = self.drafter.proposers(encoded) if self.draft else None
                return decode_encoded(self.target, options, encoded, proposers)

            results = decode_sequential(self.target, self.options, loaded, len(loaded), encode, self.draft, decode,
                                        [utterances[i].id for i in where])
            seconds, total = time.perf_counter() - t0, sum(len(a) for a in loaded)
            for i, a, (h, segs) in zip(where, loaded, results):
                rows[i] = dec._row(utterances[i], h, seconds * len(a) / total, name, duration=len(a) / rate)
                rows[i].segments = clip_times(segs, len(a) / rate)
        return rows

    def transcribe_stream(self, batches: Iterable[Optional[tuple[list[Utterance], Optional[list[np.ndarray]]]]],
                          slots: int, part_rows: Optional[int] = None) -> Iterator[tuple[int, list[ResultRow]]]:
        """Transcribe batches with continuous batching: up to ``slots`` rows decode at once and the slot of a
        finished row is refilled from the next batch before the next decoder pass. Batches are encoded one at a
        time as their rows are needed, and a batch of more rows than ``part_rows`` (a long recording's windows) a
        part at a time (:meth:`Drafter.encode_parts`), so that its encoder states are never held all at once.

        Faults stay as isolated as in :meth:`transcribe`: a batch whose encoding raises is redone by
        :meth:`transcribe` at once (utterance by utterance if need be), and so is every unfinished batch when
        decoding raises.

        Args:
            batches: ``(utterances, waveforms or None)`` per batch (as :meth:`transcribe` takes them), read lazily;
                None for "nothing ready now" (an online queue: the stream then ends once nothing is decoding).
            slots: most rows decoded at once; part_rows: as :meth:`transcribe`'s.

        Yields:
            ``(k, rows)`` once per batch, ``k`` its position among the batches given (Nones not counted), as the
            batch's last row finishes (not in input order).
        """
        part_rows = part_rows or self.part_rows
        if self.options.long_form == "sequential":  # each batch's windows stream within decode_sequential
            k = 0
            for item in batches:
                if item is not None:
                    yield k, self.transcribe(*item)
                    k += 1
            return
        items: dict[int, tuple] = {}  # k -> the batch as given, while it decodes
        pending: dict[int, EncodedBatch] = {}  # k -> its encoded batch, filled by the target side's stream
        finished: list[tuple[int, list[ResultRow]]] = []  # batches redone by transcribe()
        static = [False]  # after a decoding failure: the remaining batches go through transcribe()

        def source():
            k = 0
            for item in batches:
                if item is None:
                    yield None
                    continue
                key, k = k, k + 1
                if static[0]:
                    finished.append((key, self.transcribe(*item, part_rows)))
                    continue
                try:
                    parts = self.drafter.encode_parts(*item, part_rows)
                    first = next(parts)
                except Exception:  # noqa: BLE001 - transcribe() isolates the failing utterance
                    finished.append((key, self.transcribe(*item, part_rows)))
                    continue
                items[key] = item
                yield key, first
                for eb in parts:  # encoded as the stream wants their rows (a part that raises: as decoding does)
                    yield key, eb

        rows = source()
        try:
            for k, batch_rows in self.decoder.decode_stream(rows, slots, self.draft, pending):
                items.pop(k, None)
                yield k, batch_rows
                while finished:
                    yield finished.pop()
        except Exception:  # noqa: BLE001 - the unfinished and the remaining batches are redone alone
            finished += [(k, self.transcribe(*items[k], part_rows)) for k in sorted(pending)]
            pending.clear()
            static[0] = True
            for item in rows:  # up to the first "nothing ready now" of an online source
                if item is None:
                    break
        yield from finished
