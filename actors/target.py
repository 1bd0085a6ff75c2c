"""The target-side Ray actor: the target decoder (AR, verification, fallback) over batches from a drafter.

Without a remote draft (methods ar, medusa, ctc-draft, ssd without the draft fallback) the batches in flight on the
actor join one continuous batch (:meth:`rayspec.pipeline.TargetDecoder.decode_stream` on a
:class:`rayspec.engine.StreamEngine` thread, as in ``rayspec transcribe`` and Serve): a batch's encoder states are
fetched from the object store when a slot frees, its rows join before the next decoder pass, and each call returns
as soon as its batch's rows finish. With a remote draft (method draft, ssd with the draft fallback) each batch is
decoded on its own, with its proposals from the drafter that encoded it (a draft session per batch).
"""

from __future__ import annotations

import logging
from dataclasses import asdict

import ray

from actors.drafter import DraftSessionLost, RemoteProposers

SESSION_ATTEMPTS = 3
log = logging.getLogger(__name__)


def _build(target, options, device: str, threads: int, dtype):
    """The actor's :class:`~rayspec.pipeline.TargetDecoder`, built on the thread that decodes (see
    :class:`rayspec.engine.StreamEngine` for why)."""
    import torch

    from rayspec.compute import as_compute_type
    from rayspec.models.registry import DEFAULT_TARGET
    from rayspec.models.whisper import WhisperASR
    from rayspec.pipeline import TargetDecoder

    if threads:
        torch.set_num_threads(threads)
    chosen = as_compute_type(dtype or torch.float32, device)
    model = WhisperASR.from_pretrained(target or DEFAULT_TARGET, device, chosen.dtype, lean=True)
    model.release("encoder")  # the encoder runs on the drafter actors
    model.pack_for_inference(chosen.int8)
    return TargetDecoder(model, options)


def _stream(decoder, refs, slots: int):
    """:meth:`~rayspec.pipeline.TargetDecoder.decode_stream` over ObjectRefs of encoded batches (None: nothing
    waiting now), each fetched when its rows are wanted; keys are the batches' positions."""

    def batches():
        k = 0
        for ref in refs:
            if ref is None:
                yield None
                continue
            yield k, ray.get(ref)
            k += 1

    return decoder.decode_stream(batches(), slots)


@ray.remote(max_restarts=3, max_task_retries=3)
class TargetActor:
    """Hosts a :class:`rayspec.pipeline.TargetDecoder`; the target model loads once and serves every batch. Start it
    with ``max_concurrency`` >= the batches in flight on it (each call waits for its batch).

    Batches are idempotent (same input, same rows), so Ray may retry them on a restarted actor
    (``max_restarts``/``max_task_retries``) and the writer de-duplicates by id.

    Args:
        target: target model name or directory (default ``whisper-base``); options: :class:`~rayspec.decoding.options.DecodeOptions`.
        device: torch device ("cuda" inside a GPU actor); threads: torch CPU threads (0 = torch's default);
        dtype: model dtype (the drafter's, so encoder states arrive in it); slots: most rows decoded at once
            (continuous batching, without a remote draft).
    """

    def __init__(self, target, options, device: str = "cpu", threads: int = 0, dtype=None, slots: int = 16) -> None:
        from rayspec.pipeline import needs_draft

        self.remote_draft = needs_draft(options)
        if self.remote_draft:
            self.decoder = _build(target, options, device, threads, dtype)
        else:
            from rayspec.engine import StreamEngine

            self.engine = StreamEngine(lambda: _build(target, options, device, threads, dtype), _stream, slots)

    def decode(self, batch_ref: list, drafter, key: str) -> list[dict]:
        """Decode the batch behind ``batch_ref[0]`` (an ObjectRef of an EncodedBatch made by ``drafter``).

        The ref comes wrapped in a list so that it arrives unresolved (fetched when its rows are wanted, or handed on
        to the drafter). Returns result rows as dicts (:class:`rayspec.results.ResultRow`).

        Raises:
            DraftSessionLost: the drafter lost the batch's draft session ``SESSION_ATTEMPTS`` times.
        """
        if not self.remote_draft:
            rows, _ = self.engine.submit_item(batch_ref[0]).result()
            return [asdict(r) for r in rows]
        batch = ray.get(batch_ref[0])
        use_draft = batch.encoded is not None
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
