"""Ray-free corpus transcription: audio -> batches -> a decoder method -> result rows.

:class:`Transcriber` holds the models once and transcribes one batch of utterances at a time; the CLI runs it
in-process, and the Ray actors in ``actors/`` host it. A bad file never fails a batch: it becomes one row with
``error`` set and empty text.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from importlib import resources
from typing import Callable, Iterable, Optional

import numpy as np
import torch

from .audio import AudioError, AudioLimits, load_audio
from .batching import BatchBudget, plan_batches
from .decoding.common import DEFAULT_MAX_TOKENS_PER_SECOND, Hypothesis, token_cap
from .manifest import Utterance
from .models.whisper import WhisperASR
from .results import ResultRow, ResultWriter

METHODS = ("ar", "draft", "ssd")


def zoo_path(name: str) -> str:
    """Directory of a bundled zoo model ("target", "draft" or "ctc")."""
    return str(resources.files("rayspec").joinpath("zoo", name))


@dataclass
class DecodeOptions:
    """What decoder to run and how (see ``rayspec transcribe --help``).

    Attributes:
        method: "ar" (target greedy), "draft" (draft-model speculative decoding, exact) or "ssd" (CTC gating,
            verification and fallback; exact only with ``ssd.exact`` and the gate off).
        max_tokens_per_second: cap on generated tokens per second of audio (against runaway repetition).
        speculation: options of the draft method (:class:`~rayspec.decoding.speculative.SpeculationOptions`).
        ssd: options of the ssd method (:class:`~rayspec.decoding.ssd.SSDOptions`).
    """

    method: str = "ar"
    max_tokens_per_second: float = DEFAULT_MAX_TOKENS_PER_SECOND
    speculation: Optional[object] = None
    ssd: Optional[object] = None

    @property
    def mode(self) -> str:
        """"exact" when the output is provably the target's greedy output, else "lossy"."""
        if self.method == "ssd" and self.ssd is not None and not (self.ssd.exact and self.ssd.tau_ctc <= 0):
            return "lossy"
        return "exact"


@dataclass
class LoadedAudio:
    utterance: Utterance
    audio: Optional[np.ndarray] = None
    error: Optional[str] = None


class Transcriber:
    """Transcribes batches of utterances with a target (and optionally a draft) model.

    Args:
        target: target model directory (default: the zoo target).
        draft: draft model directory, needed by ``method="draft"`` and the ssd draft fallback (default: the zoo
            draft).
        ctc: CTC head directory for ``method="ssd"`` (default: the zoo CTC head).
        options: decoder choice and options.
        device: torch device string; dtype: model dtype (fp32 is the exact reference on CPU).
        limits: audio byte/duration limits.

    Raises:
        ValueError: unknown method.
        ModelLoadError: a model directory that cannot be loaded.
    """

    def __init__(
        self,
        target: Optional[str] = None,
        draft: Optional[str] = None,
        options: DecodeOptions = DecodeOptions(),
        ctc: Optional[str] = None,
        device: str = "cpu",
        dtype: torch.dtype = torch.float32,
        limits: Optional[AudioLimits] = None,
    ) -> None:
        if options.method not in METHODS:
            raise ValueError(f"unknown method {options.method!r}; choose from {', '.join(METHODS)}")
        self.options = options
        self.target = WhisperASR.from_pretrained(target or zoo_path("target"), device, dtype)
        self.draft = self.ctc = None
        if options.method == "ssd":
            from .decoding.ssd import SSDOptions
            from .models.ctc import CTCHead

            options.ssd = options.ssd or SSDOptions()
            self.ctc = CTCHead.from_pretrained(ctc or zoo_path("ctc"), device).to(dtype)
        if options.method == "draft" or (options.method == "ssd" and options.ssd.fallback == "draft"):
            self.draft = WhisperASR.from_pretrained(draft or zoo_path("draft"), device, dtype)
        self.limits = limits or AudioLimits(max_seconds=self.target.max_audio_seconds)

    @property
    def sample_rate(self) -> int:
        return self.target.sample_rate

    def load(self, utterance: Utterance) -> LoadedAudio:
        """Decode one utterance's audio; failures are returned as ``error`` instead of raised."""
        try:
            return LoadedAudio(utterance, load_audio(utterance.audio, self.sample_rate, self.limits))
        except AudioError as exc:
            return LoadedAudio(utterance, error=str(exc))

    def decode(self, audios: list[np.ndarray], durations: list[float]) -> tuple[list[Hypothesis], float]:
        """Decode a batch of waveforms with the configured method. Returns hypotheses and wall seconds."""
        t0 = time.perf_counter()
        hyps = decode_batch(self.target, self.options, audios, durations, self.draft, self.ctc)
        return hyps, time.perf_counter() - t0

    def transcribe(self, utterances: list[Utterance]) -> list[ResultRow]:
        """Transcribe one batch; every utterance yields exactly one row (bad audio -> ``error`` row)."""
        loaded = [self.load(u) for u in utterances]
        good = [x for x in loaded if x.audio is not None]
        rows: dict[str, ResultRow] = {}
        for x in loaded:
            if x.error is not None:
                rows[x.utterance.id] = self._row(x.utterance, None, 0.0, error=x.error)
        if good:
            durations = [len(x.audio) / self.sample_rate for x in good]
            try:
                hyps, seconds = self.decode([x.audio for x in good], durations)
            except ValueError as exc:  # e.g. audio longer than the model's window
                for x in good:
                    rows[x.utterance.id] = self._row(x.utterance, None, 0.0, error=str(exc))
            else:
                total = sum(durations) or 1.0
                for x, h, d in zip(good, hyps, durations):
                    rows[x.utterance.id] = self._row(x.utterance, h, seconds * d / total, duration=d)
        return [rows[u.id] for u in utterances]

    def _row(self, u: Utterance, h: Optional[Hypothesis], seconds: float, duration=None, error=None) -> ResultRow:
        row = ResultRow(
            id=u.id, corpus=u.corpus, audio=u.audio, reference=u.text, duration_s=duration if duration else u.duration_s,
            model=self.target.name, draft_model=self.draft.name if self.draft else "", method=self.options.method,
            mode=self.options.mode, error=error, decode_s=seconds,
        )
        if h is not None:
            s = h.stats
            row.text = self.target.decode_text(h.tokens)
            row.route, row.num_tokens, row.finished = h.route, len(h.tokens), h.finished
            row.target_forward_passes, row.draft_forward_passes = s.target_forward_passes, s.draft_forward_passes
            row.draft_tokens_proposed, row.draft_tokens_accepted = s.draft_tokens_proposed, s.draft_tokens_accepted
            row.rounds, row.accepted_prefix, row.ctc_entropy = s.rounds, s.accepted_prefix, s.ctc_entropy
        return row


