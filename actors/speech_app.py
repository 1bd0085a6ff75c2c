"""The speech-synthesis Serve deployment behind ``POST /v1/audio/speech`` (OpenAI-compatible).

The HTTP routes live on the transcription ingress (``actors/serve_app.py``), which validates a request and calls this
deployment through a handle (Serve model composition), so synthesis scales with its own replicas and resources.
Whole-text requests are batched across concurrent callers with ``@serve.batch`` (their sentences share target
passes); streamed requests synthesise sentence by sentence and yield each sentence's audio as soon as its frames
are accepted and decoded (time to first audio = the first sentence, not the whole text).
"""

from __future__ import annotations

import asyncio
import base64
import functools
import json
import struct
from concurrent.futures import ThreadPoolExecutor
from typing import AsyncIterator

from ray import serve

VOICES = ("joe",)  # the bundled zoo's one voice, distilled from the Piper voice en_US-joe-medium
OPENAI_VOICES = ("alloy", "ash", "ballad", "coral", "echo", "fable", "nova", "onyx", "sage", "shimmer", "verse")
MODEL_NAMES = ("rayspec-tts", "tts-1", "tts-1-hd", "gpt-4o-mini-tts")
STREAMABLE = ("pcm", "wav", "mp3")  # formats whose chunks concatenate into one playable stream
MEDIA_TYPES = {"wav": "audio/wav", "flac": "audio/flac", "mp3": "audio/mpeg", "opus": "audio/ogg",
               "pcm": "audio/pcm"}


def streaming_wav_header(sample_rate: int) -> bytes:
    """A 16-bit mono WAV header with unknown length (0xFFFFFFFF sizes), as streaming servers send before PCM."""
    return (b"RIFF" + struct.pack("<I", 0xFFFFFFFF) + b"WAVEfmt " + struct.pack("<IHHIIHH", 16, 1, 1, sample_rate,
                                                                                2 * sample_rate, 2, 16)
            + b"data" + struct.pack("<I", 0xFFFFFFFF))


def sse_event(kind: str, payload: dict) -> bytes:
    """One server-sent event ``data: {"type": kind, ...}``."""
    return f"data: {json.dumps({'type': kind, **payload})}\n\n".encode()


@serve.deployment(max_ongoing_requests=64)
class SpeechService:
    """A replica hosting one :class:`rayspec.tts.synthesis.Synthesizer`.

    The models load and every synthesis runs on one thread of the replica's own (one-worker executor), so torch has
    one OpenMP team here (see :class:`rayspec.engine.TranscriptionEngine` for what a second team cost the ASR
    replica); concurrent requests take turns on it (whole texts batched by ``@serve.batch``).

    Args:
        models: ``{"target", "draft", "codec"}`` directories (None: the bundled zoo); sampling: keyword arguments of
            :class:`rayspec.tts.flags.SamplingOptions`; max_batch_size: texts synthesised together;
            threads: torch CPU threads (0 = default).
    """

    def __init__(self, models: dict, sampling: dict, max_batch_size: int = 8, threads: int = 0) -> None:
        from rayspec.tts.flags import SamplingOptions
        from rayspec.tts.synthesis import Synthesizer

        self._torch = ThreadPoolExecutor(1, thread_name_prefix="rayspec-tts")
        self.synth = self._torch.submit(Synthesizer, models.get("target"), models.get("draft"), models.get("codec"),
                                        threads=threads or None).result()
        self.opts = SamplingOptions(**sampling)
        self._batched.set_max_batch_size(max_batch_size)

    async def _run(self, fn, *args):
        """``fn(*args)`` on the replica's torch thread."""
        return await asyncio.get_running_loop().run_in_executor(self._torch, functools.partial(fn, *args))

    def info(self) -> dict:
        return {"method": self.opts.method, "model": self.synth.target_dir, "sample_rate": 16000}

    @serve.batch(max_batch_size=8, batch_wait_timeout_s=0.02)
    async def _batched(self, requests: list) -> list:
        """``(text, speed, seed)`` per request -> ``(audio, stats)``; texts with the same speed share batches. A
        request's draws depend on its seed only (not on its batch-mates)."""
        out: list = [None] * len(requests)
        for speed in {r[1] for r in requests}:
            idx = [i for i, r in enumerate(requests) if r[1] == speed]
            results = await self._run(self.synth.synthesize, [requests[i][0] for i in idx], self.opts, 0,
                                      [str(requests[i][2]) for i in idx], speed)
            for i, res in zip(idx, results):
                out[i] = (res.audio, _stats(res, len(idx)))
        return out

    async def synthesize(self, text: str, speed: float, fmt: str, seed: int = 0) -> tuple[bytes, dict]:
        """The whole text's audio as ``fmt`` bytes, and its counts."""
        from rayspec.tts.synthesis import encode_audio

        audio, stats = await self._batched((text, speed, seed))
        return encode_audio(audio, fmt), stats

    async def stream(self, text: str, speed: float, fmt: str, sse: bool, seed: int = 0) -> AsyncIterator[bytes]:
        """Audio as it is made, in chunks of 0.2 s (:meth:`rayspec.tts.synthesis.Synthesizer.stream`): ``fmt`` chunks
        (a streaming WAV header first), or server-sent events ``speech.audio.delta`` {audio: base64 16-bit PCM} then
        ``speech.audio.done`` {usage}. The audio is what the whole-text request with the same seed returns."""
        from rayspec.tts.synthesis import encode_audio

        if fmt == "wav" and not sse:
            yield streaming_wav_header(16000)
        loop = asyncio.get_running_loop()
        chunks: asyncio.Queue = asyncio.Queue()
        job = asyncio.ensure_future(self._run(
            self.synth.stream, text, lambda a: loop.call_soon_threadsafe(chunks.put_nowait, a), self.opts, 0,
            str(seed), speed))
        job.add_done_callback(lambda _: chunks.put_nowait(None))  # runs on the loop, after every chunk
        while (audio := await chunks.get()) is not None:
            if sse:
                yield sse_event("speech.audio.delta", {"audio": base64.b64encode(encode_audio(audio, "pcm")).decode()})
            else:
                yield encode_audio(audio, "pcm" if fmt == "wav" else fmt)
        res = await job  # raises what the synthesis raised
        if sse:
            yield sse_event("speech.audio.done", {"usage": {"input_characters": len(text), "audio_frames": res.frames,
                                                            "target_forward_passes": res.target_passes}})


def _stats(res, batch_size: int) -> dict:
    return {"duration_s": round(res.duration_s, 3), "frames": res.frames, "target_forward_passes": res.target_passes,
            "draft_tokens_proposed": res.draft_proposed, "draft_tokens_accepted": res.draft_accepted,
            "batch_size": batch_size}
