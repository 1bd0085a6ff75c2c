"""``rayspec bench --suite decoding``: the identity columns count right, the noisy clips are deterministic, and the
suite runs end to end on two bundled clips with whisper-tiny.en (peer rows skipped where their package is missing)."""

import csv
import importlib.util
import json
from importlib import resources

import numpy as np
import pytest

from rayspec.bench.decoding import FASTER, OPENAI, RAYSPEC, Output, Row, build_noisy, identical, score


def _row(engine, mode, tokens, texts, method="", decode_s=1.0, batch=1):
    return Row("main", engine, mode, batch, len(texts), 10.0, decode_s, Output(texts, tokens, [0.0] * len(texts)),
               method)


def test_identity_columns():
    assert identical([[1, 2], [3]], [[1, 2], [3]]) == 1.0
    assert identical([[1, 2], [3]], [[1, 2], [4]]) == 0.5
    assert identical([" a b", "c"], ["a b ", "d"]) == 0.5  # texts compared stripped
    assert identical(None, [[1]]) is None and identical([[1]], [[1], [2]]) is None
    ours = _row(RAYSPEC, "beam 5", [[1, 2], [3]], ["x", "y"], decode_s=2.0)
    spec = _row(RAYSPEC, "beam 5", [[1, 2], [4]], ["x", "z"], method="draft", decode_s=1.0)
    theirs = _row(OPENAI, "beam 5", [[1, 2], [3]], ["x", "y"])
    fw = _row(FASTER, "beam 5", [[9], [3]], ["x", "w"])
    greedy = _row(OPENAI, "greedy", [[5], [6]], ["x", "y"])
    rows = [ours, spec, theirs, fw, greedy]
    score(rows, ["x", "y"])
    assert ours.same_openai == 1.0 and theirs.same_openai == 1.0 and greedy.same_openai == 1.0  # itself: 100%
    assert spec.same_openai == 0.5 and fw.same_openai == 0.5
    assert ours.same_faster == 0.5 and fw.same_faster == 1.0 and greedy.same_faster is None  # no fw greedy row
    assert spec.same_beam == 0.5 and spec.speedup_beam == 2.0 and ours.same_beam is None
    assert ours.wer == 0.0 and spec.wer == 0.5


def test_noisy_clips_are_deterministic(tmp_path):
    from rayspec.audio import load_audio
    from rayspec.manifest import read_manifest

    rng = np.random.default_rng(0)
    utts = [type("U", (), {"id": f"u{i}", "text": f"text {i}"})() for i in range(3)]
    audios = [(0.1 * rng.standard_normal(16000 * (i + 1))).astype(np.float32) for i in range(3)]
    a = build_noisy(utts, audios, str(tmp_path / "a"), count=3, seed=1)
    b = build_noisy(utts, audios, str(tmp_path / "b"), count=3, seed=1)
    rows_a, rows_b = [json.loads(x) for x in open(a)], [json.loads(x) for x in open(b)]
    assert [r["id"] for r in rows_a] == [r["id"] for r in rows_b] and len(rows_a) == 3
    assert {r["noise"] for r in rows_a} == {"pink", "babble"}
    for ra, ua, ub in zip(rows_a, read_manifest(a), read_manifest(b)):  # audio paths relative to the manifest
        assert 0 <= ra["snr_db"] <= 5 and 2 <= ra["lead_s"] <= 4 and 2 <= ra["tail_s"] <= 4 and ra["duration_s"] < 30
        assert ua.text == ra["text"] and ua.audio != ub.audio
        assert np.array_equal(load_audio(ua.audio, 16000), load_audio(ub.audio, 16000))


def _tiny_installed():
    from rayspec.models.errors import ModelLoadError
    from rayspec.models.registry import resolve_model

    try:
        resolve_model("whisper-tiny.en")
        return True
    except ModelLoadError:
        return False


