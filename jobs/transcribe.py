"""Corpus transcription on Ray:

    ray job submit --working-dir . -- python -m jobs.transcribe <manifest> -o out.parquet

Connects to the cluster in ``RAY_ADDRESS`` / ``--address`` (set by ``ray job submit``); with neither, starts an
embedded local Ray on loopback (127.0.0.1 only).

Two kinds of actors load their models once (see ``actors/``):

- drafter actors (``--drafters``): audio, the target's encoder, and the CTC head or the draft model;
- target actors (``--targets``): the target decoder.

Length-sorted token-budget batches stream from a drafter to a target through object refs (encoder states stay in
the object store; the driver only sees result rows), with at most ``--in-flight`` batches per target actor in
flight (backpressure). With draft-model speculation the target actor asks the batch's drafter for proposals each
round. Killed actors are restarted by Ray and their batches redone. A batch that raises is redone utterance by
utterance, so only an utterance that fails alone becomes an error row. Each finished batch is written as an atomic
Parquet shard and a re-run resumes. Prints a summary line and, when the manifest has references, the WER.

Exit status: 0, 2 for usage, manifest or model errors (one line), 3 when some rows failed.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import uuid
from dataclasses import dataclass, field

# Loopback only (see the README): set before Ray is imported.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import ray  # noqa: E402
from ray.util.placement_group import placement_group, remove_placement_group  # noqa: E402
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy  # noqa: E402
from tqdm import tqdm  # noqa: E402

from rayspec.options import DTYPES, EXIT_SOME_FAILED, add_decode_args, add_model_args, budget_from_args  # noqa: E402
from rayspec.options import decode_options, limits_from_args, print_summary, run_command  # noqa: E402
from rayspec.manifest import read_manifest  # noqa: E402
from rayspec.pipeline import RunSummary, internal_error_row, pending_batches  # noqa: E402
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
        epilog="Resources: on a node with 2+ GPUs give each actor a GPU (--drafter-gpus 1 --target-gpus 1); on one GPU "
               "share it with fractions (--drafter-gpus 0.3 --target-gpus 0.7); on CPU leave both at 0.",
    )
    p.add_argument("input", nargs="?", default=None,
                   help="manifest or folder of audio (default: the bundled AN4 sample clips)")
    p.add_argument("-o", "--output", default="results/samples.parquet", help="results .parquet file")
    p.add_argument("--address", help="Ray address (default: RAY_ADDRESS, else an embedded local Ray)")
    p.add_argument("--drafters", type=int, default=1, help="drafter actors (audio, encoder, drafter); default 1")
    p.add_argument("--targets", type=int, default=1, help="target actors (target decoder); default 1")
    p.add_argument("--drafter-cpus", type=float, default=1.0,
                   help="CPUs per drafter actor (also its torch threads unless --threads)")
    p.add_argument("--target-cpus", type=float, default=1.0,
                   help="CPUs per target actor (also its torch threads unless --threads)")
    p.add_argument("--drafter-gpus", type=float, default=0.0, help="GPUs per drafter actor (fractions share a GPU)")
    p.add_argument("--target-gpus", type=float, default=0.0, help="GPUs per target actor (fractions share a GPU)")
    p.add_argument("--in-flight", type=int, default=2, help="batches in flight per target actor (backpressure)")
    p.add_argument("--num-cpus", type=int, default=None, help="CPUs of the embedded local Ray")
    add_model_args(p)
    add_decode_args(p)
    return p


def submission_dir() -> str | None:
    """The directory relative paths of a ``ray job submit`` command line refer to, on a single-node cluster.

    A submitted job runs in a copy of ``--working-dir``, so ``../shared/data/x.jsonl`` typed in the repository means
    nothing there. Inside a Ray job this returns ``RAYSPEC_SUBMIT_DIR`` if set, else the directory ``ray start`` ran
    in (the raylet's working directory, found through /proc); outside a Ray job, or when it cannot be found, None.
    """
    if "RAY_JOB_CONFIG_JSON_ENV_VAR" not in os.environ:
        return None
    if os.environ.get("RAYSPEC_SUBMIT_DIR"):
        return os.environ["RAYSPEC_SUBMIT_DIR"]
    pid = os.getppid()
    try:
        while pid > 1:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if os.path.basename(f.read().split(b"\0")[0]) == b"raylet":
                    return os.readlink(f"/proc/{pid}/cwd")
            with open(f"/proc/{pid}/stat") as f:
                pid = int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


def resolve_paths(args) -> None:
    """Make ``args.input`` (if missing here) and ``args.output`` (if relative) point where the submitter meant
    (see :func:`submission_dir`); a no-op outside ``ray job submit``."""
    base = submission_dir()
    if base is None:
        return
    if args.input and not os.path.isabs(args.input) and not os.path.exists(args.input):
        args.input = os.path.join(base, args.input)
    if not os.path.isabs(args.output):
        args.output = os.path.join(base, args.output)


@dataclass
class ActorPool:
    """The job's actors (handles), the nodes they run on, their placement group, and how busy each is.

    :meth:`route` sends a batch to the least-loaded target actor and to the least-loaded drafter on the same node
    when there is one, so the per-round draft proposals stay on the node.
    """

    drafters: list
    targets: list
    drafter_nodes: list[str]
    target_nodes: list[str]
    placement_group: object = None
    drafter_load: list[int] = field(init=False)
    target_load: list[int] = field(init=False)

    def __post_init__(self):
        self.drafter_load = [0] * len(self.drafters)
        self.target_load = [0] * len(self.targets)

    def route(self) -> tuple[int, int]:
        """``(drafter index, target index)`` for the next batch; counts it as in flight on both."""
        t = min(range(len(self.targets)), key=self.target_load.__getitem__)
        local = [d for d, n in enumerate(self.drafter_nodes) if n == self.target_nodes[t]]
        d = min(local or range(len(self.drafters)), key=self.drafter_load.__getitem__)
        self.drafter_load[d] += 1
        self.target_load[t] += 1
        return d, t

    def finished(self, d: int, t: int) -> None:
        """A batch routed to ``(d, t)`` is done."""
        self.drafter_load[d] -= 1
        self.target_load[t] -= 1

    def shutdown(self) -> None:
        """Kill the actors and free their placement group."""
        for actor in self.drafters + self.targets:
            ray.kill(actor)
        if self.placement_group is not None:
            remove_placement_group(self.placement_group)


def check_resources(args) -> None:
    """Refuse, with advice, actor resources the cluster cannot hold at all (Ray would wait for them forever).

    Raises:
        SystemExit: more CPUs or GPUs asked for than the cluster has in total, or actors without CPUs.
    """
    if min(args.drafter_cpus, args.target_cpus) <= 0:
        raise SystemExit("--drafter-cpus and --target-cpus must be > 0 (fractions are fine)")
    have = ray.cluster_resources()
    for kind, per_drafter, per_target in (("CPU", args.drafter_cpus, args.target_cpus),
                                          ("GPU", args.drafter_gpus, args.target_gpus)):
        need = args.drafters * per_drafter + args.targets * per_target
        if need > have.get(kind, 0) + 1e-9:
            raise SystemExit(
                f"{args.drafters} drafter(s) x {per_drafter:g} + {args.targets} target(s) x {per_target:g} = {need:g} "
                f"{kind}s, but the Ray cluster has {have.get(kind, 0):g}: lower --drafter-{kind.lower()}s/"
                f"--target-{kind.lower()}s (fractions are fine) or the actor counts")


def start_actors(args) -> ActorPool:
    """Start the drafter and target actors with this run's resources; returns once their models are loaded."""
    from actors.drafter import DrafterActor
    from actors.target import TargetActor

    check_resources(args)
    options = decode_options(args)
    dtype = DTYPES[args.dtype]
    drafter_kwargs = {"target": args.target, "draft": args.draft, "ctc": args.ctc, "options": options,
                      "device": "cuda" if args.drafter_gpus else args.device, "dtype": dtype,
                      "limits": limits_from_args(args)}
    # One bundle per actor, packed onto as few nodes as possible (drafters next to their targets).
    bundles = ([_bundle(args.drafter_cpus, args.drafter_gpus)] * args.drafters
               + [_bundle(args.target_cpus, args.target_gpus)] * args.targets)
    pg = placement_group(bundles, strategy="PACK")
    ray.get(pg.ready())

    def place(i: int) -> PlacementGroupSchedulingStrategy:
        return PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=i)

    # Two threads per drafter: the next batch's encoding overlaps the current batch's draft proposals.
    drafters = [DrafterActor.options(num_cpus=args.drafter_cpus, num_gpus=args.drafter_gpus, max_concurrency=2,
                                     scheduling_strategy=place(i))
                .remote(drafter_kwargs, args.threads or max(1, int(args.drafter_cpus)))
                for i in range(args.drafters)]
    # Each target actor works on its in-flight batches concurrently (threads): while one batch waits for draft
    # proposals or its encoder states, another is verified.
    targets = [TargetActor.options(num_cpus=args.target_cpus, num_gpus=args.target_gpus, max_concurrency=args.in_flight,
                                   scheduling_strategy=place(args.drafters + i))
               .remote(args.target, options, "cuda" if args.target_gpus else args.device,
                       args.threads or max(1, int(args.target_cpus)), dtype)
               for i in range(args.targets)]
    nodes = ray.get([a.node.remote() for a in drafters + targets])
    return ActorPool(drafters, targets, nodes[: args.drafters], nodes[args.drafters :], pg)


