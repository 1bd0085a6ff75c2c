"""Corpus transcription on Ray:

    ray job submit --working-dir . -- python -m jobs.transcribe <manifest> -o out.parquet

Connects to the cluster in ``RAY_ADDRESS`` / ``--address`` (set by ``ray job submit``); with neither, starts an
embedded local Ray on loopback (127.0.0.1 only).

Actors load their models once (see ``actors/``), in one of two layouts (``--actors``):

- colocated (the default on CPUs): transcriber actors, each running audio, the target's encoder, the drafter and the
  target decoder in one process with ``--actor-cpus`` CPUs; by default one 1-CPU (one torch thread) actor per CPU of
  the cluster, fewer with more CPUs each where the cluster's memory holds fewer model copies (``--targets`` sets the
  count; see ``actors.pool.size_colocated``);
- split (the default when actors get GPUs): drafter actors (``--drafters``: audio, the target's encoder, and the CTC
  head or the draft model) and target actors (``--targets``: the target decoder). Batches stream from a drafter to
  a target through object refs (encoder states stay in the object store; the driver only sees result rows). With
  draft-model speculation the target actor asks the batch's drafter for proposals each round.

Length-sorted token-budget batches go out longest first, with at most ``--in-flight`` batches per target (or
transcriber) actor in flight (backpressure). Each actor keeps one continuous batch (as ``rayspec transcribe`` and
Serve do): the rows of its in-flight batches join as slots free, up to as many rows as the largest planned batch;
split, the drafters encode the batches in flight ahead of the target (with a remote draft, method ``draft`` or
ssd's draft fallback, a target actor decodes each batch on its own). Killed actors are restarted by Ray and their batches redone. A batch that raises is redone
utterance by utterance, so only an utterance that fails alone becomes an error row. Each finished batch is written
as an atomic Parquet shard and a re-run resumes. Prints a summary line and, when the manifest has references, the
WER.

Exit status: 0, 2 for usage, manifest or model errors (one line), 3 when some rows failed.
"""

from __future__ import annotations

import argparse
import sys
import time
import uuid

from actors.pool import ActorPool, connect, resolve_paths, start_actors  # first: sets the loopback Ray environment
from actors.pool import ActorPlan, actor_memory_bytes, plan_from_args, size_colocated  # noqa: E402
import ray  # noqa: E402
from tqdm import tqdm  # noqa: E402

from rayspec.batching import guided_split  # noqa: E402
from rayspec.manifest import read_manifest  # noqa: E402
from rayspec.models.registry import read_config, resolve_model  # noqa: E402
from rayspec.options import EXIT_SOME_FAILED, add_decode_args, add_model_args, budget_from_args  # noqa: E402
from rayspec.options import EXIT_USAGE, TranscriberSpec, print_summary, run_command, transcriber_spec  # noqa: E402
from rayspec.runs import RunSummary, internal_error_row, pending_batches  # noqa: E402
from rayspec.results import ResultRow, ResultWriter  # noqa: E402
from rayspec.scoring import format_table, score_results  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m jobs.transcribe",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Resources: on a node with 2+ GPUs give each actor a GPU (--drafter-gpus 1 --target-gpus 1); on one GPU "
               "share it with fractions (--drafter-gpus 0.3 --target-gpus 0.7); on CPU leave both at 0.",
    )
    p.add_argument("input", nargs="?", default=None,
                   help="manifest (a Parquet 'audio' column may hold the files' bytes), folder of audio or of Parquet "
                        "shards (default: the bundled AN4 and LJSpeech sample clips)")
    p.add_argument("-o", "--output", default="results/samples.parquet", help="results .parquet file")
    p.add_argument("--address", help="Ray address (default: RAY_ADDRESS, else an embedded local Ray)")
    p.add_argument("--actors", choices=["auto", "colocated", "split"], default="auto",
                   help="colocated: each actor runs encoder, drafter and target decoder in one process (one model "
                        "copy, no object-store hop); split: drafter actors encode and draft, target actors decode "
                        "(for models on separate GPUs). auto (default): split when --drafter-gpus/--target-gpus are "
                        "given, else colocated")
    p.add_argument("--drafters", type=int, default=1,
                   help="drafter actors (audio, encoder, drafter; split layout only); default 1")
    p.add_argument("--targets", type=int, default=None,
                   help="target actors (split; default 1), or transcriber actors (colocated; default: one per "
                        "--actor-cpus of the cluster, fewer where its memory holds fewer model copies)")
    p.add_argument("--actor-cpus", type=float, default=None,
                   help="CPUs per colocated transcriber actor (also its torch threads unless --threads); default 1 "
                        "(on CPUs, one-thread actors side by side outrun one many-thread actor beside Ray's daemons), "
                        "more where memory caps the actor count, or the cluster's CPUs / --targets")
    p.add_argument("--drafter-cpus", type=float, default=1.0,
                   help="CPUs per drafter actor (split layout; also its torch threads unless --threads)")
    p.add_argument("--target-cpus", type=float, default=1.0,
                   help="CPUs per target actor (split layout; also its torch threads unless --threads)")
    p.add_argument("--drafter-gpus", type=float, default=0.0, help="GPUs per drafter actor (fractions share a GPU)")
    p.add_argument("--target-gpus", type=float, default=0.0, help="GPUs per target actor (fractions share a GPU)")
    p.add_argument("--in-flight", type=int, default=3,
                   help="batches in flight per target (or transcriber) actor (backpressure; default 3: while one "
                        "batch's rows decode, the next ones are queued, or encoded by the drafter, and join the "
                        "actor's continuous batch as its slots free)")
    p.add_argument("--num-cpus", type=int, default=None, help="CPUs of the embedded local Ray")
    add_model_args(p)
    add_decode_args(p)
    return p


