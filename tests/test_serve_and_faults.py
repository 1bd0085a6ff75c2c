"""Ray Serve endpoint (OpenAI-compatible) and actor fault tolerance, on a local loopback Ray."""

import io
import os
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


@pytest.mark.parametrize("victim", ["targets", "drafters"])
def test_actor_killed_mid_job_still_writes_every_id_once(ray_local, tmp_path, samples_manifest, tiny_target,
                                                          tiny_draft, victim):
    """Kill an actor after the 3rd finished batch (of ~17 on AN4 test's 130 utterances, or of 5 on the bundled
    clips where ../shared is absent); Ray restarts it, its batches are redone, every id is written once."""
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
                                      "--draft", tiny_draft.model.name_or_path, "--method", "draft",
                                      "--max-batch", "2" if manifest == samples_manifest else "8",
                                      "--drafter-cpus", "0.5", "--target-cpus", "0.5", "--in-flight", "2",
                                      "--max-tokens-per-second", "4"])
    code = run(args, on_batch=kill_once)
    assert killed
    rows = pq.read_table(out).to_pylist()
    ids = [r["id"] for r in rows]
    assert len(ids) == len(set(ids)) and sorted(ids) == sorted(u.id for u in read_manifest(manifest))
    # The only error rows: clips longer than the tiny model's 5 s window (a few in AN4 test), reported as such.
    errors = [r["error"] for r in rows if r["error"]]
    assert all("over the limit" in e for e in errors) and code == (3 if errors else 0)


def test_serve_openai_endpoint(ray_local, samples_manifest, tiny_target):
    from ray import serve

    from actors.serve_app import build_app
    from rayspec.pipeline import Transcriber

    serve.start(http_options={"host": "127.0.0.1", "port": PORT})
    serve.run(build_app({"target": tiny_target.model.name_or_path, "max_batch_size": 8, "num_cpus": 0.5,
                         "max_upload_bytes": 400_000}), name="rayspec", route_prefix="/")
    url = f"http://127.0.0.1:{PORT}"
    try:
        assert requests.get(f"{url}/health", timeout=30).json()["status"] == "ok"
        utts = read_manifest(samples_manifest)
        local = Transcriber(tiny_target.model.name_or_path)
        expected = {u.id: r.text for u, r in zip(utts, local.transcribe(utts))}

        def post(i):
            u = utts[i % len(utts)]
            with open(u.audio, "rb") as f:
                r = requests.post(f"{url}/v1/audio/transcriptions", files={"file": (u.audio, f)},
                                  data={"response_format": "verbose_json"}, timeout=120)
            return u.id, r.status_code, r.json()

        with ThreadPoolExecutor(max_workers=8) as pool:
            results = list(pool.map(post, range(50)))
        assert all(code == 200 for _, code, _ in results)
        assert all(body["text"] == expected[uid] for uid, _, body in results)
        assert max(body["batch_size"] for _, _, body in results) > 1  # dynamic batching happened

        big = io.BytesIO()
        sf.write(big, np.zeros(16000 * 15, dtype=np.float32), 16000, format="WAV")  # 480 kB > 400 kB limit
        r = requests.post(f"{url}/v1/audio/transcriptions", files={"file": ("big.wav", big.getvalue())}, timeout=60)
        assert r.status_code == 413 and "error" in r.json()
        r = requests.post(f"{url}/v1/audio/transcriptions", files={"file": ("x.wav", b"not audio")}, timeout=60)
        assert r.status_code == 415 and "error" in r.json()
        with open(utts[0].audio, "rb") as f:
            r = requests.post(f"{url}/v1/audio/transcriptions", files={"file": ("a.flac", f)},
                              data={"response_format": "text"}, timeout=60)
        assert r.status_code == 200 and r.text == expected[utts[0].id]
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

        def propose(self, key, requests):
            if not self.lost:
                self.lost += 1
                self.sessions.clear()
            return super().propose(key, requests)

        def times_lost(self):
            return self.lost

    utts = read_manifest(samples_manifest)[:4]
    kwargs = {"target": tiny_target.model.name_or_path, "draft": tiny_draft.model.name_or_path,
              "options": DecodeOptions("draft")}
    drafter = ray.remote(ForgetfulDrafter).options(num_cpus=0.5).remote(kwargs, 1)
    target = TargetActor.options(num_cpus=0.5).remote(kwargs["target"], kwargs["options"], "cpu", 1)
    rows = ray.get(target.decode.remote([drafter.encode.remote(utts)], drafter, "batch-0"))
    assert ray.get(drafter.times_lost.remote()) == 1
    local = Transcriber(**kwargs).transcribe(utts)
    assert [r["text"] for r in rows] == [r.text for r in local]
    assert [r["draft_tokens_accepted"] for r in rows] == [r.draft_tokens_accepted for r in local]
    for a in (drafter, target):
        ray.kill(a)


def test_a_batch_that_raises_becomes_error_rows(ray_local, samples_manifest):
    import ray

    from jobs.transcribe import batch_rows

    @ray.remote(num_cpus=0)
    def broken_decode():
        raise ValueError("bad batch")

    utts = read_manifest(samples_manifest)[:3]
    rows = batch_rows(broken_decode.remote(), utts, "draft")
    assert [r.id for r in rows] == [u.id for u in utts]
    assert all(r.error == "batch failed: ValueError: bad batch" and r.text == "" for r in rows)


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
