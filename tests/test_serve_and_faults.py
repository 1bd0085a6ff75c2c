"""Ray Serve endpoint (OpenAI-compatible) and actor fault tolerance, on a local loopback Ray."""

import io
import json
import os
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pyarrow.parquet as pq
import pytest
import requests
import soundfile as sf

from rayspec.manifest import read_manifest

PORT = 8765


@pytest.fixture(scope="module")
def ray_local():
    import ray

    ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False)
    yield
    ray.shutdown()


AN4_TEST = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data", "an4", "test.jsonl")


@pytest.mark.parametrize("layout, victim, method", [("split", "targets", "draft"), ("split", "drafters", "draft"),
                                                    ("colocated", "targets", "draft"), ("split", "targets", "ar")])
def test_actor_killed_mid_job_still_writes_every_id_once(ray_local, tmp_path, samples_manifest, tiny_target,
                                                          tiny_draft, layout, victim, method):
    """Kill an actor after the 3rd finished batch (of ~17 on AN4 test's 130 utterances, or of 5 on the bundled
    clips where ../shared is absent); Ray restarts it, its batches are redone, every id is written once (the
    colocated actor and the split target without a remote draft kill a continuous batch of several batches)."""
    import ray

    from jobs.transcribe import build_parser, run

    manifest = AN4_TEST if os.path.exists(AN4_TEST) else samples_manifest
    killed = []

    def kill_once(pool, done):
        if not killed and done >= 3:
            ray.kill(getattr(pool, victim)[0], no_restart=False)  # Ray restarts it; its batches are redone
            killed.append(done)

    out = str(tmp_path / "ft.parquet")
    args = build_parser().parse_args([manifest, "-o", out, "--target", tiny_target.model.name_or_path,
                                      "--draft", tiny_draft.model.name_or_path, "--method", method,
                                      "--actors", layout, "--max-batch", "2" if manifest == samples_manifest else "8",
                                      "--drafter-cpus", "0.5", "--target-cpus", "0.5", "--in-flight", "2",
                                      "--max-tokens-per-second", "4"])
    code = run(args, on_batch=kill_once)
    assert killed
    rows = pq.read_table(out).to_pylist()
    ids = [r["id"] for r in rows]
    assert len(ids) == len(set(ids)) and sorted(ids) == sorted(u.id for u in read_manifest(manifest))
    # Clips longer than the tiny model's 5 s window (a few in AN4 test) are segmented, not refused.
    assert not [r["error"] for r in rows if r["error"]] and code == 0


def _post(url, name, data, **form):
    return requests.post(f"{url}/v1/audio/transcriptions", files={"file": (name, data)}, data=form, timeout=120)


def _wav(samples) -> bytes:
    buf = io.BytesIO()
    sf.write(buf, samples, 16000, format="WAV")
    return buf.getvalue()