def transcribe(args, on_batch=None) -> RunSummary:
    """Run the pipeline over ``args.input`` into ``args.output`` (resuming) and merge the results file.

    The flags are parsed here once, into the typed :class:`~rayspec.options.TranscriberSpec` (what each actor builds)
    and :class:`~actors.pool.ActorPlan` (the actors and their resources), which travel down instead of ``args``.
    ``on_batch(pool, batches_done)``, if given, is called after each finished batch (tests use it to kill an actor
    mid-job). The summary's ``wall_s`` counts from the first batch (actors started, models loaded); ``startup_s``
    is the actor start-up before it. The actors are killed at the end.
    """
    from importlib import resources

    plan, spec = plan_from_args(args), transcriber_spec(args)
    resolve_paths(args)
    source = args.input or str(resources.files("rayspec").joinpath("samples", "manifest.jsonl"))
    utts = read_manifest(source)
    # A model name or path that cannot load is one line here, not an actor's traceback; a CTranslate2 model is
    # converted once here instead of by every actor (on a cluster, each node without the cache converts its own)
    model_dir = resolve_model(args.target)
    config = read_config(model_dir)
    writer = ResultWriter(args.output)
    try:
        # longest first, as rayspec transcribe: later rows are shorter, so their cross-attention fits the first
        # rows' cache
        batches = pending_batches(utts, writer, budget_from_args(args, config))[::-1]
        summary = RunSummary(skipped=len(utts) - sum(len(b) for b in batches))
        connect(args.address, args.num_cpus)
        slots = max((len(b) for b in batches), default=1)
        if plan.layout == "colocated":
            plan = size_colocated(plan, len(batches), actor_memory_bytes(model_dir, config, slots))
        t_start = time.perf_counter()
        pool = start_actors(spec, plan, slots)
        summary.startup_s = time.perf_counter() - t_start
        try:
            # the last batches cut smaller, so that the actors run dry within about a row of each other
            batches = guided_split(batches, plan.in_flight * len(pool.targets))
            _stream(spec, plan, pool, batches, writer, summary, on_batch)
        finally:
            pool.shutdown()
        writer.finalize()
    finally:
        writer.close()
    return summary


def _stream(spec: TranscriberSpec, plan: ActorPlan, pool: ActorPool, batches: list, writer: ResultWriter,
            summary: RunSummary, on_batch) -> None:
    """Stream ``batches`` through the actors (at most ``plan.in_flight`` per target), writing rows as batches finish.

    A batch whose task raised (an application error) goes back to the queue as one batch per utterance; an
    utterance that raises alone becomes an error row (code "internal").
    """
    run_id = uuid.uuid4().hex[:8]
    t0 = time.perf_counter()
    pending: dict = {}  # rows ref -> (route, batch)
    queue = list(batches)
    sent = finished = 0
    with tqdm(total=sum(len(b) for b in batches), desc="transcribe", unit="utt") as bar:
        while queue or pending:
            while queue and len(pending) < plan.in_flight * len(pool.targets):
                batch = queue.pop(0)
                ref, route = pool.submit(batch, f"{run_id}:{sent}")
                pending[ref] = (route, batch)
                sent += 1
            done, _ = ray.wait(list(pending), num_returns=1)
            for ref in done:
                route, batch = pending.pop(ref)
                pool.finished(*route)
                rows = batch_rows(ref, batch, spec.options.method)
                if rows is None:  # the batch raised: redo it utterance by utterance, first in line
                    queue[:0] = [[u] for u in batch]
                    continue
                writer.write(rows)
                summary.add(rows)
                bar.update(len(rows))
                finished += 1
                if on_batch is not None:
                    on_batch(pool, finished)
    summary.wall_s = time.perf_counter() - t0


def batch_rows(ref, batch: list, method: str) -> list[ResultRow] | None:
    """The rows of a finished batch; None if the batch raised (an application error) and has several utterances,
    one error row (code "internal") if it had one.

    Raises:
        ray.exceptions.RayError: a failure of Ray itself (an actor dead beyond its restarts, a lost object): the job
            stops, and a re-run resumes without writing error rows for batches that never ran.
    """
    try:
        return [ResultRow(**r) for r in ray.get(ref)]
    except ray.exceptions.RayTaskError as exc:
        cause = exc
        while isinstance(cause, ray.exceptions.RayTaskError) and cause.cause is not None:
            cause = cause.cause  # through the drafter's task, if it failed there
        if isinstance(cause, ray.exceptions.RayError):
            raise
        if len(batch) > 1:
            return None
        return [internal_error_row(batch[0], cause, method)]


def report(summary, output: str) -> int:
    """A job's summary line and, with references, its WER table; the job's exit code."""
    print_summary(summary, output)
    if summary.written + summary.skipped:
        scores = score_results(output)
        if scores["all"]["scored"]:
            print(format_table(scores))
            print(f"WER {100 * scores['all']['wer']:.2f}% over {scores['all']['scored']} utterances")
    return EXIT_SOME_FAILED if summary.failed else 0


def run(args, on_batch=None) -> int:
    """The job: :func:`transcribe`, then :func:`report`. Returns the exit code."""
    return report(transcribe(args, on_batch), args.output)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.long_form == "sequential":  # the actors decode VAD segments; Whisper's sequential loop is in-process
        print("python -m jobs.transcribe: error: --long-form sequential runs in-process only (rayspec transcribe); "
              "the Ray job decodes long files with --long-form vad", file=sys.stderr)
        return EXIT_USAGE
    return run_command(run, args, prog="python -m jobs.transcribe")


if __name__ == "__main__":
    sys.exit(main())
