"""``rayspec chat --server``: a terminal client of the voice-chat WebSocket endpoint (``/v1/realtime``).

It streams the user's turn in real time (text word by word at ``--chars-per-minute``, or audio in 0.25 s chunks),
prints partial transcripts and the reply as they arrive, measures the audio latency it sees (end of input -> first
audio), and saves the reply's audio.
"""

from __future__ import annotations

import base64
import json
import time

import numpy as np

AUDIO_CHUNK_S = 0.25


def _input_events(args):
    """``(delay_s, event)`` pairs of the user's turn, ending with its commit."""
    if args.audio:
        from ..audio import load_audio

        audio = load_audio(args.audio, 16000)
        pcm = (np.clip(audio, -1, 1) * 32767).astype("<i2").tobytes()
        step = int(AUDIO_CHUNK_S * 16000) * 2
        for k in range(0, len(pcm), step):
            yield AUDIO_CHUNK_S, {"type": "input_audio_buffer.append",
                                  "audio": base64.b64encode(pcm[k:k + step]).decode()}
        yield 0.0, {"type": "input_audio_buffer.commit"}
        return
    words = args.text.split(" ")
    for i, w in enumerate(words):
        delta = w if i == 0 else " " + w
        yield len(delta) * 60.0 / args.chars_per_minute, {"type": "input_text.append", "delta": delta}
    yield 0.0, {"type": "input_text.commit"}


def chat_over_websocket(args) -> int:
    """Run one turn against ``args.server``; returns 0, or 1 when the server answers with an error event."""
    import threading

    import soundfile as sf
    from websockets.sync.client import connect

    session = {"verifier": args.verifier, "top_k": args.top_k, "max_reply_tokens": args.max_reply_tokens,
               "max_wasted_tokens": args.max_wasted_tokens, "candidate_tokens": args.candidate_tokens}
    chunks, rate, sent = [], 16000, {}
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else None  # rayspec serve --api-key
    with connect(args.server, max_size=None, additional_headers=headers) as ws:
        ws.recv(timeout=60)  # session.created
        ws.send(json.dumps({"type": "session.update", "session": session}))
        ws.recv(timeout=60)

        def feed():
            for delay, ev in _input_events(args):
                time.sleep(delay)
                if ev["type"].endswith("commit"):
                    sent["end"] = time.perf_counter()
                ws.send(json.dumps(ev))

        threading.Thread(target=feed, daemon=True).start()
        while True:
            ev = json.loads(ws.recv(timeout=600))
            kind = ev["type"]
            if kind == "error":
                print(f"error: {ev['error']['code']}: {ev['error']['message']}")
                return 1
            if kind.startswith("conversation.item.input_audio_transcription"):
                print(f"  ... {ev['transcript']}" if kind.endswith("delta") else f"user:  {ev['transcript']}")
            elif kind == "response.text.delta":
                print(ev["delta"], end="", flush=True)
            elif kind == "response.audio.delta":
                if not chunks:
                    sent["first_audio"] = time.perf_counter()
                chunks.append(np.frombuffer(base64.b64decode(ev["audio"]), "<i2").astype(np.float32) / 32768)
                rate = ev["sample_rate"]
            elif kind == "response.done":
                u = ev["usage"]
                print(f"\n\naudio latency {1000 * (sent['first_audio'] - sent['end']):.0f} ms at the client "
                      f"({1000 * u['audio_latency_s']:.0f} ms in the server; TTFS {1000 * u['ttfs_s']:.0f} ms); "
                      f"first sentence: {u['outcome']}, {u['nfe_to_first_sentence']} LLM pass(es) after the input; "
                      f"{u['wasted_tokens']} speculative tokens discarded")
                break
    if args.output and chunks:
        sf.write(args.output, np.concatenate(chunks), rate)
        print(f"audio: {args.output}")
    return 0
