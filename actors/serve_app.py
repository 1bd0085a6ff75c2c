"""Ray Serve online endpoint, compatible with OpenAI's audio transcription API.

``POST /v1/audio/transcriptions`` (multipart: ``file``, optional ``model``, ``response_format`` = json | text | srt |
vtt | verbose_json, and with verbose_json OpenAI's ``timestamp_granularities[]`` = segment | word: the body's
``segments`` and ``words``, :func:`rayspec.export.verbose_json`), ``GET /v1/models`` and ``GET /health``. Segment times
come from the replica's ``timestamps`` option (``rayspec serve --timestamps segment|word``; without it, one segment
per file); word times need ``--timestamps word``; with ``tts`` on, also OpenAI's ``POST /v1/audio/speech``
(JSON: ``model``, ``input`` <= 4096 characters, ``voice``, ``response_format`` = mp3 | opus | flac | wav | pcm,
``speed`` 0.25..4, ``stream_format`` = audio | sse for sentence-level streaming; the body is the audio) and
``GET /v1/audio/voices``, served by ``actors/speech_app.py``. Concurrent requests share target passes: a request joins
the replica's running decode as soon as a slot frees (continuous batching, :class:`rayspec.engine.TranscriptionEngine`,
every method) and returns when its own rows finish. Decoding runs off the event loop, so health checks and refusals
stay fast while it decodes.

Every error, validation included, is JSON of one shape, ``{"error": {"message", "type", "code"}}``:

| status | when |
|---|---|
| 400 | bad form fields, empty, too short (< 50 ms) or non-finite audio |
| 401 | the server has an API key and the request lacks it (OpenAI's body: ``"code": "invalid_api_key"``, see
|     | :class:`AccessMiddleware`) |
| 404 | a ``model`` that is not served here (``GET /v1/models`` lists the names) |
| 408 | the body did not arrive within ``body_timeout_s`` |
| 413 | a body over ``max_upload_bytes`` (by ``Content-Length``, before reading it; else while reading), or audio
|     | over the duration cap |
| 415 | undecodable audio |
| 500 | the request's own decoding failed (its batch-mates are decoded) |
| 503 | ``max_queued`` requests already waiting (with ``Retry-After``) |

Audio longer than the model's window is segmented and re-joined, as in corpus jobs; silence gives empty text.

Start with ``rayspec serve`` (127.0.0.1:8000) or ``serve run actors.serve_app:app``.
"""

import asyncio
import hmac
import io
import itertools
import json
import os
from dataclasses import dataclass
from typing import Optional

from fastapi import FastAPI, File, Form, UploadFile, WebSocket
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel
from ray import serve
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware

from rayspec.audio import DEFAULT_MAX_BYTES, AudioError, AudioLimits, load_audio
from rayspec.engine import TranscriptionEngine
from rayspec.manifest import Utterance
from rayspec.tts.flags import DEFAULT_SPEED

api = FastAPI(title="rayspec", description="Speech recognition with exact, batched speculative decoding")
FORMATS = ("json", "text", "srt", "vtt", "verbose_json")
GRANULARITIES = ("segment", "word")
MODEL_ALIASES = ("whisper-1", "rayspec")  # what OpenAI clients send by default, and ours
MULTIPART_OVERHEAD = 64 * 1024  # boundaries, part headers and form fields around the file
AUDIO_ERROR_STATUS = {"too_large": 413, "too_long": 413, "undecodable": 415}
STATUS_TYPE = {400: "invalid_request_error", 404: "model_not_found", 405: "invalid_request_error",
               408: "request_timeout", 413: "request_too_large", 415: "unsupported_media_type",
               422: "invalid_request_error", 500: "internal_error", 503: "server_overloaded"}


def error_body(status: int, message: str, kind: Optional[str] = None) -> dict:
    """The one error shape of every non-2xx answer."""
    return {"error": {"message": message, "type": kind or STATUS_TYPE.get(status, "error"), "code": status}}


