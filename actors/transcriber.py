"""The colocated Ray actor: audio, encoder, drafter and target decoder in one process (a
:class:`rayspec.pipeline.Transcriber`), decoding with continuous batching.

The job's default on CPUs (``--actors colocated``): one process holds one copy of the model and runs both halves
with all its threads, where the split layout (``actors/drafter.py`` + ``actors/target.py``) needs two processes,
each with its own torch runtime, and an object-store hop for the encoder states; the split in exchange overlaps one
batch's encoder with another's decoder (whisper-base on all 286 LJSpeech clips, 2 CPUs: 2.1 against 2.9 GiB, 168
against 155 s with static batches; docs/benchmarks/scaling.md, "Job memory"). The split layout is the default for
models on GPUs.

The batches the driver has in flight on the actor (``--in-flight``) join one continuous batch
(:class:`rayspec.engine.TranscriptionEngine`, as in ``rayspec transcribe`` and Serve): a queued batch is encoded
when a slot frees and its rows join before the next decoder pass; each call returns as soon as its batch's rows
finish. Queued batches are only utterance lists until then, so memory stays that of one continuous batch.
"""

from __future__ import annotations

from dataclasses import asdict

import ray


def build_transcriber(kwargs: dict, threads: int):
    """The actor's :class:`~rayspec.pipeline.Transcriber`, built on the engine thread (the one thread that runs
    torch in the actor; see :class:`rayspec.engine.StreamEngine`); also the Ray Data actor's (:mod:`actors.data`)."""
    import torch

    from rayspec.pipeline import Transcriber

    if threads:
        torch.set_num_threads(threads)
    return Transcriber(**kwargs)


@ray.remote(max_restarts=3, max_task_retries=3)
class TranscriberActor:
    """Hosts a :class:`rayspec.pipeline.Transcriber` behind a continuous-batching engine; models load once and serve
    every batch. Start it with ``max_concurrency`` >= the batches in flight on it (each call waits on the engine).

    Batches are idempotent (same input, same rows), so Ray may retry them on a restarted actor and the writer
    de-duplicates by id.

    Args:
        kwargs: :class:`~rayspec.pipeline.Transcriber` arguments (target, draft, options, ctc, device, dtype, limits,
            encoder_dtype); threads: torch CPU threads (0 = torch's default); slots: most rows (speech segments)
            decoded at once.
    """

    def __init__(self, kwargs: dict, threads: int = 0, slots: int = 16) -> None:
        from rayspec.engine import TranscriptionEngine

        self.engine = TranscriptionEngine(lambda: build_transcriber(kwargs, threads), slots)

    def transcribe(self, utterances: list) -> list[dict]:
        """Result rows (dicts of :class:`rayspec.results.ResultRow`) of one batch of ``rayspec.manifest.Utterance``,
        in order, once its rows finish in the actor's continuous batch; a bad file or an utterance that fails alone
        is an error row (see :meth:`rayspec.pipeline.Transcriber.transcribe_stream`)."""
        rows, _ = self.engine.submit_batch(utterances).result()
        return [asdict(r) for r in rows]

    def node(self) -> str:
        """The id of the Ray node this actor runs on (also tells the driver its models are loaded)."""
        return ray.get_runtime_context().get_node_id()
