"""Time to the first audio chunk of streamed ``POST /v1/audio/speech`` requests, one sentence each, on this machine.

Starts a local Ray (loopback) with ``rayspec serve --tts``'s application (the bundled TTS target and draft unless
given), then sends each sentence once as a streamed PCM request (``stream_format: audio``) after a warm-up, one
request at a time, and records, as the client sees them: the time to the first audio chunk (request sent -> first
non-empty body chunk; the synthesis streams 0.2 s chunks while a sentence is made), the time to the whole body, and
the audio length. Writes ``first-chunk.md`` (median / mean / max) into ``-o``.

    python scripts/speech_first_chunk.py ../shared/data/ljspeech/clips.jsonl --limit 20 -o bench/tts
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("manifest", help="JSONL with a text field per row (one sentence each)")
    p.add_argument("--limit", type=int, default=20)
    p.add_argument("--method", default="pcg", choices=["target", "sd", "ssd", "pcg"])
    p.add_argument("--tts-target")
    p.add_argument("--tts-draft")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--port", type=int, default=8779)
    p.add_argument("-o", "--output", required=True, help="folder for first-chunk.md")
    args = p.parse_args()
    for key, value in (("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0"), ("RAY_AUTH_MODE", "disabled"),
                       ("RAY_USAGE_STATS_ENABLED", "0")):
        os.environ.setdefault(key, value)

    import ray
    import requests
    from ray import serve

    from actors.serve_app import build_app

    texts = [json.loads(line)["text"] for line in open(args.manifest) if line.strip()][:args.limit]
    ray.init(num_cpus=args.threads, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": args.port})
        serve.run(build_app({"target": None, "num_cpus": 0, "tts": "true", "tts_cpus": args.threads,
                             "tts_method": args.method, "tts_target": args.tts_target, "tts_draft": args.tts_draft,
                             "threads": args.threads}), name="rayspec", route_prefix="/")
        url = f"http://127.0.0.1:{args.port}/v1/audio/speech"
        rows = []
        for i, text in enumerate(texts[:2] + texts):  # two warm-up requests
            t0 = time.perf_counter()
            first, size = None, 0
            with requests.post(url, json={"input": text, "response_format": "pcm", "stream_format": "audio"},
                               stream=True, timeout=300) as r:
                r.raise_for_status()
                for chunk in r.iter_content(chunk_size=None):
                    if chunk and first is None:
                        first = time.perf_counter() - t0
                    size += len(chunk)
            if i >= 2:
                rows.append((first, time.perf_counter() - t0, size / 2 / 16000))
    finally:
        serve.shutdown()
        ray.shutdown()
    firsts, totals, audio = zip(*rows)
    lines = [f"### First audio chunk of streamed /v1/audio/speech requests ({args.method}, {len(rows)} sentences, "
             f"one at a time, {args.threads} CPUs, {time.strftime('%Y-%m-%d')})", "",
             "| | median | mean | max |", "|---|---|---|---|"]
    for name, xs in (("first chunk, s", firsts), ("whole response, s", totals), ("audio, s", audio)):
        lines.append(f"| {name} | {statistics.median(xs):.3f} | {statistics.fmean(xs):.3f} | {max(xs):.3f} |")
    os.makedirs(args.output, exist_ok=True)
    with open(os.path.join(args.output, "first-chunk.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