def _error(status: int, message: str, kind: Optional[str] = None, headers: Optional[dict] = None) -> JSONResponse:
    return JSONResponse(status_code=status, content=error_body(status, message, kind), headers=headers)


@dataclass
class Admission:
    """Per-replica limits applied before a request body is read (see :class:`AdmissionMiddleware`).

    Attributes:
        max_body_bytes: largest request body in bytes; max_queued: requests admitted at once (decoding or
        waiting); body_timeout_s: seconds allowed for the whole body to arrive.
    """

    max_body_bytes: int = DEFAULT_MAX_BYTES + MULTIPART_OVERHEAD
    max_queued: int = 256
    body_timeout_s: float = 30.0
    active: int = 0


class AdmissionMiddleware:
    """ASGI middleware in front of the transcription route: queue bound (503), body size (413 by
    ``Content-Length`` before reading; streamed bodies are counted while read; either way the rest of the body is
    drained before the 413 goes out, :func:`_drain`) and body timeout (408).

    The body is read here (within the limits) and replayed to the application, so a slow or oversized upload never
    reaches the multipart parser. Other routes (``/health``, ``/v1/models``) pass straight through.
    """

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] != "POST":
            return await self.app(scope, receive, send)
        limits = _admission()
        if limits.active >= limits.max_queued:
            return await _send(send, 503, f"{limits.active} requests are queued; retry shortly",
                               headers={"Retry-After": "1"})
        headers = dict(scope.get("headers") or [])
        declared = headers.get(b"content-length")
        limits.active += 1  # a refused body being drained counts against max_queued too
        try:
            if declared is not None and (not declared.isdigit() or int(declared) > limits.max_body_bytes):
                if headers.get(b"expect", b"").lower() != b"100-continue":  # else the client waits: nothing to drain
                    await _drain(receive, limits.body_timeout_s)
                return await _send(send, 413, f"request body of {declared.decode(errors='replace')} bytes is over "
                                              f"the limit of {limits.max_body_bytes} bytes")
            # asyncio.wait, not wait_for: a receive() that does not honour cancellation must not hold the answer.
            reading = asyncio.ensure_future(_read_body(receive, limits.max_body_bytes))
            done, _ = await asyncio.wait({reading}, timeout=limits.body_timeout_s)
            if not done:
                reading.cancel()
                return await _send(send, 408, f"the request body did not arrive within {limits.body_timeout_s:g} s")
            body = reading.result()
            if body is None:
                await _drain(receive, limits.body_timeout_s)
                return await _send(send, 413, f"request body is over the limit of {limits.max_body_bytes} bytes")
            replayed = False

            async def replay():
                nonlocal replayed
                if not replayed:
                    replayed = True
                    return {"type": "http.request", "body": body, "more_body": False}
                return await receive()

            return await self.app(scope, replay, send)
        finally:
            limits.active -= 1


def _admission() -> Admission:
    """This replica's :class:`Admission`."""
    return _replica_setting("admission", DEFAULT_ADMISSION)


def _replica_setting(name: str, default):
    """The replica's attribute ``name`` (Serve runs a copy of ``api``, so per-replica settings live on the replica),
    or ``default`` outside a replica (e.g. the app under a test client)."""
    try:
        return getattr(serve.get_replica_context().servable_object, name)
    except (AttributeError, RuntimeError):
        return default


async def _read_body(receive, limit: int) -> Optional[bytes]:
    """The whole request body, or None as soon as it exceeds ``limit`` bytes."""
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return b"".join(chunks)
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


DRAIN_BYTES = 64 << 20
"""Most bytes of a refused body read and discarded before the refusal is sent (see :func:`_drain`)."""


