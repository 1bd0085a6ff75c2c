"""Every script in examples/ runs, on the bundled clips, with the tiny random Whisper of tests/tiny.py (fast): the
library API over a folder, the official `openai` client against Serve, and a corpus job through `ray job submit`."""

import os
import runpy
import socket
import subprocess
import sys

import pyarrow.parquet as pq
import pytest
import soundfile as sf

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")
SAMPLES = os.path.join(ROOT, "rayspec", "samples")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_example(name, argv, monkeypatch):
    monkeypatch.setattr(sys, "argv", [name, *argv])
    runpy.run_path(os.path.join(EXAMPLES, name), run_name="__main__")


def test_every_example_is_tested():
    tested = {"library_folder.py", "openai_client.py", "ray_job.sh"}
    assert set(os.listdir(EXAMPLES)) - {"__pycache__"} == tested


def test_python_call_example_transcribes_a_folder(tiny_target, tiny_draft, monkeypatch, capsys):
    folder = os.path.join(SAMPLES, "ljspeech")
    _run_example("library_folder.py", [folder, "--target", tiny_target.model.name_or_path, "--method", "draft",
                                       "--draft", tiny_draft.model.name_or_path, "--timestamps", "none"], monkeypatch)
    out = capsys.readouterr().out
    names = [name[:-5] for name in os.listdir(folder) if name.endswith(".flac")]
    assert names and all(f"{name}: " in out for name in names)


@pytest.fixture(scope="module")
def ray_with_dashboard():
    """A local loopback Ray with its dashboard (the job API `ray job submit` talks to); yields the dashboard URL."""
    import ray

    port = _free_port()
    ray.init(num_cpus=4, include_dashboard=True, dashboard_host="127.0.0.1", dashboard_port=port,
             _node_ip_address="127.0.0.1", log_to_driver=False)
    yield f"http://127.0.0.1:{port}"
    ray.shutdown()


def test_ray_job_example_submits_a_corpus_job(ray_with_dashboard, tiny_target, tmp_path):
    out = str(tmp_path / "job.parquet")
    manifest = os.path.join(SAMPLES, "an4", "manifest.jsonl")
    env = dict(os.environ, RAY_ADDRESS=ray_with_dashboard,
               PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    proc = subprocess.run(["bash", os.path.join(EXAMPLES, "ray_job.sh"), manifest, out,
                           "--target", tiny_target.model.name_or_path, "--max-tokens-per-second", "4"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = pq.read_table(out).to_pylist()
    assert len(rows) == 10 and not [r["error"] for r in rows if r["error"]]


def test_openai_client_example_against_serve(ray_with_dashboard, tiny_target, tmp_path, monkeypatch, capsys):
    from ray import serve
    from test_tts import _tiny

    from actors.serve_app import build_app

    target, draft = _tiny()
    target.save_pretrained(str(tmp_path / "tts-target"))
    draft.save_pretrained(str(tmp_path / "tts-draft"))
    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        serve.run(build_app({"target": tiny_target.model.name_or_path, "num_cpus": 0.5, "tts": "true",
                             "tts_cpus": 0.5, "tts_target": str(tmp_path / "tts-target"),
                             "tts_draft": str(tmp_path / "tts-draft")}), name="rayspec", route_prefix="/")
        speech = str(tmp_path / "speech.wav")
        _run_example("openai_client.py", [os.path.join(SAMPLES, "an4", "an391-mjwl-b.flac"),
                                          "--base-url", f"http://127.0.0.1:{port}/v1", "-o", speech], monkeypatch)
    finally:
        serve.shutdown()
    out = capsys.readouterr().out
    assert "target passes, method ar" in out and f"wrote {speech}" in out
    audio, rate = sf.read(speech)
    assert rate == 16000 and len(audio) > 0
