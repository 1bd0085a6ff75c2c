import pytest

from types import SimpleNamespace

from rayspec.batching import BatchBudget, budget_for_model, guided_split, plan_batches
from rayspec.results import SCHEMA, ResultRow, ResultWriter, read_results


def test_plan_batches_sorted_under_budget():
    secs = [5.0, 1.0, 3.0, 1.0, 10.0, 2.0]
    budget = BatchBudget(tokens=200, max_rows=3, frames_per_second=25, tokens_per_second=15)
    batches = plan_batches(list(range(6)), secs, budget)
    assert sorted(i for b in batches for i in b) == list(range(6))
    flat = [secs[i] for b in batches for i in b]
    assert flat == sorted(flat)
    for b in batches:
        assert len(b) <= 3
        assert len(b) == 1 or len(b) * budget.cost(max(secs[i] for i in b)) <= 200


def test_fixed_window_models_pay_their_whole_window_per_row():
    """A stock Whisper pads every row to 1,500 encoder positions: the default budget holds ~15 rows of short clips
    (not the 64-row cap a per-second estimate gave: 5 GB for whisper-base), a masked model's rows follow the audio."""
    stock = budget_for_model(BatchBudget(), SimpleNamespace(max_source_positions=1500))
    secs = [3.0] * 100
    assert max(len(b) for b in plan_batches(list(range(100)), secs, stock)) == 15
    assert stock.cost(3.0) == stock.cost(0.5) + 2.5 * stock.tokens_per_second  # the window does not shrink
    masked = budget_for_model(BatchBudget(), SimpleNamespace(max_source_positions=1500, rayspec_encoder_masking=True,
                                                             rayspec_frame_stack=2))
    assert masked.window_positions == 0 and masked.frames_per_second == 25.0
    assert max(len(b) for b in plan_batches(list(range(100)), secs, masked)) == 64


def test_plan_batches_length_mismatch():
    with pytest.raises(ValueError):
        plan_batches([1, 2], [1.0], BatchBudget())


def test_guided_split_cuts_the_tail_batches():
    """Whole batches while plenty remain, then at most ceil(remaining / in_flight) rows, down to single rows; every
    row once, in order."""
    rows = list(range(286))
    batches = guided_split([rows[i : i + 8] for i in range(0, 286, 8)], 8)
    assert [r for b in batches for r in b] == rows
    sizes = [len(b) for b in batches]
    assert sizes[:29] == [8] * 29 and sizes[-8:] == [1] * 8  # 64 rows left after 29 batches: then an eighth of them
    left = 286
    for n in sizes:
        assert n <= -(-left // 8)
        left -= n
    assert guided_split([[1, 2, 3, 4, 5]], 2) == [[1, 2, 3], [4], [5]] and guided_split([], 2) == []
    assert guided_split([[1, 2], [3, 4, 5, 6]], 1) == [[1, 2], [3, 4, 5, 6]]
    with pytest.raises(ValueError):
        guided_split([[1]], 0)


def test_writer_resumes_and_deduplicates(tmp_path):
    out = str(tmp_path / "r.parquet")
    w = ResultWriter(out)
    w.write([ResultRow("a", text="x"), ResultRow("b", text="y")])
    # killed here: shards exist, no merged file; a new writer sees the ids
    w2 = ResultWriter(out)
    assert w2.done_ids == {"a", "b"}
    w2.write([ResultRow("b", text="dup"), ResultRow("c", text="z")])
    table = w2.finalize()
    assert sorted(table.column("id").to_pylist()) == ["a", "b", "c"]
    assert table.schema.equals(SCHEMA)
    w3 = ResultWriter(out)
    w3.write([ResultRow("d")])
    assert sorted(w3.finalize().column("id").to_pylist()) == ["a", "b", "c", "d"]
    assert len(read_results(out)) == 4