async def _drain(receive, timeout_s: float, limit: int = DRAIN_BYTES) -> None:
    """Read and discard the rest of a refused request's body (at most ``limit`` bytes and ``timeout_s`` seconds).

    A client that sends its whole body before it reads the answer (urllib, requests, httpx as in OpenAI's SDK) sees
    a connection reset instead of the 413 when the server closes with unread data in the socket; reading the rest
    first is the lingering close of HTTP/1.1 servers (RFC 9112 section 9.6). A body past ``limit`` or a client
    that stalls gets the answer anyway once the bound is hit.
    """
    async def rest() -> None:
        size = 0
        while size <= limit:
            message = await receive()
            size += len(message.get("body", b""))
            if message["type"] == "http.disconnect" or not message.get("more_body", False):
                return

    reading = asyncio.ensure_future(rest())
    await asyncio.wait({reading}, timeout=timeout_s)
    reading.cancel()


async def _send(send, status: int, message: str, headers: Optional[dict] = None, body: Optional[dict] = None) -> None:
    """Answer ``status`` with ``body`` (default: :func:`error_body` of ``message``) and close the connection."""
    body = json.dumps(body or error_body(status, message)).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
           (b"connection", b"close")] + [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})


@dataclass(frozen=True)
class Access:
    """Who may use a replica (see :class:`AccessMiddleware`).

    Attributes:
        api_key: the bearer token every route but :data:`OPEN_PATHS` needs; None: no key (anyone who reaches the
            port). allowed_origins: the browser origins (``https://app.example:8443``) that may call the endpoint
            cross-origin (CORS); empty: none.
    """

    api_key: Optional[str] = None
    allowed_origins: tuple = ()


OPEN_PATHS = ("/health", "/")
"""Paths answered without the key: the health check, and the voice-chat page (static HTML; it sends the key on its
WebSocket, read from the page address's ``#key=`` fragment)."""
KEY_SUBPROTOCOL = "openai-insecure-api-key."
"""WebSocket subprotocol prefix that carries the key where a browser cannot set headers (OpenAI Realtime's)."""


def presented_key(scope) -> Optional[bytes]:
    """The key a request presents: its ``Authorization: Bearer <key>`` header, or for a WebSocket a
    :data:`KEY_SUBPROTOCOL` subprotocol; None without either."""
    for name, value in scope.get("headers") or ():
        if name == b"authorization":
            scheme, _, token = value.partition(b" ")
            return token.strip() if scheme.lower() == b"bearer" else None
    if scope["type"] == "websocket":
        for protocol in scope.get("subprotocols") or ():
            if protocol.startswith(KEY_SUBPROTOCOL):
                return protocol[len(KEY_SUBPROTOCOL):].encode()
    return None


