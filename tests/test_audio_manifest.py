import json

import numpy as np
import pytest
import soundfile as sf

from rayspec.audio import AudioError, AudioLimits, AudioTooLargeError, load_audio
from rayspec.manifest import ManifestError, read_manifest


def _tone(seconds, rate, channels=1):
    t = np.arange(int(seconds * rate)) / rate
    x = 0.3 * np.sin(2 * np.pi * 440 * t).astype(np.float32)
    return np.stack([x] * channels, axis=1) if channels > 1 else x


def test_stereo_44k_downmixed_and_resampled(tmp_path):
    p = tmp_path / "s.wav"
    sf.write(p, _tone(1.0, 44100, 2), 44100)
    a = load_audio(p, 16000)
    assert a.dtype == np.float32 and a.ndim == 1 and abs(len(a) - 16000) <= 2


def test_8k_flac_upsampled(tmp_path):
    p = tmp_path / "s.flac"
    sf.write(p, _tone(0.5, 8000), 8000)
    assert abs(len(load_audio(p, 16000)) - 8000) <= 2


@pytest.mark.parametrize("content", [b"", b"this is a text file, not audio\n", b"fLaC\x00\x00\x00\x22garbage" * 10])
def test_bad_files_raise_audio_error(tmp_path, content):
    p = tmp_path / "bad.wav"
    p.write_bytes(content)
    with pytest.raises(AudioError):
        load_audio(p)


def test_missing_file(tmp_path):
    with pytest.raises(AudioError, match="not found"):
        load_audio(tmp_path / "nope.wav")


def test_limits(tmp_path):
    p = tmp_path / "long.wav"
    sf.write(p, _tone(3.0, 16000), 16000)
    with pytest.raises(AudioTooLargeError, match="over the limit"):
        load_audio(p, limits=AudioLimits(max_seconds=2.0))
    with pytest.raises(AudioTooLargeError, match="bytes"):
        load_audio(p, limits=AudioLimits(max_bytes=1000))


def test_manifest_formats_resolve_relative_paths(tmp_path):
    sf.write(tmp_path / "a.wav", _tone(0.2, 16000), 16000)
    rows = [{"id": "u1", "audio": "a.wav", "text": "HELLO"}, {"id": "u2", "audio": str(tmp_path / "a.wav")}]
    (tmp_path / "m.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    (tmp_path / "m.csv").write_text("id,audio,text\nu1,a.wav,HELLO\nu2,a.wav,\n")
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "m.parquet")
    for name in ("m.jsonl", "m.csv", "m.parquet"):
        utts = read_manifest(tmp_path / name)
        assert [u.id for u in utts] == ["u1", "u2"]
        assert utts[0].audio == str(tmp_path / "a.wav") and utts[0].text == "HELLO"


def test_manifest_folder_and_errors(tmp_path):
    (tmp_path / "sub").mkdir()
    sf.write(tmp_path / "sub" / "x.flac", _tone(0.2, 16000), 16000)
    (tmp_path / "sub" / "x.txt").write_text("REF\n")
    utts = read_manifest(tmp_path)
    assert [(u.id, u.text) for u in utts] == [("sub/x", "REF")]
    (tmp_path / "dup.jsonl").write_text('{"id": "a", "audio": "x"}\n{"id": "a", "audio": "y"}\n')
    with pytest.raises(ManifestError, match="duplicate"):
        read_manifest(tmp_path / "dup.jsonl")
    (tmp_path / "bad.jsonl").write_text('{"audio": "x"}\n')
    with pytest.raises(ManifestError, match="lacks"):
        read_manifest(tmp_path / "bad.jsonl")


def test_one_audio_file_is_a_manifest_of_one(tmp_path):
    import numpy as np
    import soundfile as sf

    from rayspec.manifest import read_manifest

    sf.write(tmp_path / "hello.wav", np.zeros(1600, dtype=np.float32), 16000)
    (tmp_path / "hello.txt").write_text("HELLO\n")
    [u] = read_manifest(tmp_path / "hello.wav")
    assert (u.id, u.text, u.audio) == ("hello", "HELLO", str(tmp_path / "hello.wav"))
