"""Ray Serve online endpoint, compatible with OpenAI's audio transcription API.

``POST /v1/audio/transcriptions`` (multipart: ``file``, optional ``model``, ``response_format`` = json | text |
verbose_json) and ``GET /health``. Requests are batched dynamically with ``@serve.batch`` into the configured decoder
(AR, draft speculation or SSD), so concurrent requests share target passes. Limits: upload bytes (default 25 MB, as
OpenAI's API) and audio seconds answer 413; undecodable audio answers 415; a bad ``response_format`` 400; each with a
JSON error body ``{"error": {"message", "type", "code"}}``.

Start with ``rayspec serve`` (127.0.0.1:8000) or ``serve run actors.serve_app:app``.
"""


import io
import os
from typing import Optional

from fastapi import FastAPI, File, Form, UploadFile
from fastapi.responses import JSONResponse, PlainTextResponse
from ray import serve

from rayspec.audio import DEFAULT_MAX_BYTES, AudioError, AudioLimits, AudioTooLargeError, load_audio

api = FastAPI(title="rayspec", description="Speech recognition with exact, batched speculative decoding")
FORMATS = ("json", "text", "verbose_json")


def _error(status: int, message: str, kind: str) -> JSONResponse:
    return JSONResponse(status_code=status, content={"error": {"message": message, "type": kind, "code": status}})


@serve.deployment(max_ongoing_requests=64)
@serve.ingress(api)
class TranscriptionService:
    """A replica hosting one :class:`rayspec.pipeline.Transcriber`.

    Args:
        transcriber: :class:`~rayspec.pipeline.Transcriber` keyword arguments.
        max_batch_size: most requests decoded together (``@serve.batch``); keep ``max_ongoing_requests`` above it.
        batch_wait_timeout_s: how long a batch waits to fill.
        max_upload_bytes: 413 above this.
        threads: torch CPU threads (0 = default).
    """

    def __init__(self, transcriber: dict, max_batch_size: int = 16, batch_wait_timeout_s: float = 0.02,
                 max_upload_bytes: int = DEFAULT_MAX_BYTES, threads: int = 0) -> None:
        import torch

        from rayspec.pipeline import Transcriber

        if threads:
            torch.set_num_threads(threads)
        self.transcriber = Transcriber(**transcriber)
        self.limits = AudioLimits(self.transcriber.limits.max_seconds, max_upload_bytes)
        self._decode.set_max_batch_size(max_batch_size)
        self._decode.set_batch_wait_timeout_s(batch_wait_timeout_s)

    @serve.batch(max_batch_size=16, batch_wait_timeout_s=0.02)
    async def _decode(self, audios: list) -> list[dict]:
        rate = self.transcriber.sample_rate
        durations = [len(a) / rate for a in audios]
        hyps, seconds = self.transcriber.decode(audios, durations)
        t = self.transcriber.target
        out = []
        for h, d in zip(hyps, durations):
            s = h.stats
            out.append({
                "text": t.decode_text(h.tokens), "duration": d, "route": h.route, "finished": h.finished,
                "target_forward_passes": s.target_forward_passes, "draft_forward_passes": s.draft_forward_passes,
                "draft_tokens_proposed": s.draft_tokens_proposed, "draft_tokens_accepted": s.draft_tokens_accepted,
                "batch_size": len(audios), "batch_decode_s": seconds,
            })
        return out

    @api.get("/health")
    async def health(self) -> dict:
        return {"status": "ok", "model": self.transcriber.target.name,
                "method": self.transcriber.options.method}

    @api.post("/v1/audio/transcriptions")
    async def transcriptions(
        self, file: UploadFile = File(...), model: Optional[str] = Form(None),
        response_format: str = Form("json"),
    ):
        if response_format not in FORMATS:
            return _error(400, f"response_format must be one of {', '.join(FORMATS)}", "invalid_request_error")
        data = await file.read(self.limits.max_bytes + 1)
        if len(data) > self.limits.max_bytes:
            return _error(413, f"upload exceeds {self.limits.max_bytes} bytes", "request_too_large")
        buf = io.BytesIO(data)
        buf.name = file.filename or "<upload>"
        try:
            audio = load_audio(buf, self.transcriber.sample_rate, self.limits)
        except AudioTooLargeError as exc:
            return _error(413, str(exc), "request_too_large")
        except AudioError as exc:
            return _error(415, str(exc), "unsupported_media_type")
        result = await self._decode(audio)
        if response_format == "text":
            return PlainTextResponse(result["text"])
        if response_format == "json":
            return {"text": result["text"]}
        return {"task": "transcribe", "language": "english", "model": model or self.transcriber.target.name,
                "method": self.transcriber.options.method, **result}


def build_app(args: Optional[dict] = None):
    """The Serve application; ``args`` (from ``serve run ... key=value`` or ``rayspec serve``) may set ``method``,
    ``target``, ``draft``, ``ctc``, ``max_batch_size``, ``threads``, ``num_replicas``, ``num_cpus``, ``num_gpus``."""
    from rayspec.pipeline import DecodeOptions

    args = dict(args or {})
    transcriber = {"target": args.get("target"), "draft": args.get("draft"), "ctc": args.get("ctc"),
                   "options": DecodeOptions(args.get("method", "ar")), "device": args.get("device", "cpu")}
    max_batch = int(args.get("max_batch_size", 16))
    deployment = TranscriptionService.options(
        num_replicas=int(args.get("num_replicas", 1)), max_ongoing_requests=max(64, 2 * max_batch),
        ray_actor_options={"num_cpus": float(args.get("num_cpus", 1)), "num_gpus": float(args.get("num_gpus", 0))},
    )
    return deployment.bind(transcriber, max_batch, float(args.get("batch_wait_timeout_s", 0.02)),
                           int(args.get("max_upload_bytes", DEFAULT_MAX_BYTES)), int(args.get("threads", 0)))


app = build_app({k[len("RAYSPEC_"):].lower(): v for k, v in os.environ.items() if k.startswith("RAYSPEC_")})
