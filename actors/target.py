"""The target-side Ray actor: the target decoder (AR, verification, fallback) over batches from a drafter."""

from __future__ import annotations

import logging
from dataclasses import asdict

import ray

from actors.drafter import DraftSessionLost, RemoteProposers

SESSION_ATTEMPTS = 3
log = logging.getLogger(__name__)


@ray.remote(max_restarts=3, max_task_retries=3)
class TargetActor:
    """Hosts a :class:`rayspec.pipeline.TargetDecoder`; the target model loads once and serves every batch.

    Batches are idempotent (same input, same rows), so Ray may retry them on a restarted actor
    (``max_restarts``/``max_task_retries``) and the writer de-duplicates by id.

    Args:
        target: target model name or directory (default ``whisper-base``); options: :class:`~rayspec.pipeline.DecodeOptions`.
        device: torch device ("cuda" inside a GPU actor); threads: torch CPU threads (0 = torch's default);
        dtype: model dtype (the drafter's, so encoder states arrive in it).
    """

    def __init__(self, target, options, device: str = "cpu", threads: int = 0, dtype=None) -> None:
        import torch

        from rayspec.models.whisper import WhisperASR
        from rayspec.models.registry import DEFAULT_TARGET
        from rayspec.pipeline import TargetDecoder

        if threads:
            torch.set_num_threads(threads)
        model = WhisperASR.from_pretrained(target or DEFAULT_TARGET, device, dtype or torch.float32)
        model.release("encoder")  # the encoder runs on the drafter actors
        model.pack_for_inference()
        self.decoder = TargetDecoder(model, options)

    def decode(self, batch_ref: list, drafter, key: str) -> list[dict]:
        """Decode the batch behind ``batch_ref[0]`` (an ObjectRef of an EncodedBatch made by ``drafter``).

        The ref comes wrapped in a list so that it arrives unresolved and can be handed on to the drafter.
        Returns result rows as dicts (:class:`rayspec.results.ResultRow`).

        Raises:
            DraftSessionLost: the drafter lost the batch's draft session ``SESSION_ATTEMPTS`` times.
        """
        from rayspec.pipeline import needs_draft

        batch = ray.get(batch_ref[0])
        use_draft = batch.encoded is not None and needs_draft(self.decoder.options)
        for attempt in range(SESSION_ATTEMPTS):
            proposers = RemoteProposers(drafter, key, batch_ref[0]) if use_draft else None
            try:
                return [asdict(r) for r in self.decoder.decode(batch, proposers)]
            except DraftSessionLost:
                if attempt == SESSION_ATTEMPTS - 1:
                    raise
                log.warning("batch %s: the drafter lost its draft session (restarted?); redoing the batch", key)
            finally:
                if proposers is not None:
                    proposers.close()

    def node(self) -> str:
        """The id of the Ray node this actor runs on (also tells the driver its models are loaded)."""
        return ray.get_runtime_context().get_node_id()
