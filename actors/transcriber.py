"""A Ray actor hosting a :class:`rayspec.pipeline.Transcriber`: models load once, batches stream through."""

from __future__ import annotations

from dataclasses import asdict

import ray


@ray.remote(max_restarts=3, max_task_retries=3)
class TranscriberActor:
    """Hosts target (and draft) models; ``transcribe`` turns a batch of utterances into result rows.

    Batches are idempotent (same input, same rows), so Ray may retry them on a restarted actor
    (``max_restarts``/``max_task_retries``) and the writer de-duplicates by id.

    Args:
        kwargs: :class:`rayspec.pipeline.Transcriber` arguments (target, draft, options, device, limits).
        threads: torch CPU threads inside the actor (0 = torch's default).
    """

    def __init__(self, kwargs: dict, threads: int = 0) -> None:
        import torch

        from rayspec.pipeline import Transcriber

        if threads:
            torch.set_num_threads(threads)
        self.transcriber = Transcriber(**kwargs)

    def transcribe(self, utterances: list) -> list[dict]:
        """Utterances (``rayspec.manifest.Utterance``) -> result rows as dicts (``rayspec.results.ResultRow``)."""
        return [asdict(r) for r in self.transcriber.transcribe(utterances)]

    def ready(self) -> bool:
        return True
