"""Length-sorted, token-budget batching (the SSD paper's section 3.2; vLLM-style budgets instead of a fixed batch size).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class BatchBudget:
    """Budget of one batch in tokens: ``rows * (padded encoder frames + expected decoder tokens)``.

    Attributes:
        tokens: the budget. With 25 encoder positions and ~15 characters per second of audio, 16,000 tokens hold
            about 16 utterances of 40 s of audio each, or 160 of 4 s.
        max_rows: hard cap on rows per batch.
        frames_per_second: encoder positions per second of audio (model dependent).
        tokens_per_second: expected decoder tokens per second of audio.
    """

    tokens: int = 16000
    max_rows: int = 64
    frames_per_second: float = 25.0
    tokens_per_second: float = 15.0

    def cost(self, seconds: float) -> float:
        return seconds * (self.frames_per_second + self.tokens_per_second)


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
