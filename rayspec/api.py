"""One call from Python: ``rayspec.load(...)`` then ``model.transcribe(...)``.

    import rayspec

    model = rayspec.load("whisper-base", method="draft")
    result = model.transcribe("talk.m4a", timestamps="word")
    print(result.text)
    for word in result.words:
        print(f"{word.start:6.2f} {word.end:6.2f} {word.word}")

The options are ``rayspec transcribe``'s decoding options, under the same names with underscores (``method``,
``timestamps``, ``language``, ``tau_ctc``, ...: :func:`rayspec.options.decode_option_names`), checked and typed once
here; the model options are :func:`load`'s arguments. A list of paths or arrays is batched (length-sorted, continuous
batching), as ``rayspec transcribe`` batches a corpus.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Optional, Sequence, Union

import numpy as np

Audio = Union[str, os.PathLike, np.ndarray]
"""A file path (any format the installed decoders read: WAV/FLAC/OGG/MP3, and with ``rayspec[media]`` everything
FFmpeg reads) or a mono float waveform at 16 kHz (``[T]`` float32, -1..1)."""


@dataclass(frozen=True)
class Segment:
    """A timed stretch of the transcript: seconds from the start of the audio."""

    start: float
    end: float
    text: str


@dataclass(frozen=True)
class Word:
    """A word with its start and end (seconds) and the target's probability of its tokens."""

    word: str
    start: float
    end: float
    probability: float


@dataclass(frozen=True)
class Transcription:
    """One input's result. ``segments`` are filled with ``timestamps="segment"`` or ``"word"`` (else empty), ``words``
    with ``timestamps="word"``; ``route`` says how
    it was decoded (``no_speech`` for audio without speech); ``error`` is set (and ``text`` empty) for an input that
    could not be read or decoded, as a job's error row."""

    text: str
    segments: list = field(default_factory=list)
    words: list = field(default_factory=list)
    language: Optional[str] = None
    duration: Optional[float] = None
    route: str = ""
    compute_type: str = ""
    error: Optional[str] = None


class Model:
    """A loaded target with its drafter, ready to transcribe (see :func:`load`)."""

    def __init__(self, transcriber, options: dict) -> None:
        self.transcriber = transcriber
        self._options = options

    @property
    def compute_type(self) -> str:
        """The compute type the model runs in (``float32``, ``bfloat16``, ``float16``, ``int8``)."""
        from .compute import label

        return label(self.transcriber.target.dtype, int8=self.transcriber.target.int8)

    def transcribe(self, audio: Union[Audio, Sequence[Audio]], **options) -> Union[Transcription,
                                                                                      list[Transcription]]:
        """Transcribe one input (returns a :class:`Transcription`) or a list of them (returns a list, in input order,
        decoded in batches).

        Args:
            audio: a path or a 16 kHz mono float waveform, or a list of them (:data:`Audio`).
            options: decoding options for this call, overriding :func:`load`'s (``timestamps``, ``language``, ...;
                the method is :func:`load`'s).

        Raises:
            ValueError: an unknown option, one of the wrong type, or another method than the loaded one.
        """
        from .batching import BatchBudget, budget_for_model, plan_batches
        from .manifest import Utterance, estimated_seconds
        from .options import decode_options_from
        from .runs import stream_slots

        single = isinstance(audio, (str, os.PathLike, np.ndarray))
        items = [audio] if single else list(audio)
        if not items:
            return []
        t = self.transcriber
        saved = t.options
        t.set_options(decode_options_from({**self._options, **options}))
        try:
            utts, waves = [], []
            for i, a in enumerate(items):
                if isinstance(a, np.ndarray):
                    wave = np.asarray(a, dtype=np.float32).reshape(-1)
                    utts.append(Utterance(f"{i}", f"<array {i}>", duration_s=len(wave) / t.target.sample_rate))
                    waves.append(wave)
                else:
                    utts.append(Utterance(f"{i}", os.path.abspath(os.fspath(a))))
                    waves.append(None)
            budget = budget_for_model(BatchBudget(), t.target.config)
            batches = plan_batches(list(range(len(items))), [estimated_seconds(u) for u in utts], budget)
            given = []
            for b in batches:  # waveforms go with a batch of arrays; a batch of paths reads its files itself
                arrays = [i for i in b if waves[i] is not None]
                paths = [i for i in b if waves[i] is None]
                given += [([utts[i] for i in arrays], [waves[i] for i in arrays])] if arrays else []
                given += [([utts[i] for i in paths], None)] if paths else []
            rows = {}
            # longest first, as rayspec transcribe: later rows are shorter and fit the first rows' cache
            slots = stream_slots([[utts[i] for i in b] for b in batches], t.part_rows, t.target.max_audio_seconds)
            for _, out in t.transcribe_stream(iter(given[::-1]), slots):
                rows.update({r.id: r for r in out})
        finally:
            t.set_options(saved)
        results = [_transcription(rows[f"{i}"]) for i in range(len(items))]
        return results[0] if single else results


def _transcription(row) -> Transcription:
    segments = [Segment(s["start_s"], s["end_s"], s["text"]) for s in row.segments or []]
    words = [Word(w["word"], w["start_s"], w["end_s"], w["probability"]) for w in row.words or []]
    return Transcription(row.text, segments, words, row.language, row.duration_s, row.route, row.compute_type,
                         row.error)


def load(model: str = "whisper-base", method: str = "auto", *, draft: Optional[str] = None, ctc: Optional[str] = None,
         device: str = "cpu", compute_type: Optional[str] = None, threads: int = 0, **options) -> Model:
    """Load a target (and the drafter its ``method`` needs) for :meth:`Model.transcribe`.

    Args:
        model: an installed model's name (``whisper-base``, ``whisper-tiny.en``) or a Whisper checkpoint directory
            (transformers ``save_pretrained``, or CTranslate2 / faster-whisper: converted once, cached).
        method: ``auto`` (default: ``ctc-draft`` where the target has a CTC head and the speech is English, else
            ``ar``; ``ar``'s transcripts, in float32 and bfloat16 alike: see
            :func:`rayspec.options.resolve_method`), ``ar``, ``draft``, ``ctc-draft``, ``medusa`` or ``ssd``
            (``rayspec transcribe --method``).
        draft, ctc: drafter directories (default: those bundled for the target).
        device: ``cpu``, ``cuda``, ``cuda:1``; compute_type: ``auto`` (default: the fastest the hardware runs
            natively, :mod:`rayspec.compute`), ``float32`` (the exact reference), ``bfloat16``, ``float16``.
        threads: torch CPU threads (0: torch's default).
        options: any decoding option of ``rayspec transcribe`` (``timestamps="word"``, ``language="auto"``,
            ``speculate_max_rows="all"``, ...).

    Raises:
        ModelLoadError: an unknown model or a missing / broken checkpoint.
        ValueError: an unknown option, or a value of the wrong type.
    """
    import torch

    from .compute import resolve
    from .options import decode_options_from
    from .pipeline import Transcriber

    decode = decode_options_from({"method": method, "ctc": ctc, **options}, model)  # checked before anything loads
    opts = {**options, "method": decode.method}
    if threads:
        torch.set_num_threads(threads)
    transcriber = Transcriber(model, draft, decode, ctc, device, resolve(compute_type, device).name)
    return Model(transcriber, opts)
