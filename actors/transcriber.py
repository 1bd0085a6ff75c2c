"""The colocated Ray actor: audio, encoder, drafter and target decoder in one process (a
:class:`rayspec.pipeline.Transcriber`).

The job's default on CPUs (``--actors colocated``): one process holds one copy of the model and runs both halves
with all its threads, where the split layout (``actors/drafter.py`` + ``actors/target.py``) needs two processes,
each with its own torch runtime, and an object-store hop for the encoder states; the split in exchange overlaps one
batch's encoder with another's decoder (whisper-base on all 286 LJSpeech clips, 2 CPUs: 2.1 against 2.9 GiB, 168
against 155 s; README). The split layout is the default for models on GPUs.
"""

from __future__ import annotations

from dataclasses import asdict

import ray


@ray.remote(max_restarts=3, max_task_retries=3)
class TranscriberActor:
    """Hosts a :class:`rayspec.pipeline.Transcriber`; models load once and serve every batch.

    Batches are idempotent (same input, same rows), so Ray may retry them on a restarted actor and the writer
    de-duplicates by id.

    Args:
        kwargs: :class:`~rayspec.pipeline.Transcriber` arguments (target, draft, options, ctc, device, dtype, limits,
            encoder_dtype); threads: torch CPU threads (0 = torch's default).
    """

    def __init__(self, kwargs: dict, threads: int = 0) -> None:
        import torch

        from rayspec.pipeline import Transcriber

        if threads:
            torch.set_num_threads(threads)
        self.transcriber = Transcriber(**kwargs)

    def transcribe(self, utterances: list) -> list[dict]:
        """Result rows (dicts of :class:`rayspec.results.ResultRow`) of one batch of ``rayspec.manifest.Utterance``;
        a bad file or an utterance that fails alone is an error row
        (see :meth:`rayspec.pipeline.Transcriber.transcribe`)."""
        return [asdict(r) for r in self.transcriber.transcribe(utterances)]

    def node(self) -> str:
        """The id of the Ray node this actor runs on (also tells the driver its models are loaded)."""
        return ray.get_runtime_context().get_node_id()