@pytest.mark.skipif(not _tiny_installed(), reason="whisper-tiny.en is not installed")
def test_suite_end_to_end_on_two_clips(tmp_path):
    from rayspec.cli import build_parser

    manifest = str(resources.files("rayspec").joinpath("samples", "manifest.jsonl"))
    out = tmp_path / "bench"
    args = build_parser().parse_args(
        ["bench", "--suite", "decoding", manifest, "--limit", "2", "--target", "whisper-tiny.en", "--threads", "2",
         "--compute-type", "float32", "--batch-sizes", "1", "2", "--clips", "2", "-o", str(out),
         "--models-dir", str(tmp_path / "models")])
    assert args.func(args) == 0
    for suffix in ("md", "csv", "png"):
        assert (out / f"bench-decoding.{suffix}").is_file()
    md = (out / "bench-decoding.md").read_text()
    assert md.startswith("# Decoding bench") and "Setup:" in md and "fallback on noisy speech" in md
    with open(out / "bench-decoding.csv") as f:
        rows = list(csv.DictReader(f))
    main = [r for r in rows if r["part"] == "main"]
    # rayspec: 3 modes x 2 batch sizes (no drafters are bundled for whisper-tiny.en, so no speculative rows)
    assert [(r["mode"], r["batch"]) for r in main if r["engine"] == RAYSPEC] == [
        (m, b) for m in ("greedy", "beam 5", "beam 5 + fallback") for b in ("1", "2")]
    assert all(r["clips"] == "2" and float(r["decode_s"]) > 0 and r["wer"] != "" for r in main)
    if importlib.util.find_spec("whisper") is not None:
        openai = [r for r in main if r["engine"] == OPENAI]
        assert [r["mode"] for r in openai] == ["greedy", "beam 5", "beam 5 + fallback"]
        assert all(float(r["tokens_identical_openai"]) == 1.0 for r in openai)  # a row against itself
        # rayspec's greedy and beam 5 are openai/whisper's on the same features (tests/test_beam.py)
        assert all(float(r["tokens_identical_openai"]) == 1.0 for r in main
                   if r["engine"] == RAYSPEC and r["mode"] in ("greedy", "beam 5"))
    if importlib.util.find_spec("faster_whisper") is not None:
        fw = [r for r in main if r["engine"] == FASTER]
        assert [(r["mode"], r["batch"]) for r in fw] == [("greedy", "1"), ("beam 5", "1"), ("beam 5 + fallback", "1"),
                                                         ("beam 5", "2")]
        assert all(float(r["texts_identical_faster_whisper"]) == 1.0 for r in fw if r["batch"] == "1")
    noisy = [r for r in rows if r["part"] == "noisy"]
    assert {r["mode"] for r in noisy} == {"greedy", "beam 5", "greedy + fallback", "beam 5 + fallback"}
    assert all(r["clips"] == "2" for r in noisy)
    assert len(list((out / "data" / "noisy").glob("*.wav"))) == 2


@pytest.mark.skipif(not _tiny_installed(), reason="whisper-tiny.en is not installed")
def test_rows_pick_the_main_rows_and_name_an_unknown_one(tmp_path):
    from rayspec.cli import build_parser

    manifest = str(resources.files("rayspec").joinpath("samples", "manifest.jsonl"))
    out = tmp_path / "bench"
    argv = ["bench", "--suite", "decoding", manifest, "--limit", "1", "--target", "whisper-tiny.en", "--threads", "2",
            "--compute-type", "float32", "--batch-sizes", "1", "2", "--sections", "main", "--repeats", "2", "-o",
            str(out), "--models-dir", str(tmp_path / "models")]
    args = build_parser().parse_args(argv + ["--rows", "rayspec beam 5"])
    assert args.func(args) == 0
    with open(out / "bench-decoding.csv") as f:
        assert [(r["engine"], r["mode"], r["batch"]) for r in csv.DictReader(f)] == [
            (RAYSPEC, "beam 5", "1"), (RAYSPEC, "beam 5", "2")]
    args = build_parser().parse_args(argv + ["--rows", "rayspec beam 7"])
    with pytest.raises(ValueError, match="no such row"):
        args.func(args)
