"""Corpus runs: which batches are still to do, the run's summary, an utterance's internal-error row, and the
in-process loop (``rayspec transcribe``). Imports no model code, so a Ray job's driver (which only plans batches and
writes rows) starts without torch."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional

from .batching import BatchBudget, budget_for_model, plan_batches
from .manifest import Utterance, estimated_seconds
from .results import ResultRow, ResultWriter


def internal_error_row(u: Utterance, exc: BaseException, method: str) -> ResultRow:
    """The row of an utterance whose decoding raised on its own (error code "internal")."""
    return ResultRow(id=u.id, corpus=u.corpus, audio=u.audio, reference=u.text, duration_s=u.duration_s,
                     method=method, error=f"{type(exc).__name__}: {exc}"[:2000], error_code="internal")


def budget_rows(budget: BatchBudget, target) -> int:
    """Rows of the target's whole window that ``budget`` holds in one batch (:meth:`BatchBudget.rows
    <rayspec.batching.BatchBudget.rows>` with the encoder geometry of ``target``, a
    :class:`~rayspec.models.whisper.WhisperASR`): the part size of a long recording's windows
    (:meth:`~rayspec.pipeline.Drafter.encode_parts`)."""
    return budget_for_model(budget, target.config).rows(target.max_audio_seconds)


def stream_slots(batches: list[list[Utterance]], rows: int, window_s: float) -> int:
    """The continuous batch's slots for ``batches``: the most rows one planned batch decodes, a row per utterance
    and for a recording longer than ``window_s`` seconds its estimated windows
    (:func:`~rayspec.manifest.estimated_seconds`), those of one batch up to ``rows`` (e.g. :func:`budget_rows`)."""
    windows = lambda b: sum(max(1, -(-int(estimated_seconds(u)) // int(window_s))) for u in b)  # noqa: E731
    return max((max(len(b), min(rows, windows(b))) for b in batches), default=1)


def pending_batches(utterances: list[Utterance], writer: ResultWriter, budget: BatchBudget) -> list[list[Utterance]]:
    """Length-sorted token-budget batches of the utterances not yet in ``writer``'s output."""
    todo = [u for u in utterances if u.id not in writer.done_ids]
    return plan_batches(todo, [estimated_seconds(u) for u in todo], budget)


@dataclass
class RunSummary:
    """What a corpus run did: rows written this run, failures, audio seconds, wall seconds (decoding; model loading
    and actor start-up, where measured, in ``startup_s``)."""

    written: int = 0
    failed: int = 0
    skipped: int = 0
    audio_s: float = 0.0
    wall_s: float = 0.0
    startup_s: float = 0.0
    failures: list = field(default_factory=list)

    @property
    def rtfx(self) -> float:
        return self.audio_s / self.wall_s if self.wall_s else 0.0

    def add(self, rows: Iterable[ResultRow]) -> None:
        for r in rows:
            self.written += 1
            if r.error:
                self.failed += 1
                self.failures.append((r.id, r.error))
            else:
                self.audio_s += r.duration_s or 0.0


def run_corpus(
    utterances: list[Utterance],
    transcriber,
    output: str,
    budget: Optional[BatchBudget] = None,
    progress: Optional[Callable[[int], None]] = None,
    continuous: bool = True,
) -> RunSummary:
    """Transcribe a corpus in-process into ``output`` (resuming), then merge the results file.

    Args:
        transcriber: a :class:`~rayspec.pipeline.Transcriber` (its models loaded).
        budget: batch budget; default :class:`BatchBudget` for the transcriber's target
            (:func:`~rayspec.batching.budget_for_model`).
        continuous: continuous batching (:meth:`Transcriber.transcribe_stream`, longest batches first, as many
            rows at once as the largest planned batch); False decodes the planned batches one after another.

    Raises:
        OutputLockedError: another live job writes ``output``.
    """
    writer = ResultWriter(output)
    try:
        budget = budget or budget_for_model(BatchBudget(), transcriber.target.config)
        batches = pending_batches(utterances, writer, budget)
        summary = RunSummary(skipped=len(utterances) - sum(len(b) for b in batches))
        t0 = time.perf_counter()
        part_rows = budget_rows(budget, transcriber.target)  # a long recording's windows, that many at a time
        if continuous and batches:
            # Longest first: later rows are shorter, so their cross-attention fits the first rows' cache.
            batches = batches[::-1]
            slots = stream_slots(batches, part_rows, transcriber.target.max_audio_seconds)
            done = transcriber.transcribe_stream(((b, None) for b in batches), slots, part_rows)
        else:
            done = ((k, transcriber.transcribe(b, part_rows=part_rows)) for k, b in enumerate(batches))
        for k, rows in done:
            writer.write(rows)
            summary.add(rows)
            if progress:
                progress(len(batches[k]))
        summary.wall_s = time.perf_counter() - t0
        writer.finalize()
    finally:
        writer.close()
    return summary
