"""Audio through FFmpeg (the media extra: PyAV, or an ffmpeg executable): the formats users have, made here with PyAV's
encoders; damaged files and videos without sound; Parquet manifests that hold the audio's bytes (Hugging Face's
export), through the CLI, the Ray job and the Ray Data pipeline."""

import io
import json
import os
import shutil
from importlib import resources

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import soundfile as sf

import rayspec.audio
from rayspec.audio import AudioError, load_audio
from rayspec.bench.media import FORMATS, encode
from rayspec.manifest import read_manifest

av = pytest.importorskip("av")

CLIP = str(resources.files("rayspec").joinpath("samples", "ljspeech", "LJ002-0092.flac"))  # 4.9 s at 22.05 kHz


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    """A folder with one LJSpeech clip as WAV and in each of :data:`FORMATS`."""
    root = tmp_path_factory.mktemp("media")
    samples, rate = sf.read(CLIP, dtype="float32")
    sf.write(root / "clip.wav", samples, rate)
    for kind, (suffix, *_) in FORMATS.items():
        (root / f"{kind}{suffix}").write_bytes(encode(samples, rate, kind))
    return root


def _path(media, kind):
    return media / f"{kind}{FORMATS[kind][0]}"


@pytest.fixture(params=["pyav", "ffmpeg"])
def decoder(request):
    """Each FFmpeg route: PyAV, and an ffmpeg executable on PATH (skipped where there is none; CI installs one and
    sets RAYSPEC_REQUIRE_FFMPEG=1, so that a missing one fails there instead)."""
    if request.param == "ffmpeg" and not shutil.which("ffmpeg"):
        assert os.environ.get("RAYSPEC_REQUIRE_FFMPEG") != "1", "RAYSPEC_REQUIRE_FFMPEG=1 but no ffmpeg on PATH"
        pytest.skip("no ffmpeg executable on PATH")
    return request.param


@pytest.mark.parametrize("kind", FORMATS)
def test_every_format_decodes_as_the_wav(media, decoder, kind):
    """m4a/AAC, webm/Opus, an mp4 video's AAC track, mp3 and stereo 44.1 kHz m4a: mono 16 kHz float32, the WAV's
    samples within the codec's loss; from a path and from an upload's bytes (Serve's way)."""
    wav = load_audio(media / "clip.wav")
    path = _path(media, kind)
    upload = io.BytesIO(path.read_bytes())
    upload.name = path.name
    for audio in (load_audio(path, decoder=decoder), load_audio(upload, decoder=decoder)):
        assert audio.dtype == np.float32 and audio.ndim == 1
        assert abs(len(audio) - len(wav)) < 0.1 * 16000  # the codec's padding at most
        n = min(len(audio), len(wav))
        assert np.dot(audio[:n], wav[:n]) / (np.linalg.norm(audio[:n]) * np.linalg.norm(wav[:n])) > 0.95


