"""``rayspec bench`` (spec/ssd/medusa suites): repeats run round-robin over the configurations; rows count exactly."""

from rayspec.bench import asr as bench
from rayspec.bench.asr import SPEC_ABLATION, run_bench
from tiny import random_audio


def test_repeats_go_round_robin_and_rows_match_ar(tiny_target, tiny_draft, monkeypatch):
    calls = []
    real_run = bench._run

    def recording_run(name, options, models, audios, durations, batches):
        calls.append((name, len(batches)))
        return real_run(name, options, models, audios, durations, batches)

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