def _bundle(cpus: float, gpus: float) -> dict:
    return {k: v for k, v in (("CPU", cpus), ("GPU", gpus)) if v > 0}


def transcribe(args, on_batch=None) -> RunSummary:
    """Run the pipeline over ``args.input`` into ``args.output`` (resuming) and merge the results file.

    ``on_batch(pool, batches_done)``, if given, is called after each finished batch (tests use it to kill an actor
    mid-job). The summary's ``wall_s`` counts from the first batch (actors started, models loaded); ``startup_s``
    is the actor start-up before it. The actors are killed at the end.
    """
    from importlib import resources

    if min(args.drafters, args.targets, args.in_flight) < 1:
        raise SystemExit("--drafters, --targets and --in-flight must be >= 1")
    resolve_paths(args)
    source = args.input or str(resources.files("rayspec").joinpath("samples", "an4", "manifest.jsonl"))
    utts = read_manifest(source)
    writer = ResultWriter(args.output)
    try:
        batches = pending_batches(utts, writer, budget_from_args(args))
        summary = RunSummary(skipped=len(utts) - sum(len(b) for b in batches))
        connect(args.address, args.num_cpus)
        t_start = time.perf_counter()
        pool = start_actors(args)
        summary.startup_s = time.perf_counter() - t_start
        try:
            _stream(args, pool, batches, writer, summary, on_batch)
        finally:
            pool.shutdown()
        writer.finalize()
    finally:
        writer.close()
    return summary


