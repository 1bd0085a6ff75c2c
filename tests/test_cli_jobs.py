"""End-to-end: the CLI over a corpus with bad files, resume after a kill, score, and the Ray job."""

import json
import shutil

import numpy as np
import pyarrow.parquet as pq
import pytest
import soundfile as sf

from rayspec.cli import EXIT_SOME_FAILED, main
from rayspec.results import ResultRow, ResultWriter


def _bad_corpus(tmp_path, samples_manifest):
    src = [json.loads(line) for line in open(samples_manifest)]
    base = samples_manifest.rsplit("/", 1)[0]
    good = f"{base}/{src[0]['audio']}"
    audio, rate = sf.read(good, dtype="float32")
    sf.write(tmp_path / "stereo44k.wav", np.stack([audio, audio], 1), 44100)  # played at 44.1 kHz
    sf.write(tmp_path / "eight_k.flac", audio[::2], 8000)
    shutil.copy(good, tmp_path / "good.flac")
    data = open(good, "rb").read()
    (tmp_path / "corrupt.flac").write_bytes(data[:200] + b"\x00" * 500)
    (tmp_path / "empty.wav").write_bytes(b"")
    (tmp_path / "text.wav").write_text("not audio at all\n")
    rows = [{"id": n, "audio": f, "text": src[0]["text"]} for n, f in [
        ("good", "good.flac"), ("stereo", "stereo44k.wav"), ("eight_k", "eight_k.flac"), ("corrupt", "corrupt.flac"),
        ("empty", "empty.wav"), ("text", "text.wav"), ("missing", "does/not/exist.wav")]]
    (tmp_path / "bad.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    return str(tmp_path / "bad.jsonl")


def test_bad_input_corpus_completes(tmp_path, samples_manifest, tiny_target, capsys):
    manifest = _bad_corpus(tmp_path, samples_manifest)
    out = str(tmp_path / "out.parquet")
    code = main(["transcribe", manifest, "-o", out, "--target", tiny_target.model.name_or_path, "-q",
                 "--max-tokens-per-second", "4"])
    assert code == EXIT_SOME_FAILED
    assert "4 failed" in capsys.readouterr().out
    rows = {r["id"]: r for r in pq.read_table(out).to_pylist()}
    assert len(rows) == 7
    for uid in ("corrupt", "empty", "text", "missing"):
        assert rows[uid]["error"] and rows[uid]["text"] == ""
    for uid in ("good", "stereo", "eight_k"):
        assert rows[uid]["error"] is None and rows[uid]["text"] and rows[uid]["target_forward_passes"] > 0
    # score works and counts the failures
    assert main(["score", out, "--json"]) == 0
    scored = json.loads(capsys.readouterr().out)
    assert scored["n"] == 7 and scored["errors"] == 4 and 0 <= scored["wer"]
    assert main(["score", out, "--json", "--raw"]) == 0  # no normalizer: case and white space only
    assert json.loads(capsys.readouterr().out)["n"] == 7


def test_the_cli_process_ends_with_its_status_and_its_output_flushed(tmp_path, samples_manifest, tiny_target):
    """``python -m rayspec.cli transcribe`` ends through os._exit (no interpreter teardown): its exit status, stdout
    (a pipe: block-buffered) and results file are all there."""
    import subprocess
    import sys

    manifest = _bad_corpus(tmp_path, samples_manifest)
    out = str(tmp_path / "out.parquet")
    done = subprocess.run([sys.executable, "-m", "rayspec.cli", "transcribe", manifest, "-o", out, "--target",
                           tiny_target.model.name_or_path, "-q", "--max-tokens-per-second", "4"],
                          capture_output=True, text=True)
    assert done.returncode == EXIT_SOME_FAILED, done.stderr
    assert "7 utterances written (0 already done), 4 failed" in done.stdout
    assert "compute type" in done.stderr
    assert len(pq.read_table(out)) == 7


def test_killed_run_resumes_without_duplicates(tmp_path, samples_manifest, tiny_target, capsys):
    out = str(tmp_path / "r.parquet")
    ids = [json.loads(line)["id"] for line in open(samples_manifest)]
    # A run killed after its first batches: shards for some ids, no merged file.
    ResultWriter(out).write([ResultRow(ids[0], text="from the first run"), ResultRow(ids[1], text="x")])
    code = main(["transcribe", samples_manifest, "-o", out, "--target", tiny_target.model.name_or_path, "-q",
                 "--max-tokens-per-second", "4", "--max-batch", "3"])
    assert code == 0
    assert "2 already done" in capsys.readouterr().out
    table = pq.read_table(out).to_pylist()
    assert sorted(r["id"] for r in table) == sorted(ids)
    assert next(r for r in table if r["id"] == ids[0])["text"] == "from the first run"
    assert main(["transcribe", samples_manifest, "-o", out, "--target", tiny_target.model.name_or_path, "-q"]) == 0
    assert len(pq.read_table(out)) == len(ids)


def test_ray_job_embedded_local(tmp_path, samples_manifest, tiny_target, tiny_draft, capsys):
    import ray

    from jobs.transcribe import main as job_main

    out = str(tmp_path / "ray.parquet")
    try:
        code = job_main([samples_manifest, "-o", out, "--target", tiny_target.model.name_or_path,
                         "--draft", tiny_draft.model.name_or_path, "--method", "draft", "--num-cpus", "2",
                         "--targets", "2", "--actor-cpus", "1", "--max-batch", "4",
                         "--max-tokens-per-second", "4"])
    finally:
        ray.shutdown()
    assert code == 0
    ray_rows = {r["id"]: r["text"] for r in pq.read_table(out).to_pylist()}
    assert len(ray_rows) == 10
    local = str(tmp_path / "local.parquet")
    assert main(["transcribe", samples_manifest, "-o", local, "--target", tiny_target.model.name_or_path, "-q",
                 "--max-tokens-per-second", "4"]) == 0
    assert {r["id"]: r["text"] for r in pq.read_table(local).to_pylist()} == ray_rows


def test_ray_job_paths_resolve_against_the_submit_dir(tmp_path, monkeypatch):
    from actors.pool import resolve_paths
    from jobs.transcribe import build_parser

    args = build_parser().parse_args(["data/m.jsonl", "-o", "out/r.parquet"])
    resolve_paths(args)  # not inside a Ray job: unchanged
    assert (args.input, args.output) == ("data/m.jsonl", "out/r.parquet")
    monkeypatch.setenv("RAY_JOB_CONFIG_JSON_ENV_VAR", "{}")
    monkeypatch.setenv("RAYSPEC_SUBMIT_DIR", str(tmp_path))
    resolve_paths(args)
    assert args.input == str(tmp_path / "data/m.jsonl") and args.output == str(tmp_path / "out/r.parquet")


def test_ray_job_refuses_sequential_long_form(capsys):
    """Whisper's sequential long-form loop is in-process only: the Ray job says so in one line, exit status 2."""
    from jobs.transcribe import main

    assert main(["--long-form", "sequential"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "--long-form sequential runs in-process only" in err


def test_ray_job_refuses_resources_the_cluster_lacks(monkeypatch):
    import ray

    from actors.pool import check_resources, plan_from_args
    from jobs.transcribe import build_parser

    def plan(flags):
        return plan_from_args(build_parser().parse_args(flags))

    assert plan([]).layout == "colocated"  # CPUs: one process per model copy
    assert plan(["--target-gpus", "1"]).layout == "split"
    assert plan(["--actors", "split"]).layout == "split"
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 2.0})
    check_resources(plan([]))  # one colocated actor of 1 CPU per CPU fits
    check_resources(plan(["--actors", "split"]))  # 1 + 1 CPUs fit
    with pytest.raises(SystemExit, match="lower --drafter-gpus"):
        check_resources(plan(["--target-gpus", "0.5"]))  # GPUs: split by default
    with pytest.raises(SystemExit, match=r"2 transcriber\(s\) x 2 = 4 CPUs, .*: lower --actor-cpus"):
        check_resources(plan(["--targets", "2", "--actor-cpus", "2"]))
    with pytest.raises(SystemExit, match=r"1 drafter\(s\) x 1 \+ 2 target\(s\) x 1 = 3 CPUs"):
        check_resources(plan(["--actors", "split", "--targets", "2"]))


def test_colocated_actors_fill_the_cluster_within_its_memory(monkeypatch):
    """Colocated on CPUs, by default one 1-CPU actor per CPU (at most one per batch); fewer, with more CPUs each,
    where the cluster's memory holds fewer model copies; a count or CPUs given are kept."""
    import ray

    from actors.pool import plan_from_args, size_colocated
    from jobs.transcribe import build_parser

    def sized(flags, cpus=16, memory_gib=64, batches=100, actor_gib=2):
        monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": float(cpus), "memory": memory_gib * 2.0**30})
        plan = size_colocated(plan_from_args(build_parser().parse_args(flags)), batches, actor_gib << 30)
        return plan.targets, plan.actor_cpus

    assert sized([]) == (16, 1.0)
    assert sized([], batches=3) == (3, 1.0)
    assert sized([], memory_gib=20) == (8, 2.0)  # 10 copies fit: 8 actors of 2 CPUs use every CPU
    assert sized([], memory_gib=1) == (1, 16.0)
    assert sized(["--actor-cpus", "4"]) == (4, 4.0)
    assert sized(["--targets", "3"]) == (3, 5.0)
    assert sized(["--targets", "3", "--actor-cpus", "1"]) == (3, 1.0)


def test_actor_memory_estimate_matches_the_measured_whisper_base_actor():
    """whisper-base with 15 rows: 1.8-2.1 GiB RSS measured per actor (bench/job-memory); the estimate is near."""
    from transformers import AutoConfig

    from actors.pool import actor_memory_bytes
    from rayspec.models.registry import resolve_model

    path = resolve_model("whisper-base")
    assert 1.8 < actor_memory_bytes(path, AutoConfig.from_pretrained(path), 15) / 2**30 < 2.6


def test_batches_go_to_the_least_loaded_target_and_a_drafter_on_its_node():
    from actors.pool import ActorPool

    pool = ActorPool(["d0", "d1"], ["t0", "t1", "t2"], ["nodeA", "nodeB"], ["nodeB", "nodeA", "nodeC"])
    assert pool.route() == (1, 0)  # t0 on nodeB -> d1 (nodeB)
    assert pool.route() == (0, 1)  # t1 on nodeA -> d0
    assert pool.route() == (0, 2)  # t2's node has no drafter -> the least-loaded one (tie: first)
    pool.finished(1, 0)
    assert pool.route() == (1, 0)
    assert pool.drafter_load == [2, 1] and pool.target_load == [1, 1, 1]
    colocated = ActorPool([], ["a0", "a1"], [], ["nodeA", "nodeB"])  # transcriber actors: no drafter to pick
    assert [colocated.route(), colocated.route(), colocated.route()] == [(None, 0), (None, 1), (None, 0)]
    colocated.finished(None, 0)
    assert colocated.target_load == [1, 1]


def test_ray_data_rerun_sets_aside_a_truncated_file_and_redoes_its_rows(tmp_path):
    """A file write_parquet left truncated (a job killed mid-write) is renamed, not fatal: its ids count as not done."""
    from jobs.transcribe_data import set_aside_unreadable
    from rayspec.results import ResultRow, done_ids, rows_to_table

    folder = tmp_path / "data"
    folder.mkdir()
    pq.write_table(rows_to_table([ResultRow(id="a", text="x")]), folder / "good.parquet")
    pq.write_table(rows_to_table([ResultRow(id="b", text="y")]), folder / "cut.parquet")
    data = (folder / "cut.parquet").read_bytes()
    (folder / "cut.parquet").write_bytes(data[: len(data) // 2])
    assert set_aside_unreadable(str(folder)) == [str(folder / "cut.parquet")]
    assert (folder / "cut.parquet.unreadable").exists() and done_ids(str(folder)) == {"a"}
