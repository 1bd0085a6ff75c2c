"""Hostile and odd input: each fault is one error row (or one 4xx), never a dead batch, job or endpoint."""

import io
import json
import os
import subprocess
import sys

import numpy as np
import pyarrow.parquet as pq
import pytest
import soundfile as sf

from rayspec.audio import AudioError, load_audio
from rayspec.cli import EXIT_SOME_FAILED, EXIT_USAGE, main
from rayspec.files import write_atomic
from rayspec.manifest import read_manifest
from rayspec.results import OutputLock, OutputLockedError, ResultRow, ResultWriter
from rayspec.vad import SegmentOptions, has_speech, segments
from tiny import poison_drafter


def _clip(samples_manifest, i=0):
    u = read_manifest(samples_manifest)[i]
    return load_audio(u.audio), u


@pytest.mark.parametrize("samples, code", [(100, "too_short"), (319, "too_short"), (0, "empty")])
def test_too_short_audio_is_a_clear_error(tmp_path, samples, code):
    p = tmp_path / "short.wav"
    sf.write(p, np.full(samples, 0.1, dtype=np.float32), 16000)
    with pytest.raises(AudioError) as exc:
        load_audio(p)
    assert exc.value.code == code


def test_nan_samples_symlink_loops_and_directories_are_refused(tmp_path):
    p = tmp_path / "nan.wav"
    a = np.zeros(16000, dtype=np.float32)
    a[100] = np.nan
    sf.write(p, a, 16000, subtype="FLOAT")
    with pytest.raises(AudioError, match="NaN") as exc:
        load_audio(p)
    assert exc.value.code == "non_finite"
    loop = tmp_path / "loop.wav"
    os.symlink(loop, loop)
    with pytest.raises(AudioError, match="symlink") as exc:
        load_audio(loop)
    assert exc.value.code == "unreadable"
    (tmp_path / "dir.wav").mkdir()
    with pytest.raises(AudioError, match="not a regular file"):
        load_audio(tmp_path / "dir.wav")


def test_undecodable_upload_message_names_the_upload_not_a_python_object():
    buf = io.BytesIO(b"not audio at all" * 100)
    buf.name = "clip.wav"
    with pytest.raises(AudioError) as exc:
        load_audio(buf)
    assert "clip.wav" in str(exc.value) and "BytesIO" not in str(exc.value) and exc.value.code == "undecodable"


def test_vad_silence_and_white_noise_have_no_speech_real_speech_has(samples_manifest):
    rng = np.random.default_rng(0)
    assert not has_speech(np.zeros(32000, dtype=np.float32), 16000)
    assert not has_speech((0.3 * rng.standard_normal(32000)).astype(np.float32), 16000)
    assert all(has_speech(load_audio(u.audio), 16000) for u in read_manifest(samples_manifest))


def test_long_recording_is_cut_in_pauses_within_the_window(samples_manifest):
    clips = [load_audio(u.audio) for u in read_manifest(samples_manifest)]
    gap = np.zeros(8000, dtype=np.float32)
    audio = np.concatenate([x for c in clips for x in (c, gap)])
    cuts = segments(audio, 16000, SegmentOptions(max_seconds=5.0))
    assert len(cuts) >= len(clips) // 2
    assert all(0 < (b - a) / 16000 <= 5.0 for a, b in cuts)
    assert all(b1 <= a2 for (_, b1), (a2, _) in zip(cuts, cuts[1:]))
    assert segments(np.zeros(16000 * 40, dtype=np.float32), 16000) == []


