"""Length-sorted, token-budget batching (the SSD paper's section 3.2; vLLM-style budgets instead of a fixed batch size).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class BatchBudget:
    """Budget of one batch in tokens: ``rows * (padded encoder positions + expected decoder tokens)``.

    Attributes:
        tokens: the budget. A stock Whisper pads every row to its 30 s window (1,500 encoder positions), so 24,000
            tokens hold about 15 rows of short clips (whisper-base: about 40 MB of decoder cache per row in
            float32, computed from its shapes); a model with a masked encoder at 25 positions and ~15 characters
            per second holds 15 rows of 40 s or 150 of 4 s.
        max_rows: hard cap on rows per batch.
        frames_per_second: encoder positions per second of audio, for a model whose encoder length follows the
            audio (see :func:`budget_for_model`).
        tokens_per_second: expected decoder tokens per second of audio.
        window_positions: encoder positions of every row of a fixed-window model (0: they follow the audio).
    """

    tokens: int = 24000
    max_rows: int = 64
    frames_per_second: float = 25.0
    tokens_per_second: float = 15.0
    window_positions: int = 0

    def cost(self, seconds: float) -> float:
        """Budget tokens of one row of ``seconds`` of audio."""
        positions = self.window_positions or seconds * self.frames_per_second
        return positions + seconds * self.tokens_per_second

    def rows(self, seconds: float) -> int:
        """Most rows of ``seconds`` of audio each that one batch holds: ``tokens // cost(seconds)``, at least 1, at
        most ``max_rows`` (whisper-base's 30 s windows under the default budget: 12)."""
        return min(self.max_rows, max(1, int(self.tokens // self.cost(seconds))))


def budget_for_model(budget: BatchBudget, config) -> BatchBudget:
    """``budget`` with the encoder geometry of a Whisper-architecture model ``config`` (a transformers config):
    a stock Whisper encodes a fixed window of ``max_source_positions`` positions whatever the audio's length; a
    model with rayspec's encoder masking has ``50 / frame_stack`` positions per second of audio."""
    if getattr(config, "rayspec_encoder_masking", False):
        return replace(budget, window_positions=0, frames_per_second=50.0 / getattr(config, "rayspec_frame_stack", 1))
    return replace(budget, window_positions=int(config.max_source_positions))


def plan_batches(items: Sequence[T], seconds: Sequence[float], budget: BatchBudget) -> list[list[T]]:
    """Sort items by duration and cut them into batches whose padded cost stays under the budget.

    A batch's cost is ``len(batch) * cost(longest item)`` since rows pad to the longest. An item over the budget on
    its own still gets a batch of one.

    Args:
        items: anything (utterances, indices).
        seconds: duration of each item in seconds (unknown durations may be given as 0).

    Returns:
        Batches in increasing-duration order; every item appears exactly once.

    Raises:
        ValueError: ``items`` and ``seconds`` differ in length.
    """
    if len(items) != len(seconds):
        raise ValueError(f"{len(items)} items but {len(seconds)} durations")
    order = sorted(range(len(items)), key=lambda i: seconds[i])
    batches: list[list[T]] = []
    cur: list[int] = []
    for i in order:
        longest = max([seconds[j] for j in cur] + [seconds[i]])
        if cur and (len(cur) + 1 > budget.max_rows or (len(cur) + 1) * budget.cost(longest) > budget.tokens):
            batches.append([items[j] for j in cur])
            cur = []
        cur.append(i)
    if cur:
        batches.append([items[j] for j in cur])
    return batches


def guided_split(batches: Sequence[Sequence[T]], in_flight: int) -> list[list[T]]:
    """``batches`` (in hand-out order) with the last ones cut smaller, for workers that each hold several batches at
    once: a batch keeps its rows while plenty remain, and is cut to at most ``ceil(remaining / in_flight)`` rows
    towards the end, down to single rows (guided self-scheduling: Polychronopoulos and Kuck, "Guided
    self-scheduling", IEEE Trans. Computers 36(12), 1987). The workers then run dry within about one row of each
    other instead of one whole batch (a CPU transcriber spends about the same on every row: the encoder's 30-s
    window). Order and rows are kept; only batch boundaries are added.

    Args:
        batches: the planned batches (lists of rows); in_flight: batches held by all workers together (workers x
            batches each).

    Returns:
        The batches, the tail ones split; every row once, in the same order.

    Raises:
        ValueError: ``in_flight`` below 1.
    """
    if in_flight < 1:
        raise ValueError(f"in_flight must be >= 1, got {in_flight}")
    remaining = sum(len(b) for b in batches)
    out: list[list[T]] = []
    for batch in batches:
        rows = list(batch)
        while rows:
            n = min(len(rows), -(-remaining // in_flight))
            out.append(rows[:n])
            rows, remaining = rows[n:], remaining - n
    return out
