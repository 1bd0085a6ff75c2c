"""Where the time of one ``rayspec serve`` request goes, at concurrency 1 (a profile for the online peers table).

The same files, one request at a time after a warm-up, the same model and threads, in four stages that each add one
layer of the online path:

1. ``decode_batch``: features + encoder + decoder in this process, batch 1 (what the peers table times);
2. ``engine``: the replica's decode path without HTTP: a :class:`~rayspec.pipeline.Transcriber` behind a
   :class:`~rayspec.engine.TranscriptionEngine` (its thread, continuous batch and future), given the waveform;
3. ``engine + load_audio``: 2, starting from the uploaded file's bytes (decoding, resampling), as the replica does
   (stages 1-3 each run in a fresh process, with torch on one thread as in a replica);
4. ``rayspec serve``: HTTP multipart upload through Ray Serve's proxy to the replica and back, timed by the client;
   the replica's own ``decode_s`` (verbose_json) is recorded beside it.

During stage 4 the CPU seconds of every process of the server's tree (Serve proxy, controller, replica, raylet,
GCS...) are read with psutil, so time spent outside the replica shows up by process.

    python scripts/serve_overhead.py ../shared/data/ljspeech/clips.jsonl --limit 40 --threads 2 \\
        -o bench/peers-real-serve
"""

from __future__ import annotations

import argparse
import functools
import io
import os
import statistics
import time


def _stats(seconds: list[float]) -> tuple[float, float]:
    return 1000 * statistics.median(seconds), 1000 * statistics.fmean(seconds)


def _tree_cpu(pid: int) -> dict[str, float]:
    """CPU seconds (user + system) per process name in the tree under ``pid`` (itself included)."""
    import psutil

    out: dict[str, float] = {}
    root = psutil.Process(pid)
    for p in [root, *root.children(recursive=True)]:
        try:
            t, cmd = p.cpu_times(), p.cmdline() or [p.name()]
        except psutil.Error:
            continue
        key = cmd[0] if cmd[0].startswith("ray::") else " ".join(os.path.basename(c) for c in cmd[:3])
        out[key[:70]] = out.get(key[:70], 0.0) + t.user + t.system
    return out


STAGES = ("1. decode_batch (in process)", "2. engine (in process)", "3. engine + load_audio (in process)")


def _in_process(stage: str, args) -> list[float]:
    """Seconds per request of one in-process stage, in a process of its own: torch runs on one thread there (the
    main thread for stage 1, the engine's for 2 and 3, as in a replica), so no stage pays for a second OpenMP team
    (see :class:`rayspec.engine.TranscriptionEngine`)."""
    import torch

    from rayspec.audio import load_audio
    from rayspec.engine import TranscriptionEngine
    from rayspec.manifest import Utterance, read_manifest
    from rayspec.pipeline import DecodeOptions, Transcriber, decode_batch

    torch.set_num_threads(args.threads)
    utts = read_manifest(args.manifest)[: args.limit]
    options = DecodeOptions("ar", max_tokens_per_second=8.0, vad=False)  # as rayspec_server: --no-vad
    build = functools.partial(Transcriber, args.model, options=options)
    if stage == STAGES[0]:
        transcriber = build()
        sr = transcriber.sample_rate
        audios = [load_audio(u.audio, sr) for u in utts]
        run = lambda i: decode_batch(transcriber.target, options, [audios[i]], [len(audios[i]) / sr])  # noqa: E731
    else:
        engine = TranscriptionEngine(build, 16)
        sr = engine.transcriber.sample_rate
        audios = [load_audio(u.audio, sr) for u in utts]
        blobs = [open(u.audio, "rb").read() for u in utts]  # the uploads' bytes, read before the clock runs

        def run(i):
            if stage == STAGES[1]:
                return engine.submit(Utterance(utts[i].id, utts[i].id), audios[i]).result()
            buf = io.BytesIO(blobs[i])
            buf.name = os.path.basename(utts[i].audio)
            audio = load_audio(buf, sr, engine.transcriber.limits)
            return engine.submit(Utterance(utts[i].id, buf.name), audio).result()

    for i in range(args.warmup):
        run(i)
    out = []
    for i in range(len(utts)):
        t0 = time.perf_counter()
        run(i)
        out.append(time.perf_counter() - t0)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("manifest")
    p.add_argument("--limit", type=int, default=40)
    p.add_argument("--model", default="whisper-base")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("-o", "--output", required=True, help="folder for serve-overhead.md")
    args = p.parse_args()

    import multiprocessing

    import requests

    from rayspec.manifest import read_manifest
    from rayspec.peers.serve_load import rayspec_server

    utts = read_manifest(args.manifest)[: args.limit]
    blobs = [open(u.audio, "rb").read() for u in utts]
    times: dict[str, list[float]] = {}
    with multiprocessing.get_context("spawn").Pool(1, maxtasksperchild=1) as pool:  # a fresh process per stage
        for stage in STAGES:
            times[stage] = pool.apply(_in_process, (stage, args))
    os.makedirs(os.path.join(args.output, "logs"), exist_ok=True)
    log = os.path.join(args.output, "logs", "serve-overhead.log")
    server = rayspec_server(args.model, 8765, args.threads, 8.0, log)
    replica_decode = []
    try:
        server.wait_ready("/health")

        def post(i):
            r = requests.post(server.url + "/v1/audio/transcriptions",
                              files={"file": (os.path.basename(utts[i].audio), blobs[i])},
                              data={"response_format": "verbose_json"}, timeout=600)
            r.raise_for_status()
            return r.json()

        for i in range(args.warmup):
            post(i)
        before = _tree_cpu(server.proc.pid)
        t_all = time.perf_counter()
        for i in range(len(utts)):
            t0 = time.perf_counter()
            body = post(i)
            times.setdefault("4. rayspec serve (HTTP, client)", []).append(time.perf_counter() - t0)
            replica_decode.append(body["decode_s"])
        wall = time.perf_counter() - t_all
        after = _tree_cpu(server.proc.pid)
    finally:
        server.stop()

    lines = [f"### rayspec serve, one request at a time: where the time goes ({args.model}, {len(utts)} files of "
             f"{os.path.basename(args.manifest)}, method ar, {args.threads} threads, after {args.warmup} warm-up "
             "requests)", "", "| stage | p50 ms | mean ms | added to the stage above (mean) ms |", "|---|---|---|---|"]
    prev = None
    for name, secs in times.items():
        p50, mean = _stats(secs)
        lines.append(f"| {name} | {p50:.0f} | {mean:.0f} | {'-' if prev is None else f'{mean - prev:+.0f}'} |")
        prev = mean
    p50, mean = _stats(replica_decode)
    lines.append(f"| (replica's own decode_s during 4) | {p50:.0f} | {mean:.0f} | |")
    lines += ["", f"CPU seconds per process of the server's tree during stage 4 ({wall:.1f} s of wall clock, "
              f"{len(utts)} requests; processes under 0.1 s left out):", "", "| process | CPU s | per request ms |",
              "|---|---|---|"]
    for name, cpu in sorted(((k, after.get(k, 0.0) - before.get(k, 0.0)) for k in after), key=lambda x: -x[1]):
        if cpu >= 0.1:
            lines.append(f"| {name} | {cpu:.1f} | {1000 * cpu / len(utts):.0f} |")
    text = "\n".join(lines) + "\n"
    with open(os.path.join(args.output, "serve-overhead.md"), "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