def test_serve_openai_endpoint(ray_local, samples_manifest, tiny_target):
    """Happy path under concurrency, then every refusal: each one alone fails, with the one JSON error shape."""
    import http.client
    import time

    from ray import serve

    from actors.serve_app import build_app
    from rayspec.pipeline import Transcriber

    serve.start(http_options={"host": "127.0.0.1", "port": PORT})
    serve.run(build_app({"target": tiny_target.model.name_or_path, "max_batch_size": 8, "num_cpus": 0.5,
                         "max_upload_bytes": 400_000, "max_queued": 12, "body_timeout_s": 2}),
              name="rayspec", route_prefix="/")
    url = f"http://127.0.0.1:{PORT}"
    try:
        assert requests.get(f"{url}/health", timeout=30).json()["status"] == "ok"
        utts = read_manifest(samples_manifest)
        local = Transcriber(tiny_target.model.name_or_path)
        expected = {u.id: r.text for u, r in zip(utts, local.transcribe(utts))}
        clips = {u.id: open(u.audio, "rb").read() for u in utts}
        tiny = _wav(np.full(200, 0.1, dtype=np.float32))  # 12.5 ms

        def post(i):
            if i == 7:
                r = _post(url, "tiny.wav", tiny)
                return "tiny", r.status_code, r.json()
            u = utts[i % len(utts)]
            r = _post(url, u.audio, clips[u.id], response_format="verbose_json")
            return u.id, r.status_code, r.json()

        with ThreadPoolExecutor(max_workers=8) as pool:
            results = list(pool.map(post, range(50)))
        good = [(uid, code, body) for uid, code, body in results if uid != "tiny"]
        assert all(code == 200 for _, code, _ in good)
        assert all(body["text"] == expected[uid] for uid, _, body in good)
        assert max(body["batch_size"] for _, _, body in good) > 1  # dynamic batching happened
        (_, code, body), = [r for r in results if r[0] == "tiny"]
        assert code == 400 and "under the minimum" in body["error"]["message"]

        big = _wav(np.zeros(16000 * 15, dtype=np.float32))  # 480 kB > 400 kB limit
        r = _post(url, "big.wav", big)
        assert r.status_code == 413 and "error" in r.json()
        r = _post(url, "x.wav", b"not audio")
        assert r.status_code == 415 and "x.wav" in r.json()["error"]["message"]
        assert "BytesIO" not in r.json()["error"]["message"]
        r = _post(url, "a.flac", clips[utts[0].id], response_format="text")
        assert r.status_code == 200 and r.text == expected[utts[0].id]
        r = _post(url, "a.flac", clips[utts[0].id], model="gpt-9")
        assert r.status_code == 404 and r.json()["error"]["type"] == "model_not_found"
        r = requests.post(f"{url}/v1/audio/transcriptions", data={"model": "whisper-1"}, timeout=30)  # no file
        assert r.status_code == 400 and r.json()["error"]["code"] == 400 and "file" in r.json()["error"]["message"]
        assert r.json().keys() == {"error"}

        # A client that sends its whole (30 MB) body before reading the answer sees the 413, not a reset connection.
        r = _post(url, "big.wav", b"\0" * 30_000_000)
        assert r.status_code == 413 and "over the limit" in r.json()["error"]["message"]
        req = urllib.request.Request(f"{url}/v1/audio/transcriptions", data=b"\0" * 30_000_000, method="POST",
                                     headers={"Content-Type": "multipart/form-data; boundary=x"})
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(req, timeout=60)
        assert refused.value.code == 413

        # A 1 GB upload is refused by its Content-Length (the client stops sending: the answer after body_timeout_s).
        conn = http.client.HTTPConnection("127.0.0.1", PORT, timeout=30)
        t0 = time.perf_counter()
        conn.putrequest("POST", "/v1/audio/transcriptions")
        conn.putheader("Content-Type", "multipart/form-data; boundary=x")
        conn.putheader("Content-Length", str(1 << 30))
        conn.endheaders()
        conn.send(b"--x\r\n")
        reply = conn.getresponse()
        assert reply.status == 413 and "error" in json.loads(reply.read()) and time.perf_counter() - t0 < 10
        conn.close()

        # A body that stalls gets 408 once body_timeout_s has passed.
        conn = http.client.HTTPConnection("127.0.0.1", PORT, timeout=30)
        conn.putrequest("POST", "/v1/audio/transcriptions")
        conn.putheader("Content-Type", "multipart/form-data; boundary=x")
        conn.putheader("Content-Length", "1000")
        conn.endheaders()
        conn.send(b"--x\r\n")
        assert conn.getresponse().status == 408
        conn.close()

        # More concurrent requests than max_queued: the surplus is answered 503 with Retry-After, none 5xx else.
        long_clip = max(clips.values(), key=len)
        with ThreadPoolExecutor(max_workers=40) as pool:
            burst = list(pool.map(lambda _: _post(url, "a.flac", long_clip), range(40)))
        codes = [r.status_code for r in burst]
        assert set(codes) <= {200, 503} and 503 in codes and 200 in codes
        assert all(r.headers.get("Retry-After") for r in burst if r.status_code == 503)
    finally:
        serve.shutdown()


def test_lost_draft_session_is_redone_exactly(ray_local, samples_manifest, tiny_target, tiny_draft):
    """A drafter that forgets its session mid-batch (as after a restart): the target actor redoes the batch."""
    import ray

    from actors.drafter import DraftServer
    from actors.target import TargetActor
    from rayspec.pipeline import DecodeOptions, Transcriber

    class ForgetfulDrafter(DraftServer):
        lost = 0

        def propose(self, key, requests, feedback):
            if not self.lost:
                self.lost += 1
                self.sessions.clear()
            return super().propose(key, requests, feedback)

        def times_lost(self):
            return self.lost

    utts = read_manifest(samples_manifest)[:4]
    kwargs = {"target": tiny_target.model.name_or_path, "draft": tiny_draft.model.name_or_path,
              "options": DecodeOptions("draft", speculate_max_rows=0)}  # actors do not see conftest's monkeypatch
    drafter = ray.remote(ForgetfulDrafter).options(num_cpus=0.5).remote(kwargs, 1)
    target = TargetActor.options(num_cpus=0.5).remote(kwargs["target"], kwargs["options"], "cpu", 1)
    rows = ray.get(target.decode.remote([drafter.encode.remote(utts)], drafter, "batch-0"))
    assert ray.get(drafter.times_lost.remote()) == 1
    local = Transcriber(**kwargs).transcribe(utts)
    assert [r["text"] for r in rows] == [r.text for r in local]
    assert [r["draft_tokens_accepted"] for r in rows] == [r.draft_tokens_accepted for r in local]
    for a in (drafter, target):
        ray.kill(a)