def _stream(args, pool: ActorPool, batches: list, writer: ResultWriter, summary: RunSummary, on_batch) -> None:
    """Stream ``batches`` through the actors (at most ``--in-flight`` per target), writing rows as batches finish.

    A batch whose task raised (an application error) goes back to the queue as one batch per utterance; an
    utterance that raises alone becomes an error row (code "internal").
    """
    run_id = uuid.uuid4().hex[:8]
    t0 = time.perf_counter()
    pending: dict = {}  # rows ref -> (drafter index, target index, batch)
    queue = list(batches)
    sent = finished = 0
    with tqdm(total=sum(len(b) for b in batches), desc="transcribe", unit="utt") as bar:
        while queue or pending:
            while queue and len(pending) < args.in_flight * len(pool.targets):
                batch = queue.pop(0)
                d, t = pool.route()
                drafter = pool.drafters[d]
                encoded = drafter.encode.remote(batch)
                pending[pool.targets[t].decode.remote([encoded], drafter, f"{run_id}:{sent}")] = (d, t, batch)
                sent += 1
            done, _ = ray.wait(list(pending), num_returns=1)
            for ref in done:
                d, t, batch = pending.pop(ref)
                pool.finished(d, t)
                rows = batch_rows(ref, batch, args.method)
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


def run(args, on_batch=None) -> int:
    """The job: :func:`transcribe`, then a summary line and, with references, a WER table. Returns the exit code."""
    summary = transcribe(args, on_batch)
    print_summary(summary, args.output)
    scores = score_results(args.output)
    if scores["all"]["scored"]:
        print(format_table(scores))
        print(f"WER {100 * scores['all']['wer']:.2f}% over {scores['all']['scored']} utterances")
    return EXIT_SOME_FAILED if summary.failed else 0


def main(argv=None) -> int:
    return run_command(run, build_parser().parse_args(argv), prog="python -m jobs.transcribe")


if __name__ == "__main__":
    sys.exit(main())