def _hostile_corpus(tmp_path, samples_manifest):
    utts = read_manifest(samples_manifest)
    rows = [{"id": u.id, "audio": u.audio, "text": u.text} for u in utts[:4]]
    sf.write(tmp_path / "tiny.wav", np.full(200, 0.1, dtype=np.float32), 16000)  # 12.5 ms
    nan = np.zeros(16000, dtype=np.float32)
    nan[5] = np.inf
    sf.write(tmp_path / "inf.wav", nan, 16000, subtype="FLOAT")
    sf.write(tmp_path / "silence.wav", np.zeros(32000, dtype=np.float32), 16000)
    (tmp_path / "dir.wav").mkdir()
    os.symlink(tmp_path / "loop.wav", tmp_path / "loop.wav")
    long_audio = np.concatenate([load_audio(u.audio) for u in utts[:4]] * 2)  # ~18 s: over the tiny 5 s window
    sf.write(tmp_path / "long.wav", long_audio, 16000)
    rows += [{"id": n, "audio": str(tmp_path / f)} for n, f in [
        ("tiny", "tiny.wav"), ("inf", "inf.wav"), ("silence", "silence.wav"), ("dir", "dir.wav"),
        ("loop", "loop.wav"), ("long", "long.wav")]]
    path = tmp_path / "hostile.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    good = tmp_path / "good.jsonl"
    good.write_text("\n".join(json.dumps(r) for r in rows[:4]))
    return str(path), str(good)


def test_hostile_corpus_one_error_row_per_bad_file_same_texts_for_good(tmp_path, samples_manifest, tiny_target):
    hostile, good = _hostile_corpus(tmp_path, samples_manifest)
    args = ["--target", tiny_target.model.name_or_path, "-q", "--max-tokens-per-second", "4", "--segments"]
    assert main(["transcribe", hostile, "-o", str(tmp_path / "h.parquet"), *args]) == EXIT_SOME_FAILED
    assert main(["transcribe", good, "-o", str(tmp_path / "g.parquet"), *args]) == 0
    rows = {r["id"]: r for r in pq.read_table(tmp_path / "h.parquet").to_pylist()}
    clean = {r["id"]: r for r in pq.read_table(tmp_path / "g.parquet").to_pylist()}
    assert len(rows) == 10
    assert {k: rows[k]["error_code"] for k in ("tiny", "inf", "dir", "loop")} == {
        "tiny": "too_short", "inf": "non_finite", "dir": "unreadable", "loop": "unreadable"}
    assert all(rows[k]["text"] == clean[k]["text"] and not rows[k]["error"] for k in clean)
    assert rows["silence"]["text"] == "" and rows["silence"]["route"] == "no_speech" and not rows["silence"]["error"]
    long = rows["long"]
    assert not long["error"] and len(long["segments"]) >= 2 and long["duration_s"] > 15
    assert long["text"] == " ".join(s["text"] for s in long["segments"] if s["text"])


def test_a_batch_that_raises_is_redone_row_by_row(samples_manifest, tiny_target, monkeypatch):
    from rayspec.pipeline import Transcriber

    utts = read_manifest(samples_manifest)[:4]
    transcriber = Transcriber(tiny_target.model.name_or_path)
    expected = [r.text for r in transcriber.transcribe(utts)]
    poison_drafter(monkeypatch, utts[2].id)
    rows = transcriber.transcribe(utts)
    assert [r.id for r in rows] == [u.id for u in utts]
    assert rows[2].error_code == "internal" and "poisoned row" in rows[2].error
    assert [r.text for i, r in enumerate(rows) if i != 2] == [t for i, t in enumerate(expected) if i != 2]


def test_writer_cleans_temp_files_and_locks_the_output(tmp_path):
    out = str(tmp_path / "o.parquet")
    os.makedirs(out + ".parts")
    for leftover in (out + ".parts/part-1.parquet.abc.tmp", out + ".deadbeef.tmp"):
        open(leftover, "wb").write(b"half a parquet file")
    writer = ResultWriter(out)
    assert not [f for f in os.listdir(tmp_path) + os.listdir(out + ".parts") if f.endswith(".tmp")]
    writer.write([ResultRow("a", text="x")])
    # A second live writer (another process) is refused with a clear message.
    code = subprocess.run([sys.executable, "-c", f"from rayspec.results import ResultWriter; ResultWriter({out!r})"],
                          capture_output=True, text=True)
    assert code.returncode != 0 and "OutputLockedError" in code.stderr and "being written by pid" in code.stderr
    writer.finalize()
    assert not os.path.exists(out + ".lock") and not os.path.exists(out + ".parts")
    # A lock left by a dead process is taken over.
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    import socket

    with open(out + ".lock", "w") as f:
        json.dump({"pid": int(dead.stdout), "host": socket.gethostname()}, f)
    ResultWriter(out).close()
    with open(out + ".lock", "w") as f:
        json.dump({"pid": os.getppid(), "host": socket.gethostname()}, f)
    with pytest.raises(OutputLockedError):
        OutputLock(out).acquire()