def test_a_batch_that_raises_is_redone_row_by_row(ray_local, samples_manifest):
    import ray

    from jobs.transcribe import batch_rows

    @ray.remote(num_cpus=0)
    def broken_decode():
        raise ValueError("bad batch")

    utts = read_manifest(samples_manifest)[:3]
    assert batch_rows(broken_decode.remote(), utts, "draft") is None  # the job re-queues its utterances one by one
    rows = batch_rows(broken_decode.remote(), utts[:1], "draft")
    assert [r.id for r in rows] == [utts[0].id]
    assert rows[0].error == "ValueError: bad batch" and rows[0].error_code == "internal" and rows[0].text == ""


def test_a_dead_actor_stops_the_job_instead_of_writing_error_rows(ray_local, samples_manifest):
    import ray

    from jobs.transcribe import batch_rows

    @ray.remote(num_cpus=0, max_restarts=0)
    class Doomed:
        def die(self):
            import os

            os._exit(1)

    @ray.remote(num_cpus=0)
    def decode_via(actor):
        return ray.get(actor.die.remote())

    with pytest.raises(ray.exceptions.RayError):
        batch_rows(decode_via.remote(Doomed.remote()), read_manifest(samples_manifest)[:2], "ar")


@pytest.mark.parametrize("layout", ["colocated", "split"])
def test_hostile_corpus_through_the_ray_job_matches_the_cli(ray_local, tmp_path, samples_manifest, tiny_target,
                                                            layout):
    from test_reliability import _hostile_corpus

    from jobs.transcribe import main as job_main
    from rayspec.cli import EXIT_SOME_FAILED, main

    hostile, _ = _hostile_corpus(tmp_path, samples_manifest)
    args = ["--target", tiny_target.model.name_or_path, "--max-tokens-per-second", "4", "--max-batch", "4"]
    assert main(["transcribe", hostile, "-o", str(tmp_path / "cli.parquet"), "-q", *args]) == EXIT_SOME_FAILED
    assert job_main([hostile, "-o", str(tmp_path / "job.parquet"), "--drafter-cpus", "0.5", "--target-cpus", "0.5",
                     "--actors", layout, *args]) == EXIT_SOME_FAILED
    cli = {r["id"]: (r["text"], r["error_code"]) for r in pq.read_table(tmp_path / "cli.parquet").to_pylist()}
    job = {r["id"]: (r["text"], r["error_code"]) for r in pq.read_table(tmp_path / "job.parquet").to_pylist()}
    assert cli == job and len(job) == 10


def test_ray_data_startup_is_read_from_the_execution_stats(ray_local):
    """The Ray Data run's start-up (to its first transcription call) comes from the stats of the write and the
    operators before it; a start outside the run is unknown (0)."""
    from types import SimpleNamespace as NS

    from jobs.transcribe_data import startup_seconds

    def stats(name, start, parents=()):
        return NS(operators_stats=[NS(operator_name=name, earliest_start_time=start)], parents=list(parents))

    chain = stats("Write", 9.0, [stats("MapBatches(Transcribe)", 4.0, [stats("MapBatches(load_audio_batch)", 2.0)])])
    ds = NS(get_stats_summary=lambda: chain)
    assert startup_seconds(ds, 1.0, 10.0) == 3.0
    assert startup_seconds(ds, 5.0, 10.0) == 0.0
    assert startup_seconds(NS(get_stats_summary=lambda: stats("Write", 9.0)), 1.0, 10.0) == 0.0


def test_ray_data_pipeline_matches_the_cli_and_resumes(ray_local, tmp_path, samples_manifest, tiny_target):
    """jobs.transcribe_data (Ray Data: read_json, CPU audio tasks, an actor pool, write_parquet) writes the CLI's
    rows, one error row per bad file; a re-run writes nothing more."""
    from test_reliability import _hostile_corpus

    from jobs.transcribe_data import main as data_main
    from rayspec.cli import EXIT_SOME_FAILED, main
    from rayspec.results import read_results

    hostile, _ = _hostile_corpus(tmp_path, samples_manifest)
    args = ["--target", tiny_target.model.name_or_path, "--max-tokens-per-second", "4", "--max-batch", "4"]
    assert main(["transcribe", hostile, "-o", str(tmp_path / "cli.parquet"), "-q", *args]) == EXIT_SOME_FAILED
    out = str(tmp_path / "data")
    assert data_main([hostile, "-o", out, "--batch-size", "4", *args]) == EXIT_SOME_FAILED
    cli = {r["id"]: (r["text"], r["error_code"], r["corpus"]) for r in pq.read_table(tmp_path / "cli.parquet").to_pylist()}
    data = [(r["id"], (r["text"], r["error_code"], r["corpus"])) for r in read_results(out).to_pylist()]
    assert dict(data) == cli and len(data) == 10
    files = sorted(os.listdir(out))
    assert data_main([hostile, "-o", out, *args]) == 0 and sorted(os.listdir(out)) == files
