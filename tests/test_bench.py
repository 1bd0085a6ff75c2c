"""``rayspec bench`` (spec/ssd/medusa/methods suites): repeats run round-robin over the configurations; rows count
exactly; a run's time splits into the drafting side and the target side."""

from rayspec.bench import asr as bench
from rayspec.bench.asr import CONTINUOUS, SPEC_ABLATION, BenchRow, run_bench
from tiny import random_audio


def test_repeats_go_round_robin_and_rows_match_ar(tiny_target, tiny_draft, monkeypatch):
    calls = []
    real_run = bench._run

    def recording_run(name, options, models, audios, durations, batches, timings):
        calls.append((name, len(batches)))
        return real_run(name, options, models, audios, durations, batches, timings)

    monkeypatch.setattr(bench, "_run", recording_run)
    configs = [c for c in SPEC_ABLATION if c[0] in ("ar", "fixed-4")]
    audios = random_audio(3, seed=5)
    rows = run_bench((tiny_target, tiny_draft, None), audios, None, configs, batch_sizes=(2,), progress=False,
                     repeats=2)
    # warm-ups on the first batch, then every configuration once per repeat, in turn
    assert [name for name, _ in calls] == ["ar", "fixed-4", "ar", "fixed-4", "ar", "fixed-4"]
    assert [n for _, n in calls[:2]] == [1, 1] and all(n == 2 for _, n in calls[2:])
    ar, draft = rows
    assert (ar.config, draft.config) == ("ar", "fixed-4")
    assert draft.identical_to_ar == draft.utterances == 3 and ar.speedup == 1.0
    assert draft.nfe_per_utt <= ar.nfe_per_utt and draft.speedup == ar.wall_s / draft.wall_s
    for r in rows:  # the counted run's split: both sides timed, within its wall time
        assert 0 < r.encode_s and 0 < r.decode_s and r.encode_s + r.decode_s <= r.wall_s


def test_continuous_runs_split_their_time_too(tiny_target, tiny_draft):
    configs = [c for c in SPEC_ABLATION if c[0] in ("ar", "ar" + CONTINUOUS)]
    rows = run_bench((tiny_target, tiny_draft, None), random_audio(3, seed=6), None, configs, batch_sizes=(2,),
                     progress=False)
    plain, continuous = rows
    assert continuous.identical_to_ar == 3
    assert 0 < continuous.encode_s and 0 < continuous.decode_s
    assert continuous.encode_s + continuous.decode_s <= continuous.wall_s


def test_methods_table_reports_the_encoder_bound():
    ar = BenchRow("ar", 1, 10, 60.0, 10.0, 20.0, 0.0, 1.0, 0.0, 10, encode_s=6.0, decode_s=4.0, speedup=1.0)
    fast = BenchRow("draft", 1, 10, 60.0, 8.0, 5.0, 20.0, 4.0, 0.6, 10, encode_s=6.0, decode_s=2.0, speedup=1.25)
    cells = dict(zip(bench.HEADERS["methods"], bench._cells(fast, "methods", ar)))
    # a free decoder would give 10 / 6 = 1.67x; 1.25x reaches (1.25 - 1) / (1.67 - 1) of it
    assert cells["bound (free decode)"] == "1.67x" and cells["share of bound"] == f"{100 * 0.25 / (10 / 6 - 1):.0f}%"
    assert cells["decode speed-up vs AR"] == "2.00x"
    assert dict(zip(bench.HEADERS["methods"], bench._cells(ar, "methods", ar)))["share of bound"] == "-"


def test_end_to_end_table_reads_both_summaries_and_sums_rounds():
    from jobs.ray_e2e import SUMMARY, summary

    job = "99 utterances written (0 already done), 0 failed, 649.1 s of audio in 33.3 s after 5.4 s of start-up (RTFx 19.5)"
    local = "99 utterances written (0 already done), 0 failed, 649.1 s of audio in 36.5 s (RTFx 17.8) -> x.parquet"
    assert SUMMARY.search(job).groups() == ("99", "649.1", "33.3", "5.4")
    assert SUMMARY.search(local).groups() == ("99", "649.1", "36.5", None)
    rows = [{"config": c, "end_to_end_s": e, "transcribe_s": t, "startup_s": s, "other_s": e - t - s}
            for c, e, t, s in (("in-process", 40.0, 36.0, 0.0), ("ray job submit", 50.0, 33.0, 5.0),
                               ("ray job submit", 46.0, 32.0, 5.0), ("in-process", 42.0, 37.0, 0.0))]
    table = summary(rows)
    assert table[2].startswith("| in-process | 82.0 |") and table[2].endswith("| 1.00x |")
    assert table[3] == "| ray job submit | 96.0 | 65.0 | 10.0 | 21.0 | 1.17x |"
