"""The synthesis Ray actor: TTS target + draft + Lyra codec, loaded once, synthesising chunks of texts.

The TTS draft is an MLP costing a small fraction of a target step (see ``rayspec/models/speech_lm.py``), so it runs
inside the target's actor: a draft on its own actor would cost one remote call per round, more than the draft
itself. (The ASR job keeps its drafter actors: there the drafter also runs the audio front end and the encoder.)
"""

from __future__ import annotations

import ray


@ray.remote(max_restarts=3, max_task_retries=3)
class SynthesisActor:
    """Hosts a :class:`rayspec.tts.synthesis.Synthesizer`. Chunks are idempotent (same seed, same audio), so Ray may
    retry them on a restarted actor and the writer de-duplicates by id.

    Args:
        models: ``{"target", "draft", "codec"}`` directories (None: the bundled zoo); device: torch device;
        threads: torch CPU threads.
    """

    def __init__(self, models: dict, device: str = "cpu", threads: int = 1) -> None:
        from rayspec.tts.synthesis import Synthesizer

        self.synth = Synthesizer(models.get("target"), models.get("draft"), models.get("codec"), device, threads)

    def synthesize(self, items: list, opts, seed: int, fmt: str, speed: float, batch_size: int) -> list:
        """:func:`rayspec.tts.synthesis.synthesize_chunk` over ``items`` (TextItem list)."""
        from rayspec.tts.synthesis import synthesize_chunk

        return synthesize_chunk(self.synth, items, opts, seed, fmt, speed, batch_size)

    def node(self) -> str:
        """The id of the Ray node this actor runs on (also tells the driver its models are loaded)."""
        return ray.get_runtime_context().get_node_id()
