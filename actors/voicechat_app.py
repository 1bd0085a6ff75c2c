"""Voice chat on Ray Serve: a WebSocket session (``/v1/realtime``) over ASR, LLM and TTS deployments, with
input-time speculation (PredGen, ``rayspec.chat.predgen``).

The three stages are separate deployments so they overlap: the ingress's own transcriber (batched with the
transcription endpoint's requests) turns streamed audio into partial transcripts, :class:`ChatLLM` verifies and
extends candidate replies while the user is still speaking, :class:`ChatVoice` pre-synthesises the candidate's first
sentence. When the turn ends, one verification decides whether that audio plays at once.

Event protocol (JSON text frames; names after OpenAI's Realtime API, ``input_text.*`` is rayspec's own):

client -> server
    ``session.update`` {session: {verifier, top_k, max_wasted_tokens, max_reply_tokens}}
    ``input_text.append`` {delta}: more typed/streamed text of the user's turn
    ``input_audio_buffer.append`` {audio}: base64 16-bit little-endian mono PCM at 16 kHz
    ``input_text.commit`` / ``input_audio_buffer.commit``: the user's turn is complete
server -> client
    ``session.created`` / ``session.updated`` {session}
    ``conversation.item.input_audio_transcription.delta`` {transcript}: a partial transcript (may revise earlier ones)
    ``conversation.item.input_audio_transcription.completed`` {transcript}
    ``response.created``; ``response.text.delta`` {delta}; ``response.audio.delta`` {audio: base64 16-bit PCM,
    sample_rate}; ``response.text.done`` {text}; ``response.audio.done``
    ``response.done`` {usage: audio_latency_s, ttfs_s, outcome, nfe_to_first_sentence, accepted_tokens,
    wasted_tokens}
    ``error`` {error: {type, code, message}}: a bad event is answered with this and the session goes on
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import itertools
import json
import threading
import time
from typing import Optional

import numpy as np
from ray import serve

SESSION_FIELDS = {"verifier": str, "top_k": int, "max_wasted_tokens": int, "max_reply_tokens": int,
                  "candidate_tokens": int}
ASR_SAMPLE_RATE = 16000
ASR_CHUNK_S = 0.5
MAX_TURN_CHARS = 4096


@serve.deployment(max_ongoing_requests=64)
class ChatLLM:
    """The LLM stage: one LLM engine (transformers in-process, or vLLM in its own environment's interpreter,
    ``backend="vllm"``) and a :class:`~rayspec.chat.predgen.PredGenEngine` per
    open turn. Calls run one at a time (one KV cache); turns share the cache as a prefix cache."""

    def __init__(self, lm_dir: Optional[str] = None, threads: int = 1, backend: str = "transformers",
                 vllm_python: Optional[str] = None) -> None:
        import torch

        from rayspec.chat.commands import DEFAULT_VLLM_PYTHON, load_lm

        torch.set_num_threads(max(1, threads))
        self.lm = load_lm(lm_dir, backend, vllm_python or DEFAULT_VLLM_PYTHON)  # vllm: its own interpreter
        self.turns: dict = {}
        self.lock = threading.Lock()

    def start(self, turn: str, options: dict) -> None:
        from rayspec.chat.predgen import PredGenEngine, PredGenOptions

        with self.lock:
            self.turns[turn] = PredGenEngine(self.lm, PredGenOptions(**options))

    def speculate(self, turn: str, text: str) -> Optional[str]:
        with self.lock:
            return self.turns[turn].speculate(text)

    def finish(self, turn: str, text: str) -> dict:
        with self.lock:
            first = self.turns[turn].finish(text)
            return {"text": first.text, "outcome": first.outcome, "accepted_tokens": first.accepted_tokens,
                    "nfe": first.nfe}

    def complete(self, turn: str) -> tuple[str, int]:
        """The whole reply text and the turn's wasted tokens; the turn is closed."""
        with self.lock:
            engine = self.turns.pop(turn)
            return self.lm.decode(engine.complete()), engine.wasted_tokens

    def end(self, turn: str) -> None:
        with self.lock:
            self.turns.pop(turn, None)


@serve.deployment(max_ongoing_requests=64)
class ChatVoice:
    """The TTS stage: ``piper``, ``rayspec`` or ``espeak`` (:func:`rayspec.chat.voices.load_voice`)."""

    def __init__(self, backend: str = "piper") -> None:
        from rayspec.chat.voices import load_voice

        self.voice = load_voice(backend)
        self.lock = threading.Lock()

    def synthesize(self, text: str) -> tuple[bytes, int]:
        """16-bit PCM of one sentence and its sample rate (Hz)."""
        with self.lock:
            audio = self.voice.synthesize(text)
        return (np.clip(audio, -1, 1) * 32767).astype("<i2").tobytes(), self.voice.sample_rate


