"""The voice-chat WebSocket endpoint (/v1/realtime) on Ray Serve, on 127.0.0.1: a scripted text turn whose reply is
the plain greedy reply (lossless PredGen), a spoken turn, malformed events, a client that leaves mid-turn, and the
chat page in a real headless Chromium. The LLM is the bundled stories260K (fast); the voice is Piper's."""

import base64
import json
import os
import time

import numpy as np
import pytest

from browser import chromium
from rayspec.chat.commands import load_lm

PORT = 8769
URL = f"ws://127.0.0.1:{PORT}/v1/realtime"
PROMPT = "Once upon a time, there was a little dog named Max."
LM = "stories260K"


@pytest.fixture(scope="module")
def server():
    import ray
    from ray import serve

    from actors.serve_app import build_app

    ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": PORT})
        serve.run(build_app({"num_cpus": 0.5, "chat": "true", "chat_cpus": 0.25, "chat_lm": LM}), name="rayspec", route_prefix="/")
        yield URL
    finally:
        serve.shutdown()
        ray.shutdown()


def _events_until(ws, kind, timeout=120):
    out = []
    deadline = time.time() + timeout
    while time.time() < deadline:
        ev = json.loads(ws.recv(timeout=timeout))
        out.append(ev)
        if ev["type"] in (kind, "error"):
            return out
    raise TimeoutError(kind)


def test_text_turn_reply_equals_greedy_cascade(server):
    from websockets.sync.client import connect

    lm = load_lm(LM)
    expected = lm.decode(lm.generate(lm.prompt_ids(PROMPT), 40))
    with connect(server) as ws:
        assert json.loads(ws.recv(timeout=60))["type"] == "session.created"
        ws.send(json.dumps({"type": "session.update", "session": {"verifier": "greedy", "max_reply_tokens": 40}}))
        assert json.loads(ws.recv(timeout=60))["type"] == "session.updated"
        words = PROMPT.split(" ")
        for i, w in enumerate(words):
            ws.send(json.dumps({"type": "input_text.append", "delta": w if i == 0 else " " + w}))
            time.sleep(0.1)
        ws.send(json.dumps({"type": "input_text.commit"}))
        events = _events_until(ws, "response.done")
    kinds = [e["type"] for e in events]
    assert kinds[0] == "response.created" and kinds[-1] == "response.done", kinds
    text = next(e["text"] for e in events if e["type"] == "response.text.done")
    assert text == expected
    audio = b"".join(base64.b64decode(e["audio"]) for e in events if e["type"] == "response.audio.delta")
    assert len(audio) > 22050  # over half a second of 16-bit speech
    usage = events[-1]["usage"]
    assert usage["outcome"] in ("accept", "partial", "reject") and usage["nfe_to_first_sentence"] >= 1


def test_spoken_turn(server, samples_manifest):
    from websockets.sync.client import connect

    from rayspec.audio import load_audio
    from rayspec.manifest import read_manifest

    audio = load_audio(read_manifest(samples_manifest)[0].audio, 16000)
    pcm = (np.clip(audio, -1, 1) * 32767).astype("<i2").tobytes()
    with connect(server) as ws:
        json.loads(ws.recv(timeout=60))
        for k in range(0, len(pcm), 8000):  # 0.25 s chunks
            chunk = base64.b64encode(pcm[k:k + 8000]).decode()
            ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": chunk}))
        ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
        events = _events_until(ws, "response.done", timeout=180)
    kinds = [e["type"] for e in events]
    assert "conversation.item.input_audio_transcription.completed" in kinds
    assert kinds[-1] in ("response.done", "error")  # the zoo ASR may hear nothing: then a clear error event
    if kinds[-1] == "error":
        assert events[-1]["error"]["code"] == "empty_turn"


def test_malformed_events_and_a_client_that_leaves(server):
    from websockets.sync.client import connect

    with connect(server) as ws:
        json.loads(ws.recv(timeout=60))
        for msg, code in (("not json", "invalid_json"), (json.dumps({"type": "bogus"}), "unknown_event"),
                          (json.dumps({"type": "input_audio_buffer.append", "audio": "@@@"}), "invalid_audio"),
                          (json.dumps({"type": "input_text.commit"}), "empty_turn"),
                          (json.dumps({"type": "session.update", "session": {"beam": 4}}), "unknown_parameter"),
                          (json.dumps({"type": "session.update", "session": {"verifier": "nope"}}), "invalid_value"),
                          (json.dumps({"type": "input_text.append", "delta": 5}), "invalid_value")):
            ws.send(msg)
            ev = json.loads(ws.recv(timeout=60))
            assert ev["type"] == "error" and ev["error"]["code"] == code, (msg, ev)
    with connect(server) as ws:  # leaves mid-turn
        json.loads(ws.recv(timeout=60))
        ws.send(json.dumps({"type": "input_text.append", "delta": "Lily wanted to play"}))
        time.sleep(0.5)
    with connect(server) as ws:  # the server carries on
        json.loads(ws.recv(timeout=60))
        ws.send(json.dumps({"type": "input_text.append", "delta": "Tom was sad."}))
        ws.send(json.dumps({"type": "input_text.commit"}))
        assert _events_until(ws, "response.done")[-1]["type"] == "response.done"


def test_chat_page_in_headless_chromium(server, tmp_path):
    """Load the page served at /, type a turn (streamed as typed), press Enter, wait for the reply text, an audio
    chunk and the latency table, take a screenshot. The reply is the greedy cascade's (lossless PredGen)."""
    from playwright.sync_api import sync_playwright

    exe = chromium()
    lm = load_lm(LM)
    expected = lm.decode(lm.generate(lm.prompt_ids(PROMPT), 80))  # the page's default reply cap: 80 tokens
    url = server.replace("ws://", "http://").replace("/v1/realtime", "/")
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=exe, headless=True, args=[
            "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
            "--disable-component-update", "--disable-sync", "--autoplay-policy=no-user-gesture-required"])
        try:
            page = browser.new_page(viewport={"width": 900, "height": 700})
            page.goto(url)
            page.wait_for_function("document.getElementById('status').textContent === 'connected'", timeout=60000)
            page.type("#text", PROMPT, delay=15)
            page.keyboard.press("Enter")
            page.wait_for_function("document.getElementById('status').textContent.startsWith('done')",
                                   timeout=180000)
            reply = page.text_content("#reply")
            chunks = int(page.get_attribute("#reply", "data-audio-chunks") or 0)
            table = page.text_content("#latency")
            page.screenshot(path=str(os.environ.get("RAYSPEC_SCREENSHOT") or tmp_path / "chat-page.png"))
        finally:
            browser.close()
    assert reply == expected
    assert chunks >= 1 and "audio latency" in table and "LLM passes to first sentence" in table