def unauthorized_body(presented: Optional[bytes]) -> dict:
    """OpenAI's 401 body, for a missing (``presented`` None) or a wrong key."""
    message = ("incorrect API key provided" if presented is not None else
               "this server needs an API key: send the header Authorization: Bearer <key>")
    return {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": "invalid_api_key"}}


class AccessMiddleware:
    """ASGI middleware in front of every route: the API key, then CORS.

    With :attr:`Access.api_key` set, each HTTP request and WebSocket outside :data:`OPEN_PATHS` must present it
    (:func:`presented_key`; compared with :func:`hmac.compare_digest`, in time independent of where it differs);
    otherwise HTTP gets 401 with :func:`unauthorized_body` (its body drained first, as a 413's) and a WebSocket is
    closed with code 1008 before it opens. Nothing of a refused request reaches the application: it neither queues
    (:class:`AdmissionMiddleware`) nor decodes. With :attr:`Access.allowed_origins`, Starlette's CORS middleware
    answers preflights and labels answers for those origins (401s included); without, no CORS headers are sent, so
    browsers keep other sites' pages from reading answers.
    """

    def __init__(self, app) -> None:
        self.app = app
        self._chains: dict = {}

    async def __call__(self, scope, receive, send):
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        access = _replica_setting("access", DEFAULT_ACCESS)
        chain = self._chains.get(access)
        if chain is None:
            async def guarded(scope, receive, send):
                return await self._guard(access, scope, receive, send)

            chain = guarded
            if access.allowed_origins:
                chain = CORSMiddleware(guarded, allow_origins=list(access.allowed_origins),
                                       allow_methods=["GET", "POST"], allow_headers=["Authorization", "Content-Type"],
                                       expose_headers=["Retry-After"])
            self._chains[access] = chain
        return await chain(scope, receive, send)

    async def _guard(self, access: Access, scope, receive, send):
        if access.api_key is None or scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        presented = presented_key(scope)
        if presented is not None and hmac.compare_digest(presented, access.api_key.encode()):
            return await self.app(scope, receive, send)
        if scope["type"] == "websocket":
            await receive()  # websocket.connect
            return await send({"type": "websocket.close", "code": 1008, "reason": "invalid_api_key"})
        limits = _admission()
        if dict(scope.get("headers") or []).get(b"expect", b"").lower() != b"100-continue":
            await _drain(receive, limits.body_timeout_s, limits.max_body_bytes)
        return await _send(send, 401, "", headers={"WWW-Authenticate": "Bearer"}, body=unauthorized_body(presented))


DEFAULT_ADMISSION = Admission()
DEFAULT_ACCESS = Access()
api.add_middleware(AdmissionMiddleware)
api.add_middleware(AccessMiddleware)  # added last, so it runs first: a refused request is neither queued nor read


@api.exception_handler(RequestValidationError)
async def _validation_error(request, exc: RequestValidationError) -> JSONResponse:
    problems = "; ".join(f"{'.'.join(str(p) for p in e.get('loc', ())[1:]) or 'body'}: {e.get('msg')}"
                         for e in exc.errors())
    return _error(400, problems or "invalid request")


@api.exception_handler(StarletteHTTPException)
async def _http_error(request, exc: StarletteHTTPException) -> JSONResponse:
    return _error(exc.status_code, str(exc.detail), headers=getattr(exc, "headers", None))


@api.exception_handler(Exception)
async def _unexpected(request, exc: Exception) -> JSONResponse:
    return _error(500, f"{type(exc).__name__}: {exc}")


class SpeechRequest(BaseModel):
    """OpenAI's ``POST /v1/audio/speech`` body (``instructions`` is accepted and ignored: one voice, no styles)."""

    model: str = "rayspec-tts"
    input: str
    voice: str = "joe"
    response_format: str = "mp3"
    speed: float = DEFAULT_SPEED
    stream_format: Optional[str] = None
    instructions: Optional[str] = None
    seed: int = 0


@serve.deployment(max_ongoing_requests=272)
@serve.ingress(api)
class TranscriptionService:
    """A replica hosting one :class:`rayspec.pipeline.Transcriber`.

    Args:
        transcriber: :class:`~rayspec.pipeline.Transcriber` keyword arguments.
        max_batch_size: most rows decoded together: the continuous batch's slots (a request joins the running
            decode as a slot frees, :class:`rayspec.engine.TranscriptionEngine`).
        max_upload_bytes: 413 above this (the audio file; the body may add multipart overhead).
        threads: torch CPU threads (0 = default).
        max_queued: requests admitted at once per replica (decoding or waiting); 503 beyond.
        body_timeout_s: seconds allowed for an upload to arrive (408 after).
        access: the API key and CORS origins (:class:`Access`; default: no key, no cross-origin access).
    """

    def __init__(self, transcriber: dict, max_batch_size: int = 16,
                 max_upload_bytes: int = DEFAULT_MAX_BYTES, threads: int = 0, max_queued: int = 256,
                 body_timeout_s: float = 30.0, speech=None, chat: Optional[dict] = None,
                 access: Access = DEFAULT_ACCESS) -> None:
        import torch

        from rayspec.pipeline import Transcriber

        if threads:
            torch.set_num_threads(threads)
        # the models load on the engine's thread, the one thread that runs torch here (see TranscriptionEngine)
        self.engine = TranscriptionEngine(lambda: Transcriber(**transcriber), max_batch_size)
        self.transcriber = self.engine.transcriber
        self._requests = itertools.count()
        self.limits = AudioLimits(self.transcriber.limits.max_seconds, max_upload_bytes)
        self.admission = Admission(max_upload_bytes + MULTIPART_OVERHEAD, max_queued, body_timeout_s)
        self.access = access
        self.models = {self.transcriber.target.name, *MODEL_ALIASES}
        self.speech = speech  # a handle to actors.speech_app.SpeechService, or None (synthesis not served)
        self.chat = chat  # {"llm", "voice"} handles (actors.voicechat_app), or None (voice chat not served)

    async def _transcribe(self, name: str, audio, request=None) -> tuple:
        """``(result row, batch size)`` of one waveform through the continuous batch (batch size: requests decoding
        when it finished); ``request``: the request's own :class:`~rayspec.manifest.RequestOptions`."""
        utterance = Utterance(f"request-{next(self._requests)}", name, request=request)
        return await asyncio.wrap_future(self.engine.submit(utterance, audio))

    def _request_options(self, prompt: Optional[str], temperature: Optional[float], language: Optional[str]):
        """OpenAI's ``prompt``, ``temperature`` and ``language`` form fields as
        :class:`~rayspec.manifest.RequestOptions` (None when none is set).

        Raises:
            ValueError: a temperature outside 0..2 or a language the model does not have (a 400).
        """
        from rayspec.manifest import RequestOptions

        if temperature is not None and not (0.0 <= temperature <= 2.0):
            raise ValueError(f"temperature must be within 0..2, got {temperature}")
        target = self.transcriber.target
        if language:
            language = language.strip().lower()
            if target.multilingual and language not in target.languages:
                raise ValueError(f"language {language!r} is not one of this model's "
                                 f"({', '.join(sorted(target.languages))})")
            if not target.multilingual and language != "en":
                raise ValueError(f"{target.name} is English-only: language must be en, got {language!r}")
        if prompt is None and not temperature and not language:
            return None
        return RequestOptions(prompt or None, temperature or None, language or None)

    async def _transcribe_text(self, audio) -> str:
        """Text of one waveform, through the same batches as ``/v1/audio/transcriptions``."""
        row, _ = await self._transcribe("realtime", audio)
        return row.text or ""

    @api.websocket("/v1/realtime")
    async def realtime(self, ws: WebSocket) -> None:
        """A voice-chat session (``actors/voicechat_app.py``: events, PredGen input-time speculation)."""
        from actors.voicechat_app import RealtimeSession, error_event

        # a browser that offered subprotocols (the key's, see AccessMiddleware) needs one of them echoed
        await ws.accept(subprotocol="realtime" if "realtime" in (ws.scope.get("subprotocols") or ()) else None)
        if self.chat is None:
            await ws.send_text(error_event("not_served", "voice chat is off here (rayspec serve --chat)"))
            await ws.close()
            return
        await RealtimeSession(ws, self.chat["llm"], self.chat["voice"], self._transcribe_text).run()

    @api.get("/")
    async def chat_page(self):
        """The voice-chat page (``rayspec/chat/web/index.html``, plain HTML/JS over ``/v1/realtime``)."""
        if self.chat is None:
            return _error(404, "voice chat is off here (rayspec serve --chat serves its page at /)")
        from importlib import resources

        return HTMLResponse(resources.files("rayspec").joinpath("chat", "web", "index.html").read_text())

    @api.get("/health")
    async def health(self) -> dict:
        return {"status": "ok", "model": self.transcriber.target.name,
                "method": self.transcriber.options.method, "queued": self.admission.active}

    @api.get("/v1/models")
    async def list_models(self) -> dict:
        return {"object": "list", "data": [{"id": m, "object": "model", "owned_by": "rayspec"}
                                           for m in sorted(self.models)]}

    @api.post("/v1/audio/transcriptions")
    async def transcriptions(
        self, file: UploadFile = File(...), model: Optional[str] = Form(None),
        response_format: str = Form("json"),
        timestamp_granularities: Optional[list[str]] = Form(None, alias="timestamp_granularities[]"),
        prompt: Optional[str] = Form(None), temperature: Optional[float] = Form(None),
        language: Optional[str] = Form(None),
    ):
        if response_format not in FORMATS:
            return _error(400, f"response_format must be one of {', '.join(FORMATS)}")
        try:
            request = self._request_options(prompt, temperature, language)
        except ValueError as exc:
            return _error(400, str(exc))
        granularities = timestamp_granularities or []
        if set(granularities) - set(GRANULARITIES):
            return _error(400, f"timestamp_granularities[] must be among {', '.join(GRANULARITIES)}")
        if granularities and response_format != "verbose_json":
            return _error(400, "timestamp_granularities[] needs response_format=verbose_json")
        if "word" in granularities and getattr(self.transcriber.options, "timestamps", "none") != "word":
            return _error(400, "word timestamps are off on this server: start it with rayspec serve --timestamps "
                               "word")
        if model and model not in self.models:
            return _error(404, f"model {model!r} is not served here (served: {', '.join(sorted(self.models))})")
        data = await file.read(self.limits.max_bytes + 1)
        if len(data) > self.limits.max_bytes:
            return _error(413, f"upload exceeds {self.limits.max_bytes} bytes")
        buf = io.BytesIO(data)
        name = os.path.basename(file.filename or "") or "upload"
        buf.name = name
        try:
            audio = await asyncio.to_thread(load_audio, buf, self.transcriber.sample_rate, self.limits)
        except AudioError as exc:
            return _error(AUDIO_ERROR_STATUS.get(exc.code, 400), str(exc))
        row, batch_size = await self._transcribe(name, audio, request)
        if row.error:
            return _error(500, f"decoding failed: {row.error}")
        if response_format == "text":
            return PlainTextResponse(row.text)
        if response_format == "json":
            return {"text": row.text}
        from dataclasses import asdict

        from rayspec.export import render, verbose_json

        fields = asdict(row)
        if response_format in ("srt", "vtt"):
            text = render(fields, response_format)
            return PlainTextResponse(text, media_type="text/vtt" if response_format == "vtt" else "text/plain")
        from transformers.models.whisper.tokenization_whisper import LANGUAGES

        tokenizer = self.transcriber.target.tokenizer
        body = verbose_json(fields, granularities or ("segment",), self.transcriber.options.task,
                            LANGUAGES.get(row.language or "en", row.language),
                            (lambda t: tokenizer(t, add_special_tokens=False).input_ids) if tokenizer else None)
        return {**body, "model": self.transcriber.target.name, "method": self.transcriber.options.method,
                "no_speech_prob": row.no_speech_prob,
                "compression_ratio": row.compression_ratio, "repetitive": row.repetitive,
                "route": row.route, "finished": row.finished, "target_forward_passes": row.target_forward_passes,
                "draft_forward_passes": row.draft_forward_passes, "draft_tokens_proposed": row.draft_tokens_proposed,
                "draft_tokens_accepted": row.draft_tokens_accepted, "decode_s": row.decode_s,
                "batch_size": batch_size}


    @api.get("/v1/audio/voices")
    async def voices(self):
        from actors.speech_app import OPENAI_VOICES, VOICES

        if self.speech is None:
            return _error(404, "speech synthesis is not served here (start with rayspec serve --tts)")
        return {"object": "list", "data": [{"id": v, "object": "voice", "sample_rate": 16000} for v in VOICES],
                "aliases": {v: VOICES[0] for v in OPENAI_VOICES}}

    @api.post("/v1/audio/speech")
    async def speech(self, req: SpeechRequest):
        from actors.speech_app import MEDIA_TYPES, MODEL_NAMES, OPENAI_VOICES, STREAMABLE, VOICES
        from rayspec.tts.phones import MAX_TEXT_CHARS, TextError, check_text

        if self.speech is None:
            return _error(404, "speech synthesis is not served here (start with rayspec serve --tts)")
        if req.model not in MODEL_NAMES:
            return _error(404, f"model {req.model!r} is not served here (served: {', '.join(MODEL_NAMES)})")
        if req.voice not in VOICES + OPENAI_VOICES:
            return _error(400, f"unknown voice {req.voice!r}; GET /v1/audio/voices lists them")
        if req.response_format not in MEDIA_TYPES:
            return _error(400, f"response_format must be one of {', '.join(MEDIA_TYPES)}")
        if not 0.25 <= req.speed <= 4.0:
            return _error(400, f"speed must be within 0.25..4.0, got {req.speed}")
        if req.stream_format not in (None, "audio", "sse"):
            return _error(400, "stream_format must be 'audio' or 'sse'")
        if req.stream_format == "audio" and req.response_format not in STREAMABLE:
            return _error(400, f"stream_format=audio streams {', '.join(STREAMABLE)}; "
                               f"{req.response_format} comes whole (omit stream_format)")
        try:
            check_text(req.input, MAX_TEXT_CHARS)
        except TextError as exc:
            return _error(400, str(exc), exc.code)
        media = MEDIA_TYPES[req.response_format]
        if req.stream_format:
            gen = self.speech.options(stream=True).stream.remote(req.input, req.speed, req.response_format,
                                                                 req.stream_format == "sse", req.seed)
            return StreamingResponse(gen, media_type="text/event-stream" if req.stream_format == "sse" else media)
        audio, stats = await self.speech.synthesize.remote(req.input, req.speed, req.response_format, req.seed)
        headers = {f"x-rayspec-{k.replace('_', '-')}": str(v) for k, v in stats.items()}
        return Response(audio, media_type=media, headers=headers)


SERVING_OPTIONS = {"target", "draft", "ctc", "device", "compute_type", "encoder_dtype", "max_batch_size", "threads",
                   "num_replicas",
                   "num_cpus", "num_gpus", "max_upload_bytes", "max_queued", "body_timeout_s",
                   "tts", "tts_target", "tts_draft", "codec", "tts_method", "tts_theta", "tts_beta",
                   "tts_temperature", "tts_lookahead", "tts_cpus", "chat", "chat_lm", "chat_tts", "chat_cpus",
                   "chat_llm_backend", "chat_vllm_python", "api_key", "allowed_origins"}
TRUE = ("1", "true", "yes", "on")


def build_app(args: Optional[dict] = None):
    """The Serve application; ``args`` (from ``serve run ... key=value``, ``RAYSPEC_*`` environment variables or
    ``rayspec serve``) may set ``target``, ``draft``, ``ctc``, ``device``, ``compute_type`` (default
    ``RAYSPEC_COMPUTE_TYPE`` or auto: :mod:`rayspec.compute`), ``encoder_dtype``, ``max_batch_size``, ``threads``,
    ``num_replicas``, ``num_cpus``, ``num_gpus``, ``max_upload_bytes``, ``max_queued``, ``body_timeout_s``,
    ``api_key`` (the bearer token of :class:`AccessMiddleware`; ``RAYSPEC_API_KEY``), ``allowed_origins`` (CORS
    origins, a list or a comma-separated string) and any decoding option of ``rayspec transcribe`` (``method``,
    ``tau_ctc``, ...: same names, same defaults).

    Raises:
        ValueError: an unknown option.
    """
    from rayspec.compute import dtype_of
    from rayspec.models.registry import DEFAULT_TARGET
    from rayspec.options import decode_option_names, decode_options_from

    args = dict(args or {})
    names = decode_option_names() - {"ctc"}
    unknown = set(args) - names - SERVING_OPTIONS
    if unknown:
        raise ValueError(f"unknown Serve options {sorted(unknown)}")
    options = decode_options_from({k: v for k, v in args.items() if k in names},
                                  args.get("target") or DEFAULT_TARGET)  # method auto resolved for the target
    transcriber = {"target": args.get("target"), "draft": args.get("draft"), "ctc": args.get("ctc"),
                   "options": options, "device": args.get("device", "cpu"),
                   "dtype": args.get("compute_type"),  # resolved by each replica on its node (None: the default)
                   "encoder_dtype": dtype_of(args["encoder_dtype"]) if args.get("encoder_dtype") else None}
    max_batch = int(args.get("max_batch_size", 16))
    max_queued = int(args.get("max_queued", 256))
    deployment = TranscriptionService.options(
        num_replicas=int(args.get("num_replicas", 1)),
        # Admission (503 + Retry-After beyond max_queued) happens in the replica: let that many requests reach it.
        # Ray's own queue in front of it is only a backstop (its 503 has no Retry-After and another body).
        max_ongoing_requests=max_queued + max_batch, max_queued_requests=4 * max_queued,
        ray_actor_options={"num_cpus": float(args.get("num_cpus", 1)), "num_gpus": float(args.get("num_gpus", 0))},
    )
    speech = None
    if str(args.get("tts", "")).lower() in TRUE:
        from actors.speech_app import SpeechService

        sampling = {k: conv(args[f"tts_{k}"]) for k, conv in (("method", str), ("theta", float), ("beta", float),
                                                              ("temperature", float), ("lookahead", int))
                    if args.get(f"tts_{k}") is not None}
        speech = SpeechService.options(ray_actor_options={"num_cpus": float(args.get("tts_cpus", 1))}).bind(
            {"target": args.get("tts_target"), "draft": args.get("tts_draft"), "codec": args.get("codec")},
            sampling, max_batch, int(args.get("threads", 0)))
    chat = None
    if str(args.get("chat", "")).lower() in TRUE:
        from actors.voicechat_app import ChatLLM, ChatVoice

        cpus = {"num_cpus": float(args.get("chat_cpus", 0.5))}
        backend = args.get("chat_llm_backend") or "transformers"
        chat = {"llm": ChatLLM.options(ray_actor_options=cpus).bind(args.get("chat_lm"), 1, backend,
                                                                    args.get("chat_vllm_python")),
                "voice": ChatVoice.options(ray_actor_options=cpus).bind(args.get("chat_tts") or "piper")}
    origins = args.get("allowed_origins") or ()
    origins = tuple(o.strip() for o in (origins.split(",") if isinstance(origins, str) else origins) if o.strip())
    access = Access(args.get("api_key") or None, origins)
    return deployment.bind(transcriber, max_batch, int(args.get("max_upload_bytes", DEFAULT_MAX_BYTES)), int(args.get("threads", 0)),
                           max_queued, float(args.get("body_timeout_s", 30.0)), speech, chat, access)


def serve_forever(options: dict, host: str, port: int, request_timeout_s: float, address: Optional[str]) -> int:
    """``rayspec serve``: connect to Ray (``address``, else ``RAY_ADDRESS``, else a local Ray on 127.0.0.1), run
    :func:`build_app` with ``options`` behind Serve's HTTP proxy on ``host:port`` until Ctrl-C."""
    import time

    import ray

    if address or os.environ.get("RAY_ADDRESS"):
        ray.init(address=address or os.environ["RAY_ADDRESS"])
    else:
        ray.init(include_dashboard=False, _node_ip_address="127.0.0.1")
    serve.start(http_options={"host": host, "port": port, "request_timeout_s": request_timeout_s})
    serve.run(build_app(options), name="rayspec", route_prefix="/")
    routes = [f"POST http://{host}:{port}/v1/audio/transcriptions"]
    if str(options.get("tts", "")).lower() in TRUE:
        routes.append(f"POST http://{host}:{port}/v1/audio/speech")
    if str(options.get("chat", "")).lower() in TRUE:
        routes.append(f"WebSocket ws://{host}:{port}/v1/realtime")
    key = "API key required" if options.get("api_key") else "no API key"
    print(f"serving {', '.join(routes)} ({key}; Ctrl-C to stop)", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        serve.shutdown()
    return 0


def _env_args() -> dict:
    """``build_app`` options from ``RAYSPEC_<NAME>`` environment variables (other ``RAYSPEC_*`` names are ignored)."""
    from rayspec.options import decode_option_names

    known = decode_option_names() | SERVING_OPTIONS
    env = {k[len("RAYSPEC_"):].lower(): v for k, v in os.environ.items() if k.startswith("RAYSPEC_")}
    return {k: v for k, v in env.items() if k in known}


app = build_app(_env_args())