def event(kind: str, **payload) -> str:
    return json.dumps({"type": kind, **payload})


def error_event(code: str, message: str, kind: str = "invalid_request_error") -> str:
    return event("error", error={"type": kind, "code": code, "message": message})


class RealtimeSession:
    """One WebSocket voice session (see the module docstring). ``transcribe`` is an async ``audio -> text``."""

    _ids = itertools.count()

    def __init__(self, ws, llm, voice, transcribe) -> None:
        self.ws, self.llm, self.voice, self.transcribe = ws, llm, voice, transcribe
        self.options: dict = {}
        self._new_turn()

    def _new_turn(self) -> None:
        for task in (getattr(self, "worker", None), getattr(self, "asr_task", None)):
            if task is not None and not task.done():
                task.cancel()  # nothing of the last turn may touch the next one
        self.turn: Optional[str] = None
        self.text = ""
        self.audio = np.zeros(0, np.float32)
        self.transcript = ""
        self.asr_upto = 0
        self.changed = asyncio.Event()
        self.worker: Optional[asyncio.Task] = None
        self.closing = False
        self.asr_task: Optional[asyncio.Task] = None
        self.presynth: dict = {}  # sentence -> task of its pre-synthesis (started ones)
        self.pending: Optional[str] = None  # the newest sentence waiting for the TTS stage (latest wins)
        self.tts_busy = False

    async def send(self, text: str) -> None:
        await self.ws.send_text(text)

    async def run(self) -> None:
        from starlette.websockets import WebSocketDisconnect

        await self.send(event("session.created", session=self.options))
        try:
            while True:
                raw = await self.ws.receive_text()
                try:
                    msg = json.loads(raw)
                    kind = msg["type"]
                except (ValueError, KeyError, TypeError):
                    await self.send(error_event("invalid_json", "events are JSON objects with a 'type'"))
                    continue
                await self.handle(kind, msg)
        except WebSocketDisconnect:
            pass
        finally:
            await self._abandon()

    async def handle(self, kind: str, msg: dict) -> None:
        if kind == "session.update":
            given = msg.get("session") if isinstance(msg.get("session"), dict) else {}
            bad = sorted(set(given) - set(SESSION_FIELDS))
            if bad:
                return await self.send(error_event("unknown_parameter", f"unknown session fields {bad}"))
            try:
                from rayspec.chat.predgen import PredGenOptions

                options = {k: SESSION_FIELDS[k](v) for k, v in given.items()}
                PredGenOptions(**options)
            except (TypeError, ValueError) as exc:
                return await self.send(error_event("invalid_value", str(exc)))
            self.options.update(options)
            return await self.send(event("session.updated", session=self.options))
        if kind == "input_text.append":
            delta = msg.get("delta")
            if not isinstance(delta, str):
                return await self.send(error_event("invalid_value", "input_text.append needs a string 'delta'"))
            if len(self.text) + len(delta) > MAX_TURN_CHARS:
                return await self.send(error_event("text_too_long", f"a turn holds at most {MAX_TURN_CHARS} "
                                                                    "characters"))
            await self._ensure_turn()
            self.text += delta
            self.changed.set()
            return None
        if kind == "input_audio_buffer.append":
            try:
                pcm = base64.b64decode(msg.get("audio", ""), validate=True)
            except (binascii.Error, TypeError):
                return await self.send(error_event("invalid_audio", "audio must be base64 16-bit PCM"))
            if len(pcm) % 2:
                return await self.send(error_event("invalid_audio", "16-bit PCM needs an even number of bytes"))
            await self._ensure_turn()
            self.audio = np.concatenate([self.audio, np.frombuffer(pcm, "<i2").astype(np.float32) / 32768.0])
            if self.audio.size - self.asr_upto >= ASR_CHUNK_S * ASR_SAMPLE_RATE and (
                    self.asr_task is None or self.asr_task.done()):
                self.asr_upto = self.audio.size
                self.asr_task = asyncio.create_task(self._partial_transcript(self.audio.copy()))
            return None
        if kind in ("input_text.commit", "input_audio_buffer.commit"):
            if self.turn is None:
                return await self.send(error_event("empty_turn", "nothing to commit: append input first"))
            return await self._respond(audio=kind == "input_audio_buffer.commit")
        return await self.send(error_event("unknown_event", f"unknown event type {kind!r}"))

    async def _ensure_turn(self) -> None:
        if self.turn is None:
            self.turn = f"turn-{next(self._ids)}-{id(self)}"
            await self.llm.start.remote(self.turn, self.options)
            self.worker = asyncio.create_task(self._speculate())

    def _input(self) -> str:
        return self.transcript if self.audio.size else self.text

    async def _partial_transcript(self, audio: np.ndarray) -> None:
        text = await self.transcribe(audio)
        if text and text != self.transcript:
            self.transcript = text
            await self.send(event("conversation.item.input_audio_transcription.delta", transcript=text))
            self.changed.set()

    async def _speculate(self) -> None:
        """While the user speaks: on each new input, verify/extend the candidate and pre-synthesise its first
        sentence (older inputs that arrived meanwhile are skipped)."""
        while True:
            await self.changed.wait()
            self.changed.clear()
            if self.closing:
                return
            text = self._input().strip()
            if not text:
                continue
            first = await self.llm.speculate.remote(self.turn, text)
            if first and first not in self.presynth:
                if self.tts_busy:
                    self.pending = first  # replaces an older sentence that has not started
                else:
                    self._start_tts(first)

    def _start_tts(self, sentence: str) -> None:
        """Pre-synthesise ``sentence``; one at a time, the newest pending sentence next."""
        self.tts_busy = True
        self.presynth[sentence] = asyncio.create_task(self._tts_job(sentence, self.turn))

    async def _tts_job(self, sentence: str, turn: Optional[str]):
        try:
            return await self.voice.synthesize.remote(sentence)
        finally:
            self.tts_busy = False
            nxt, self.pending = self.pending, None
            if nxt is not None and self.turn == turn and not self.closing:
                self._start_tts(nxt)

    async def _respond(self, audio: bool) -> None:
        """The end of the user's turn: reply, or an ``error`` event if any stage fails (the session goes on)."""
        t_commit = time.perf_counter()  # latencies count from here: waiting on speculation and ASR included
        turn = self.turn
        try:
            await self._reply(audio, t_commit)
        except Exception as exc:  # noqa: BLE001 - one failed turn is one error event, never a dead session
            await self.llm.end.remote(turn)
            self._new_turn()
            await self.send(error_event("turn_failed", f"{type(exc).__name__}: {exc}", "server_error"))

    async def _reply(self, audio: bool, t0: float) -> None:
        worker, self.worker = self.worker, None
        if worker is not None:  # let a running speculation step finish (and its audio start), then stop
            self.closing = True
            self.changed.set()
            await asyncio.gather(worker, return_exceptions=True)
        if self.asr_task is not None:
            if audio:
                await asyncio.gather(self.asr_task, return_exceptions=True)
            else:
                self.asr_task.cancel()
        if audio:
            self.transcript = await self.transcribe(self.audio) if self.audio.size else ""
            await self.send(event("conversation.item.input_audio_transcription.completed",
                                  transcript=self.transcript))
        final = self._input().strip()
        turn, presynth = self.turn, self.presynth
        self.pending = None
        if not final:
            await self.llm.end.remote(turn)
            self._new_turn()
            return await self.send(error_event("empty_turn", "no words in the turn (silence or empty text)"))
        first = await self.llm.finish.remote(turn, final)
        ttfs = time.perf_counter() - t0
        await self.send(event("response.created"))
        pcm = None
        if first["text"] in presynth:  # this exact sentence was pre-synthesised (never a rejected candidate's)
            try:
                pcm, sr = await presynth[first["text"]]
            except Exception:  # noqa: BLE001 - a failed pre-synthesis is redone below
                pcm = None
        if pcm is None:
            pcm, sr = await self.voice.synthesize.remote(first["text"]) if first["text"] else (b"", 16000)
        latency = time.perf_counter() - t0
        await self.send(event("response.text.delta", delta=first["text"]))
        await self.send(event("response.audio.delta", audio=base64.b64encode(pcm).decode(), sample_rate=sr))
        reply, wasted = await self.llm.complete.remote(turn)
        rest = reply[len(first["text"]):].strip() if reply.startswith(first["text"]) else ""
        from rayspec.tts.phones import split_sentences

        for sentence in split_sentences(rest) if rest else []:
            await self.send(event("response.text.delta", delta=" " + sentence))
            pcm, sr = await self.voice.synthesize.remote(sentence)
            await self.send(event("response.audio.delta", audio=base64.b64encode(pcm).decode(), sample_rate=sr))
        await self.send(event("response.text.done", text=reply))
        await self.send(event("response.audio.done"))
        await self.send(event("response.done", usage={
            "audio_latency_s": round(latency, 4), "ttfs_s": round(ttfs, 4), "outcome": first["outcome"],
            "nfe_to_first_sentence": first["nfe"], "accepted_tokens": first["accepted_tokens"],
            "wasted_tokens": wasted}))
        self._new_turn()

    async def _abandon(self) -> None:
        """The client left (possibly mid-turn): stop this session's work and free its LLM state."""
        for task in (self.worker, self.asr_task):
            if task is not None:
                task.cancel()
        if self.turn is not None:
            await self.llm.end.remote(self.turn)
        self.turn = None
