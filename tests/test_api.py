"""The one-call Python API: rayspec.load(...).transcribe(...) on paths and arrays, one or many, per-call options."""

import numpy as np
import pytest

import rayspec
from rayspec.audio import load_audio
from rayspec.manifest import read_manifest


@pytest.fixture(scope="module")
def model():
    from rayspec.models.errors import ModelLoadError

    try:
        return rayspec.load("whisper-tiny.en", method="ar", compute_type="float32")
    except ModelLoadError as e:
        pytest.skip(str(e))


def test_a_path_an_array_and_a_list_give_the_cli_texts(model, samples_manifest, tmp_path):
    from rayspec.cli import main

    utts = read_manifest(samples_manifest)[:3]
    out = tmp_path / "out.parquet"
    assert main(["transcribe", samples_manifest, "-o", str(out), "--target", "whisper-tiny.en", "-q",
                 "--compute-type", "float32"]) == 0
    import pyarrow.parquet as pq

    cli = {r["id"]: r["text"] for r in pq.read_table(str(out)).to_pylist()}
    one = model.transcribe(utts[0].audio)
    assert isinstance(one, rayspec.api.Transcription) and one.text == cli[utts[0].id] and one.error is None
    wave = load_audio(utts[1].audio, 16000)
    many = model.transcribe([utts[0].audio, wave, utts[2].audio])
    assert [m.text for m in many] == [cli[u.id] for u in utts]
    assert model.compute_type == "float32" and many[1].compute_type == "float32"


def test_per_call_options_and_their_errors(model, samples_manifest):
    utt = read_manifest(samples_manifest)[0]
    timed = model.transcribe(utt.audio, timestamps="word")
    assert timed.words and timed.segments and all(w.end >= w.start for w in timed.words)
    assert not model.transcribe(utt.audio).words  # the per-call option does not stick
    with pytest.raises(ValueError, match="unknown decoding options"):
        model.transcribe(utt.audio, vad_filter=True)  # faster-whisper's, not ours
    with pytest.raises(ValueError, match="loaded for method 'ar'"):
        model.transcribe(utt.audio, method="draft")
    bad = model.transcribe(np.zeros(0, dtype=np.float32))
    assert bad.text == "" and (bad.error or bad.route == "no_speech")