def test_write_atomic_replaces_whole_files_and_leaves_no_temp_file(tmp_path):
    path = str(tmp_path / "a.txt")
    write_atomic(path, "old\n")
    write_atomic(path, "névé\n")
    assert open(path, encoding="utf-8").read() == "névé\n"
    write_atomic(path, b"\x00\x01")
    assert open(path, "rb").read() == b"\x00\x01"
    os.makedirs(tmp_path / "dir")
    with pytest.raises(OSError):  # a rename onto a directory fails: the temporary file goes, the directory stays
        write_atomic(str(tmp_path / "dir"), "x")
    with pytest.raises(TypeError):
        write_atomic(path, 3)
    assert sorted(os.listdir(tmp_path)) == ["a.txt", "dir"] and open(path, "rb").read() == b"\x00\x01"


def test_internal_errors_are_retried_on_rerun(tmp_path):
    out = str(tmp_path / "o.parquet")
    w = ResultWriter(out)
    w.write([ResultRow("a", error="boom", error_code="internal"), ResultRow("b", error="bad", error_code="empty")])
    w.finalize()
    w = ResultWriter(out)
    assert w.done_ids == {"b"}
    w.write([ResultRow("a", text="fine")])
    rows = {r["id"]: r for r in w.finalize().to_pylist()}
    assert rows["a"]["text"] == "fine" and rows["a"]["error"] is None and rows["b"]["error_code"] == "empty"


@pytest.mark.parametrize("content, message", [
    ("", "no utterances"), ('{"id": "a", "audio": "x.wav"}\n{not json', "not valid JSON"),
    ('{"id": "a", "audio": "x.wav"}\n{"id": "a", "audio": "y.wav"}', "duplicate id"),
    ('{"id": "a"}', "lacks 'id' or 'audio'")])
def test_manifest_errors_are_one_line_and_exit_2(tmp_path, capsys, content, message):
    (tmp_path / "m.jsonl").write_text(content)
    assert main(["transcribe", str(tmp_path / "m.jsonl"), "-o", str(tmp_path / "o.parquet"), "-q"]) == EXIT_USAGE
    err = capsys.readouterr().err.strip()
    assert message in err and err.startswith("rayspec: error:") and len(err.splitlines()) == 1


def test_score_of_a_missing_file_is_exit_2(tmp_path, capsys):
    assert main(["score", str(tmp_path / "nothing.parquet")]) == EXIT_USAGE
    assert "no results at" in capsys.readouterr().err


def test_folder_mode_keeps_directories_and_loops_as_rows(tmp_path):
    sf.write(tmp_path / "a.wav", np.zeros(1600, dtype=np.float32), 16000)
    (tmp_path / "d.wav").mkdir()
    os.symlink(tmp_path / "l.wav", tmp_path / "l.wav")
    assert sorted(u.id for u in read_manifest(tmp_path)) == ["a", "d", "l"]


