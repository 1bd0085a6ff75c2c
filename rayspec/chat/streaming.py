"""Streaming user input for voice chat: partial prompts from typed text or from audio transcribed as it grows."""

from __future__ import annotations

import time

import numpy as np

from ..manifest import Utterance


def text_partials(text: str, chars_per_minute: float = 600.0) -> list[tuple[float, str]]:
    """A typed/spoken text as partial prompts at word boundaries, arriving at ``chars_per_minute`` (the paper's
    600 characters per minute, ~120 words per minute). Returns ``(arrival_s, prefix)``; the last is the whole text.

    Raises:
        ValueError: empty text or a non-positive rate.
    """
    if not text.strip() or chars_per_minute <= 0:
        raise ValueError("text_partials needs text and a positive rate")
    out, pos = [], 0
    words = text.split(" ")
    for w in range(1, len(words) + 1):
        prefix = " ".join(words[:w])
        pos = len(prefix)
        if prefix.strip():
            out.append((pos * 60.0 / chars_per_minute, prefix))
    return out


def audio_partials(transcriber, audio: np.ndarray, sample_rate: int, chunk_s: float = 0.5,
                   clock=time.perf_counter) -> list[tuple[float, str]]:
    """Partial transcripts of speech arriving in real time, from rayspec's ASR re-decoding the growing audio prefix
    after every ``chunk_s`` seconds (streaming by re-decoding: a later partial may correct an earlier one, as
    streaming recognisers do). A prefix longer than the model's window is segmented and re-joined, as in jobs.

    Args:
        transcriber: a :class:`~rayspec.pipeline.Transcriber`.
        audio: float32 ``[S]`` mono speech at ``sample_rate`` Hz (the transcriber's rate).
        chunk_s: seconds of audio between partials.

    Returns:
        ``(arrival_s, text)`` per chunk: a partial arrives when its audio has arrived and its decode has finished
        (decodes run one at a time; the ASR runs beside the LLM, as a separate actor would). The last is the
        final transcript of the whole audio.

    Raises:
        ValueError: empty audio or a non-positive chunk; RuntimeError: the ASR failed on a prefix.
    """
    if audio.size == 0 or chunk_s <= 0:
        raise ValueError("audio_partials needs audio and a positive chunk length")
    total = audio.size / sample_rate
    ends = list(np.arange(chunk_s, total, chunk_s)) + [total]
    out, free = [], 0.0
    for end in ends:
        start = max(end, free)
        t0 = clock()
        prefix = audio[: int(round(end * sample_rate))]
        row = transcriber.transcribe([Utterance("partial", "")], [prefix])[0]
        if row.error:  # the ASR failed (transcribe turns failures into rows): not the same as hearing nothing
            raise RuntimeError(f"ASR failed on the partial input: {row.error}")
        text = row.text.strip()
        free = start + clock() - t0
        if text or end == total:
            out.append((free, text))
    return out