@torch.inference_mode()
def decode_batch(
    target: WhisperASR, options: DecodeOptions, audios: list[np.ndarray], durations: list[float], draft=None, ctc=None
) -> list[Hypothesis]:
    """Features, encoders and the chosen decoder for one batch of waveforms (at the target's sample rate).

    Used by :class:`Transcriber` and ``rayspec bench`` alike, so benchmarks time exactly what jobs run.
    """
    feats, lengths = target.features(audios)
    enc = target.encode(feats, lengths)
    limit = target.max_target_positions - len(target.prompt_ids) - 1
    caps = [token_cap(d, options.max_tokens_per_second, limit) for d in durations]
    if options.method == "ar":
        from .decoding.ar import greedy_decode

        return greedy_decode(target, enc, caps)
    if options.method == "ssd":
        from .decoding.ssd import SSDDecoder

        # Gate + verify the batch; the rejected rows then form their own length-sorted batch (SSD 3.2).
        decoder = SSDDecoder(target, ctc, options.ssd, draft)
        hyps, parked = decoder.first_pass(enc, caps)
        if parked:
            parked.sort(key=lambda x: x.length)
            draft_enc = None
            if draft is not None:
                dfeats, dlengths = draft.features([audios[x.index] for x in parked])
                draft_enc = draft.encode(dfeats, dlengths)
            for x, h in zip(parked, decoder.fallback(parked, draft_enc)):
                hyps[x.index] = h
        return hyps
    from .decoding.speculative import SpeculationOptions, speculative_decode

    dfeats, dlengths = draft.features(audios)
    return speculative_decode(target, enc, draft, draft.encode(dfeats, dlengths), caps,
                              options.speculation or SpeculationOptions())


def estimated_seconds(u: Utterance) -> float:
    """Duration for length sorting: the manifest's, else estimated from the file size (16-bit 16 kHz mono)."""
    if u.duration_s:
        return float(u.duration_s)
    try:
        return os.path.getsize(u.audio) / 32000.0
    except OSError:
        return 0.0


def pending_batches(utterances: list[Utterance], writer: ResultWriter, budget: BatchBudget) -> list[list[Utterance]]:
    """Length-sorted token-budget batches of the utterances not yet in ``writer``'s output."""
    todo = [u for u in utterances if u.id not in writer.done_ids]
    return plan_batches(todo, [estimated_seconds(u) for u in todo], budget)


@dataclass
class RunSummary:
    """What a corpus run did: rows written this run, failures, audio seconds, wall seconds."""

    written: int = 0
    failed: int = 0
    skipped: int = 0
    audio_s: float = 0.0
    wall_s: float = 0.0
    failures: list = field(default_factory=list)

    @property
    def rtfx(self) -> float:
        return self.audio_s / self.wall_s if self.wall_s else 0.0

    def add(self, rows: Iterable[ResultRow]) -> None:
        for r in rows:
            self.written += 1
            if r.error:
                self.failed += 1
                self.failures.append((r.id, r.error))
            else:
                self.audio_s += r.duration_s or 0.0


def run_corpus(
    utterances: list[Utterance],
    transcriber: Transcriber,
    output: str,
    budget: BatchBudget = BatchBudget(),
    progress: Optional[Callable[[int], None]] = None,
) -> RunSummary:
    """Transcribe a corpus in-process into ``output`` (resuming), then merge the results file."""
    writer = ResultWriter(output)
    batches = pending_batches(utterances, writer, budget)
    summary = RunSummary(skipped=len(utterances) - sum(len(b) for b in batches))
    t0 = time.perf_counter()
    for batch in batches:
        rows = transcriber.transcribe(batch)
        writer.write(rows)
        summary.add(rows)
        if progress:
            progress(len(batch))
    summary.wall_s = time.perf_counter() - t0
    writer.finalize()
    return summary
