"""A long recording's windows go through the encoder and the decoder a part at a time (Drafter.encode_parts): the
same rows as all at once, its timestamps offset by each window's start; the VAD's cuts found a block at a time."""

from dataclasses import asdict

import numpy as np
import pytest

import rayspec.vad
from rayspec.audio import load_audio
from rayspec.manifest import Utterance, read_manifest
from rayspec.methods import DecodeOptions
from rayspec.pipeline import Transcriber
from rayspec.runs import stream_slots
from rayspec.vad import SegmentOptions, segments
from tiny import make_noisy_copy, make_tiny


@pytest.fixture(scope="module")
def ts_models(tmp_path_factory):
    """A tiny target with timestamp tokens (a 5 s window) and a draft beside it: their directories."""
    target = make_tiny(tmp_path_factory.mktemp("ts_target"), timestamps=150, seed=0)
    draft = make_noisy_copy(target, tmp_path_factory.mktemp("ts_draft"), noise=0.15)
    return target.model.name_or_path, draft.model.name_or_path


@pytest.fixture(scope="module")
def recordings(samples_manifest):
    """A ~33 s recording (the bundled clips with 0.5 s pauses: many 5 s windows) and a short clip."""
    clips = [load_audio(u.audio) for u in read_manifest(samples_manifest)]
    gap = np.zeros(8000, np.float32)
    return np.concatenate([x for c in clips for x in (c, gap)]), clips[0]


SCORES = ("no_speech_prob", "avg_logprob")  # float sums over rows batched differently: equal to rounding


def _rows(rows):
    """The rows but their wall time, words without their probabilities, and the scores apart (approximately equal)."""
    out = []
    for r in map(asdict, rows):
        words = [{k: v for k, v in w.items() if k != "probability"} for w in r["words"] or []]
        probs = [w["probability"] for w in r["words"] or []]
        exact = {k: v for k, v in r.items() if k not in ("decode_s", "words", *SCORES)}
        out.append((exact, words, [r[k] for k in SCORES] + probs))
    return out


def _same(rows, expected):
    assert [r[:2] for r in rows] == [e[:2] for e in expected]
    assert [r[2] for r in rows] == [pytest.approx(e[2], rel=1e-4, abs=1e-6) for e in expected]


@pytest.mark.parametrize("method,timestamps", [("ar", "segment"), ("ar", "word"), ("draft", "segment")])
def test_long_recording_in_parts_equals_one_part(ts_models, recordings, method, timestamps):
    """Parts of 2 and 3 rows, batch by batch and continuous, give one part's rows: texts, counters, segments and
    words, their times offset by each window's start (a later part's segments continue the earlier ones')."""
    target, draft = ts_models
    options = DecodeOptions(method=method, timestamps=timestamps, max_tokens_per_second=4)
    t = Transcriber(target, draft if method == "draft" else None, options)
    utts = [Utterance("long", "<long>"), Utterance("short", "<short>")]
    audios = list(recordings)
    parts = list(t.drafter.encode_parts(utts, audios, 2))
    assert len(parts) >= 4 and [p.part for p in parts] == list(range(len(parts)))
    assert {p.parts for p in parts} == {len(parts)} and all(len(p.owners) <= 2 for p in parts)
    whole = _rows(t.transcribe(utts, audios, part_rows=1000))
    assert whole[0][0]["text"] and whole[0][0]["duration_s"] > 30
    starts = [s["start_s"] for s in whole[0][0]["segments"]]
    assert max(starts) > 25  # offset to the recording's time
    _same(_rows(t.transcribe(utts, audios, part_rows=2)), whole)
    streamed = dict(t.transcribe_stream(iter([(utts, audios)]), slots=3, part_rows=2))
    _same(_rows(streamed[0]), whole)
    _same(_rows(t.transcribe(utts[:1], audios[:1], part_rows=3)), whole[:1])


def test_slots_count_a_long_recordings_windows(tmp_path):
    short, long_ = Utterance("a", "a.wav", duration_s=4.0), Utterance("b", "b.wav", duration_s=7200.0)
    assert stream_slots([[short] * 5], 12, 30.0) == 5
    assert stream_slots([[long_], [short] * 3], 12, 30.0) == 12
    assert stream_slots([[Utterance("c", "c.wav", duration_s=61.0)]], 12, 30.0) == 3


def test_vad_cuts_a_block_at_a_time_as_all_at_once(recordings, monkeypatch):
    audio = recordings[0]
    options = SegmentOptions(max_seconds=5.0)
    cuts = segments(audio, 16000, options)
    monkeypatch.setattr(rayspec.vad, "BLOCK_FRAMES", 10 ** 9)
    assert segments(audio, 16000, options) == cuts
    monkeypatch.setattr(rayspec.vad, "BLOCK_FRAMES", 7)
    assert segments(audio, 16000, options) == cuts and len(cuts) > 5