def test_truncated_file_is_undecodable_with_the_reason(media, decoder, tmp_path):
    data = _path(media, "m4a").read_bytes()
    cut = tmp_path / "cut.m4a"
    cut.write_bytes(data[: len(data) // 2])  # the index (moov) sits at the end: gone
    with pytest.raises(AudioError) as err:
        load_audio(cut, decoder=decoder)
    assert err.value.code == "undecodable" and str(cut) in str(err.value) and "\n" not in str(err.value)
    garbage = tmp_path / "garbage.webm"
    garbage.write_bytes(b"\x1a\x45\xdf\xa3" + bytes(range(256)) * 40)
    with pytest.raises(AudioError, match="cannot decode audio") as err:
        load_audio(garbage, decoder=decoder)
    assert err.value.code == "undecodable"


def test_video_without_audio_says_so(decoder, tmp_path):
    path = tmp_path / "silent.mp4"
    with av.open(str(path), "w") as out:
        video = out.add_stream("mpeg4", rate=10)
        video.width = video.height = 64
        video.pix_fmt = "yuv420p"
        for k in range(10):
            frame = av.VideoFrame.from_ndarray(np.zeros((64, 64, 3), np.uint8), format="rgb24")
            frame.pts = k
            out.mux(video.encode(frame))
        out.mux(video.encode(None))
    with pytest.raises(AudioError, match="no audio stream") as err:
        load_audio(path, decoder=decoder)
    assert err.value.code == "undecodable"


def test_without_ffmpeg_the_error_names_the_extra(media, monkeypatch):
    monkeypatch.setattr(rayspec.audio, "_decoders", lambda: [rayspec.audio.DECODERS["libsndfile"]])
    with pytest.raises(AudioError, match=r"pip install 'rayspec\[media\]'") as err:
        load_audio(_path(media, "m4a"))
    assert err.value.code == "undecodable" and "\n" not in str(err.value)
    assert len(load_audio(media / "clip.wav")) > 0  # libsndfile's formats need nothing more


@pytest.mark.parametrize("decoder", ["libsndfile", "pyav"])
def test_long_audio_is_streamed_into_one_buffer(tmp_path, monkeypatch, decoder):
    """Decoding and resampling chunk by chunk (chunks made small here) gives the samples of one-shot resampling
    (soxr), and the duration limit is checked as chunks arrive."""
    import soxr

    monkeypatch.setattr(rayspec.audio, "CHUNK_FRAMES", 1 << 14)
    rate = 22050
    x = (0.1 * np.sin(np.arange(rate * 9) * 0.01)).astype(np.float32)  # 9 s: 13 chunks
    sf.write(tmp_path / "long.flac", np.stack([x, x], axis=1), rate)
    expected = soxr.resample(x, rate, 16000, quality="HQ")
    np.testing.assert_allclose(load_audio(tmp_path / "long.flac", decoder=decoder), expected, atol=1e-4)
    (tmp_path / "long.m4a").write_bytes(encode(x, rate, "m4a"))
    with pytest.raises(rayspec.audio.AudioTooLargeError, match="over the limit"):
        load_audio(tmp_path / "long.m4a", limits=rayspec.audio.AudioLimits(max_seconds=5.0))


def _tiny_en():
    """Skips where whisper-tiny.en is not installed."""
    from rayspec.models.errors import ModelLoadError
    from rayspec.models.registry import resolve_model

    try:
        resolve_model("whisper-tiny.en")
    except ModelLoadError as exc:
        pytest.skip(str(exc))


def test_cli_transcribes_every_format_as_the_wav(media, tmp_path):
    """rayspec transcribe on the folder (whisper-tiny.en): every format's text is the WAV's (after Whisper's
    normalizer: a lossy codec may move a comma or a capital)."""
    from rayspec.cli import main
    from rayspec.metrics import normalize

    _tiny_en()
    out = tmp_path / "out.parquet"
    assert main(["transcribe", str(media), "-o", str(out), "-q", "--target", "whisper-tiny.en"]) == 0
    texts = {r["id"]: normalize(r["text"]) for r in pq.read_table(out).to_pylist()}
    assert len(texts) == 1 + len(FORMATS) and "yards were adjoining" in texts["clip"]
    assert {kind: texts[kind] for kind in FORMATS} == {kind: texts["clip"] for kind in FORMATS}


def test_python_call_transcribes_every_format_as_the_wav(media):
    """rayspec.load(...).transcribe on each format, one path and a list of them: the WAV's text, no error."""
    import rayspec
    from rayspec.metrics import normalize

    _tiny_en()
    model = rayspec.load("whisper-tiny.en")
    wav = model.transcribe(str(media / "clip.wav"))
    assert wav.error is None and "yards were adjoining" in normalize(wav.text)
    one = model.transcribe(_path(media, "m4a"))
    results = model.transcribe([str(_path(media, kind)) for kind in FORMATS])
    for kind, r in zip(["m4a", *FORMATS], [one, *results]):
        assert r.error is None and normalize(r.text) == normalize(wav.text), kind
        assert abs(r.duration - wav.duration) < 0.1, kind


def _bytes_manifests(tmp_path, samples_manifest):
    """The bundled clips as a manifest of files, as one Parquet file of raw bytes, and as two shards of Hugging
    Face's ``{"bytes", "path"}`` struct under a folder, the second with a damaged m4a (id "cut") too."""
    utts = read_manifest(samples_manifest)[:6]
    raw = [{"id": u.id, "audio": open(u.audio, "rb").read(), "text": u.text} for u in utts]
    pq.write_table(pa.Table.from_pylist(raw), tmp_path / "raw.parquet")
    shards = tmp_path / "hf" / "data"
    shards.mkdir(parents=True)
    hf = [{"id": r["id"], "audio": {"bytes": r["audio"], "path": f"{r['id']}.flac"}, "text": r["text"]} for r in raw]
    cut = {"id": "cut", "audio": {"bytes": b"\x00\x00\x00\x20ftypM4A " + bytes(300), "path": "cut.m4a"}}
    for k, part in enumerate((hf[:3], hf[3:] + [cut])):
        pq.write_table(pa.Table.from_pylist(part), shards / f"train-0000{k}-of-00002.parquet")
    (tmp_path / "files.jsonl").write_text("".join(
        f'{{"id": "{u.id}", "audio": "{u.audio}", "text": "{u.text}"}}\n' for u in utts))
    return tmp_path / "files.jsonl", tmp_path / "raw.parquet", tmp_path / "hf"


def test_parquet_manifest_holding_bytes(tmp_path, samples_manifest):
    files, raw, hf = _bytes_manifests(tmp_path, samples_manifest)
    by_file = read_manifest(files)
    for manifest in (raw, hf):
        utts = read_manifest(manifest)
        assert [u.id for u in utts if u.id != "cut"] == [u.id for u in by_file] and all(u.data for u in utts)
        assert all(np.array_equal(load_audio(u.source), load_audio(f.audio)) for u, f in zip(utts[:2], by_file))
    assert read_manifest(raw)[0].audio == f"{raw}#{by_file[0].id}"
    assert read_manifest(hf)[0].audio == f"{by_file[0].id}.flac" and read_manifest(hf)[0].corpus == "hf"
    pq.write_table(pa.Table.from_pylist([{"id": "a", "audio": {"bytes": None, "path": by_file[0].audio}}]),
                   tmp_path / "paths.parquet")  # a struct without bytes: its path is the file
    [u] = read_manifest(tmp_path / "paths.parquet")
    assert u.data is None and u.audio == by_file[0].audio


@pytest.fixture(scope="module")
def ray_local():
    import ray

    ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False)
    yield
    ray.shutdown()


def test_parquet_bytes_through_the_cli_the_ray_job_and_ray_data(ray_local, tmp_path, samples_manifest, tiny_target):
    """The same clips as files and as bytes (a Parquet file; a folder of Hugging Face shards, read by Ray Data
    straight from the shards): the same texts under the input's ids, an error row for the damaged bytes."""
    from jobs.transcribe import main as job_main
    from jobs.transcribe_data import main as data_main
    from rayspec.cli import main
    from rayspec.results import read_results

    files, raw, hf = _bytes_manifests(tmp_path, samples_manifest)
    args = ["--target", tiny_target.model.name_or_path, "--max-tokens-per-second", "4", "--max-batch", "4"]
    assert main(["transcribe", str(files), "-o", str(tmp_path / "files.parquet"), "-q", *args]) == 0
    expected = {r["id"]: r["text"] for r in pq.read_table(tmp_path / "files.parquet").to_pylist()}
    assert main(["transcribe", str(raw), "-o", str(tmp_path / "cli.parquet"), "-q", *args]) == 0
    assert job_main([str(hf), "-o", str(tmp_path / "job.parquet"), "--targets", "1", *args]) == 3
    assert data_main([str(hf), "-o", str(tmp_path / "data"), "--batch-size", "2", "--concurrency", "1", *args]) == 3
    for out in ("cli.parquet", "job.parquet", "data"):
        rows = {r["id"]: r for r in read_results(str(tmp_path / out)).to_pylist()}
        assert {i: r["text"] for i, r in rows.items() if i != "cut"} == expected, out
        if out != "cli.parquet":
            assert rows["cut"]["error_code"] == "undecodable" and "cut.m4a" in rows["cut"]["error"], out


def test_ray_job_transcribes_every_format(ray_local, media, tmp_path):
    """python -m jobs.transcribe over a manifest of the WAV and the five formats (whisper-tiny.en): no error row,
    every format's text the WAV's."""
    from jobs.transcribe import main as job_main
    from rayspec.metrics import normalize
    from rayspec.results import read_results

    _tiny_en()
    rows = [{"id": "clip", "audio": str(media / "clip.wav")}]
    rows += [{"id": kind, "audio": str(_path(media, kind))} for kind in FORMATS]
    manifest = tmp_path / "formats.jsonl"
    manifest.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "job.parquet"
    assert job_main([str(manifest), "-o", str(out), "--targets", "1", "--target", "whisper-tiny.en"]) == 0
    got = {r["id"]: r for r in read_results(str(out)).to_pylist()}
    assert sorted(got) == sorted(r["id"] for r in rows) and not any(r["error"] for r in got.values())
    assert {kind: normalize(got[kind]["text"]) for kind in FORMATS} == {
        kind: normalize(got["clip"]["text"]) for kind in FORMATS}
