"""Corpus transcription on Ray: ``ray job submit --working-dir . -- python -m jobs.transcribe <manifest> -o out.parquet``.

Connects to the cluster in ``RAY_ADDRESS`` / ``--address`` (set by ``ray job submit``); with neither, starts an
embedded local Ray on loopback (127.0.0.1 only). Transcriber actors load the models once; length-sorted token-budget
batches stream to them with a bounded number in flight; each finished batch is written as an atomic Parquet shard
and a re-run resumes. Prints a summary line and, when the manifest has references, the WER.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

# Loopback only (see the README): set before Ray is imported.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import ray  # noqa: E402
from tqdm import tqdm  # noqa: E402

from rayspec.cli import EXIT_SOME_FAILED, _add_decode_args, _add_model_args, budget_from_args  # noqa: E402
from rayspec.cli import decode_options, print_summary  # noqa: E402
from rayspec.manifest import read_manifest  # noqa: E402
from rayspec.pipeline import RunSummary, pending_batches  # noqa: E402
from rayspec.results import ResultRow, ResultWriter  # noqa: E402
from rayspec.scoring import format_table, score_results  # noqa: E402


def connect(address: str | None, num_cpus: int | None) -> None:
    """Join ``address`` (or ``RAY_ADDRESS``), else start an embedded local Ray bound to 127.0.0.1."""
    if ray.is_initialized():
        return
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, log_to_driver=False)
    else:
        ray.init(num_cpus=num_cpus, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m jobs.transcribe",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("input", nargs="?", default=None,
                   help="manifest or folder of audio (default: the bundled AN4 sample clips)")
    p.add_argument("-o", "--output", default="results/samples.parquet", help="results .parquet file")
    p.add_argument("--address", help="Ray address (default: RAY_ADDRESS, else an embedded local Ray)")
    p.add_argument("--actors", type=int, default=1, help="transcriber actors (replicas); default 1")
    p.add_argument("--actor-cpus", type=float, default=1.0, help="CPUs per actor (also its torch threads)")
    p.add_argument("--actor-gpus", type=float, default=0.0, help="GPUs per actor (fractions share one GPU)")
    p.add_argument("--in-flight", type=int, default=2, help="batches in flight per actor (backpressure)")
    p.add_argument("--num-cpus", type=int, default=None, help="CPUs of the embedded local Ray")
    _add_model_args(p)
    _add_decode_args(p)
    return p


def run(args, on_batch=None) -> int:
    """Run the job; ``on_batch(actors, batches_done)``, if given, is called after each finished batch (tests use
    it to kill an actor mid-job)."""
    from importlib import resources

    source = args.input or str(resources.files("rayspec").joinpath("samples", "an4", "manifest.jsonl"))
    utts = read_manifest(source)
    writer = ResultWriter(args.output)
    batches = pending_batches(utts, writer, budget_from_args(args))
    summary = RunSummary(skipped=len(utts) - sum(len(b) for b in batches))
    connect(args.address, args.num_cpus)
    kwargs = {"target": args.target, "draft": args.draft, "ctc": args.ctc, "options": decode_options(args),
              "device": "cuda" if args.actor_gpus else args.device}
    actors = [actor_class(args).remote(kwargs, max(1, int(args.actor_cpus))) for _ in range(args.actors)]
    ray.get([a.ready.remote() for a in actors])
    t0 = time.perf_counter()
    pending: dict = {}
    queue = list(batches)
    with tqdm(total=sum(len(b) for b in batches), desc="transcribe", unit="utt") as bar:
        while queue or pending:
            while queue and len(pending) < args.in_flight * len(actors):
                actor = actors[len(pending) % len(actors)] if len(actors) > 1 else actors[0]
                batch = queue.pop(0)
                pending[actor.transcribe.remote(batch)] = batch
            done, _ = ray.wait(list(pending), num_returns=1)
            for ref in done:
                pending.pop(ref)
                rows = [ResultRow(**r) for r in ray.get(ref)]
                writer.write(rows)
                summary.add(rows)
                bar.update(len(rows))
                if on_batch is not None:
                    on_batch(actors, len(batches) - len(queue) - len(pending))
    summary.wall_s = time.perf_counter() - t0
    writer.finalize()
    print_summary(summary, args.output)
    scores = score_results(args.output)
    if scores["all"]["scored"]:
        print(format_table(scores))
        print(f"WER {100 * scores['all']['wer']:.2f}% over {scores['all']['scored']} utterances")
    return EXIT_SOME_FAILED if summary.failed else 0


def actor_class(args):
    """The actor class with this run's resources: CPUs, and a GPU or a fraction of one."""
    from actors.transcriber import TranscriberActor

    return TranscriberActor.options(num_cpus=args.actor_cpus, num_gpus=args.actor_gpus)


def main(argv=None) -> int:
    return run(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