def test_kill_9_at_any_moment_then_rerun_writes_every_id_once(tmp_path, samples_manifest, tiny_target):
    """SIGKILL the CLI at spread-out moments (start-up, mid-batch, mid-shard-write, mid-merge), then re-run."""
    import signal
    import time

    out = str(tmp_path / "k.parquet")
    cmd = [sys.executable, "-m", "rayspec.cli", "transcribe", samples_manifest, "-o", out, "-q", "--target",
           tiny_target.model.name_or_path, "--max-batch", "1", "--max-tokens-per-second", "4"]
    for delay in (4.0, 5.5, 7.0):
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    done = subprocess.run(cmd, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    ids = [r["id"] for r in pq.read_table(out).to_pylist()]
    assert sorted(ids) == sorted(u.id for u in read_manifest(samples_manifest))
    assert not [f for f in os.listdir(tmp_path) if f.endswith((".tmp", ".lock"))]


def test_a_method_means_the_same_in_the_cli_the_job_and_serve():
    """Decoding defaults exist once (rayspec.options): Serve's --method ssd is the CLI's lossy default point."""
    from jobs.transcribe import build_parser as job_parser
    from rayspec.cli import build_parser
    from rayspec.options import decode_options, decode_options_from

    cli = decode_options(build_parser().parse_args(["transcribe", "x.jsonl", "-o", "y.parquet", "--method", "ssd"]))
    job = decode_options(job_parser().parse_args(["x.jsonl", "--method", "ssd"]))
    served = decode_options_from({"method": "ssd"})
    assert cli == job == served and served.mode == "lossy" and served.ssd.tau_ctc == 0.7
    from rayspec.methods import DecodeOptions

    assert DecodeOptions("ssd") == served  # the library's defaults are the same point
    assert (served.ssd.tau_slm, served.ssd.fallback) == (0.2, "ctc")
    assert decode_options_from({"method": "ssd", "exact": "true", "tau_ctc": "0"}).mode == "exact"
    with pytest.raises(ValueError, match="unknown decoding options"):
        decode_options_from({"methd": "ar"})
    from rayspec.decoding.speculative import SpeculationOptions

    flags = ["transcribe", "x.jsonl", "-o", "y.parquet", "--method", "draft"]
    assert decode_options(build_parser().parse_args(flags)).speculation == SpeculationOptions()
    spec = decode_options(build_parser().parse_args(flags + ["--tree", "--no-recycle"])).speculation
    assert spec.tree and not spec.recycle
    assert decode_options_from({"method": "draft", "tree": "1", "recycle": "0"}).speculation == spec
    rows = lambda *f: decode_options(build_parser().parse_args(flags + list(f))).speculate_max_rows  # noqa: E731
    assert (rows(), rows("--speculate-max-rows", "all"), rows("--speculate-max-rows", "4")) == (None, 0, 4)
    assert decode_options_from({"speculate_max_rows": "4"}).speculate_max_rows == 4
    with pytest.raises(ValueError, match="speculate_max_rows"):
        decode_options_from({"speculate_max_rows": "-1"})


def test_method_auto_is_ctc_draft_where_a_ctc_head_drafts_the_speech():
    """The default method: ctc-draft for a target with a CTC head (bundled for whisper-base, or --ctc) on English
    transcription, ar otherwise; the same in the CLI, the job, Serve and the Python call (both are exact)."""
    from jobs.transcribe import build_parser as job_parser
    from rayspec.cli import build_parser
    from rayspec.options import decode_options, decode_options_from, resolve_method

    cli = lambda *f: decode_options(build_parser().parse_args(["transcribe", "x.jsonl", "-o", "y.parquet", *f]))  # noqa: E731
    assert cli().method == "ctc-draft"  # whisper-base, its bundled head
    assert cli("--target", "whisper-tiny.en").method == "ar"  # no head bundled
    assert cli("--target", "my/whisper", "--ctc", "my/head").method == "ctc-draft"
    assert cli("--language", "fr").method == cli("--task", "translate").method == "ar"
    assert cli("--method", "ar").method == "ar" and cli("--method", "ssd").method == "ssd"
    assert decode_options(job_parser().parse_args(["x.jsonl"])).method == "ctc-draft"
    assert decode_options_from({}, "whisper-base").method == "ctc-draft"
    assert decode_options_from({}).method == "ar"  # no target named
    assert resolve_method("medusa", "whisper-tiny.en") == "medusa"


def test_bfloat16_models_decode(samples_manifest, tiny_target):
    import torch

    from rayspec.pipeline import Transcriber

    utts = read_manifest(samples_manifest)[:3]
    rows = Transcriber(tiny_target.model.name_or_path, dtype=torch.bfloat16).transcribe(utts)
    assert all(r.error is None and r.target_forward_passes > 0 for r in rows)
