"""Speech synthesis of a texts file on Ray:

    ray job submit --working-dir . -- python -m jobs.synthesize texts.txt -o tts-out

Connects to the cluster in ``RAY_ADDRESS`` / ``--address`` (set by ``ray job submit``); with neither, starts an
embedded local Ray on loopback (127.0.0.1 only). ``--actors`` synthesis actors (``actors/synthesizer.py``: TTS target,
draft and codec, loaded once) take chunks of texts, at most ``--in-flight`` per actor (backpressure); the driver
writes each chunk's audio files and then its rows as an atomic Parquet shard, so a killed job loses at most the
chunks in flight and a re-run resumes. A chunk that raises is redone text by text; a text that fails alone becomes an
error row (code "internal"). Bad texts (empty, over 4096 characters, unpronounceable, not UTF-8) are error rows.

Exit status: 0, 2 for usage or model errors (one line), 3 when some rows failed.
"""

from __future__ import annotations

import argparse
import sys
import time

from actors.pool import connect, resolve_paths  # first: sets the loopback Ray environment
import ray  # noqa: E402
from tqdm import tqdm  # noqa: E402

from rayspec.options import EXIT_SOME_FAILED, run_command  # noqa: E402
from rayspec.tts.flags import AUDIO_FORMATS, add_synthesis_args, sampling_from_args  # noqa: E402
from rayspec.tts.synthesis import SynthesisOutput, SynthesisRow, SynthesisSummary, read_texts  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m jobs.synthesize", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("input", help="texts file (.txt one per line, .jsonl/.csv/.parquet with text[, id])")
    p.add_argument("-o", "--output", required=True, help="output folder (audio/ + results.parquet)")
    p.add_argument("--format", choices=sorted(AUDIO_FORMATS), default="flac", help="audio file format")
    p.add_argument("--address", help="Ray address (default: RAY_ADDRESS, else an embedded local Ray)")
    p.add_argument("--actors", type=int, default=1, help="synthesis actors (default 1)")
    p.add_argument("--actor-cpus", type=float, default=1.0, help="CPUs per actor (also its torch threads)")
    p.add_argument("--actor-gpus", type=float, default=0.0, help="GPUs per actor (fractions share a GPU)")
    p.add_argument("--chunk", type=int, default=32, help="texts per task (default 32)")
    p.add_argument("--in-flight", type=int, default=2, help="chunks in flight per actor (default 2)")
    p.add_argument("--num-cpus", type=int, default=None, help="CPUs of the embedded local Ray")
    add_synthesis_args(p)
    return p


def synthesize(args) -> SynthesisSummary:
    """Run the job over ``args.input`` into ``args.output`` (resuming); returns the counts."""
    from actors.synthesizer import SynthesisActor

    if min(args.actors, args.chunk, args.in_flight) < 1:
        raise SystemExit("--actors, --chunk and --in-flight must be >= 1")
    resolve_paths(args)
    items = read_texts(args.input)
    opts = sampling_from_args(args)
    output = SynthesisOutput(args.output)
    summary = SynthesisSummary()
    try:
        todo = output.pending(items)
        summary.skipped = len(items) - len(todo)
        queue = [todo[i:i + args.chunk] for i in range(0, len(todo), args.chunk)]
        connect(args.address, args.num_cpus)
        models = {"target": args.tts_target, "draft": args.tts_draft, "codec": args.codec}
        actors = [SynthesisActor.options(num_cpus=args.actor_cpus, num_gpus=args.actor_gpus)
                  .remote(models, "cuda" if args.actor_gpus else "cpu", args.threads or max(1, int(args.actor_cpus)))
                  for _ in range(args.actors)]
        t0 = time.perf_counter()
        pending: dict = {}
        load = [0] * len(actors)
        try:
            with tqdm(total=len(todo), desc="synthesize", unit="text") as bar:
                while queue or pending:
                    while queue and len(pending) < args.in_flight * len(actors):
                        a = min(range(len(actors)), key=load.__getitem__)
                        chunk = queue.pop(0)
                        ref = actors[a].synthesize.remote(chunk, opts, args.seed, args.format, args.speed,
                                                          args.batch_size)
                        pending[ref] = (a, chunk)
                        load[a] += 1
                    done, _ = ray.wait(list(pending), num_returns=1)
                    for ref in done:
                        a, chunk = pending.pop(ref)
                        load[a] -= 1
                        try:
                            results = ray.get(ref)
                        except ray.exceptions.RayTaskError as exc:
                            if len(chunk) > 1:  # redo text by text, first in line
                                queue[:0] = [[it] for it in chunk]
                                continue
                            results = [(SynthesisRow(chunk[0].id, chunk[0].text, method=opts.method,
                                                     error=f"internal error: {exc.cause!r}"[:500],
                                                     error_code="internal"), None)]
                        output.write(results, summary)
                        bar.update(len(chunk))
        finally:
            for actor in actors:
                ray.kill(actor)
        summary.wall_s = time.perf_counter() - t0
        output.finalize()
    finally:
        output.close()
    return summary


def run(args) -> int:
    s = synthesize(args)
    print(f"{s.done} texts synthesised ({s.skipped} already done), {s.failed} failed, {s.audio_s:.1f} s of audio in "
          f"{s.wall_s:.1f} s (RTFx {s.audio_s / max(s.wall_s, 1e-9):.2f}) -> {args.output}")
    return EXIT_SOME_FAILED if s.failed else 0


def main(argv=None) -> int:
    return run_command(run, build_parser().parse_args(argv), prog="python -m jobs.synthesize")


if __name__ == "__main__":
    sys.exit(main())
