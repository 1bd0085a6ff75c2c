"""Corpus transcription as a Ray Data pipeline:

    ray job submit --working-dir . -- python -m jobs.transcribe_data <manifest> -o results/corpus

The manifest is read with Ray Data's readers (``read_json`` for .jsonl, ``read_csv``, ``read_parquet``, also for a
folder of Parquet shards whose ``audio`` column holds the audio's bytes; a folder of audio is listed by
``rayspec.manifest.read_manifest``), ids already in the output are dropped, the rest sorted
longest first on the driver and cut into blocks of ``--batch-size`` rows (the last ones smaller:
:func:`rayspec.batching.guided_split`); CPU tasks decode the audio
(:func:`actors.data.load_audio_batch`), an actor pool of ``--concurrency`` actors (default: one per CPU, or per GPU
share) with ``--actor-cpus`` / ``--actor-gpus`` each transcribes (:class:`actors.data.Transcribe`: one continuous
batch per actor, as ``rayspec transcribe``, fed by :data:`CALLS_PER_ACTOR` calls at once), and ``write_parquet``
writes the result rows (the schema of ``rayspec.results``) into the output folder. A re-run writes only the ids not
yet in the folder; every results reader (``rayspec score``, ``rayspec.results.read_results``) reads the folder as one
table.

Connects to ``RAY_ADDRESS`` / ``--address`` (set by ``ray job submit``), else starts an embedded local Ray on
127.0.0.1. ``--threads`` (torch threads per actor) defaults to the cluster's CPUs divided by ``--concurrency``. Exit
status: 0, 2 for usage, manifest or model errors (one line), 3 when some rows failed.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from actors.pool import actor_memory_bytes, connect, memory_fit, resolve_paths  # first: sets the loopback Ray environment
import ray  # noqa: E402

from jobs.transcribe import report  # noqa: E402
from rayspec.batching import guided_split, plan_batches  # noqa: E402
from rayspec.manifest import AUDIO_SUFFIXES, ManifestError, corpus_name, parquet_shards, read_manifest  # noqa: E402
from rayspec.models.registry import read_config, resolve_model  # noqa: E402
from rayspec.options import add_decode_args, add_model_args, budget_from_args  # noqa: E402
from rayspec.options import run_command, transcriber_spec  # noqa: E402
from rayspec.runs import RunSummary  # noqa: E402
from rayspec.results import ResultRow, done_ids, read_results  # noqa: E402


ACTOR_CPUS = 0.75
"""Logical CPUs a transcriber actor reserves by default (it runs ``--threads`` torch threads, one per CPU)."""
TASK_CPUS = 0.25
"""Logical CPUs of each task around the actors (reading the manifest, decoding audio, writing Parquet): small beside
transcribing, so one actor per CPU at :data:`ACTOR_CPUS` leaves room for them (at Ray's default of a whole CPU per
task, they would wait forever for the actors' CPUs)."""
ROWS_PER_FILE = 64
"""Rows gathered into one Parquet file (``write_parquet(min_rows_per_file=...)``): fewer files and write tasks than one
per block of ``--batch-size`` rows; a file is also what a killed job loses at most."""
CALLS_PER_ACTOR = 4
"""Ray Data calls that run on a transcriber actor at once (and blocks handed to it at once): the next blocks' rows wait
in the actor's continuous batch while one block's last rows finish (one call at a time would drain the batch between
calls)."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m jobs.transcribe_data", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("input", nargs="?", default=None,
                   help="manifest (.jsonl, .csv, .parquet: its 'audio' column may hold the files' bytes), folder of "
                        "audio or of Parquet shards (default: the bundled sample clips)")
    p.add_argument("-o", "--output", default="results/data", help="results folder (Parquet files; default results/data)")
    p.add_argument("--address", help="Ray address (default: RAY_ADDRESS, else an embedded local Ray)")
    p.add_argument("--num-cpus", type=int, default=None, help="CPUs of the embedded local Ray")
    p.add_argument("--concurrency", type=int, default=None,
                   help="transcriber actors in the pool (default: one per GPU with --actor-gpus, else one per CPU of "
                        "the cluster; each holds a copy of the models)")
    p.add_argument("--actor-cpus", type=float, default=ACTOR_CPUS,
                   help=f"CPUs reserved per transcriber actor (default {ACTOR_CPUS:g}: the rest of each CPU is left "
                        f"for the audio tasks, {TASK_CPUS:g} CPU each, or Ray Data would wait for CPUs "
                        "forever); its torch threads are --threads, default the cluster's CPUs / --concurrency")
    p.add_argument("--actor-gpus", type=float, default=0.0, help="GPUs per transcriber actor (fractions share one)")
    p.add_argument("--batch-size", type=int, default=8,
                   help="utterances per Ray Data batch handed to an actor, fewer in the last ones (cut there into "
                        "token-budget batches that join the actor's continuous batch; several calls run on an actor "
                        "at once, so its batch stays full between them; default 8)")
    add_model_args(p)
    add_decode_args(p)
    return p


def read_manifest_dataset(path: str) -> "ray.data.Dataset":
    """The manifest as a Ray Data dataset of :data:`actors.data.MANIFEST_SCHEMA` rows.

    Raises:
        ManifestError: a missing manifest or an unknown format.
    """
    from actors.data import manifest_rows

    if not os.path.exists(path):
        raise ManifestError(f"manifest not found: {path}")
    suffix = os.path.splitext(path)[1].lower()
    if os.path.isdir(path) and parquet_shards(path):  # read straight from the shards, audio bytes and all
        ds = ray.data.read_parquet(path, file_extensions=["parquet"], num_cpus=TASK_CPUS, override_num_blocks=1)
    elif os.path.isdir(path) or suffix in AUDIO_SUFFIXES:
        from dataclasses import asdict

        ds = ray.data.from_items([asdict(u) for u in read_manifest(path)])
    elif suffix in (".jsonl", ".json"):
        ds = ray.data.read_json(path, file_extensions=None, num_cpus=TASK_CPUS, override_num_blocks=1)
    elif suffix == ".csv":
        ds = ray.data.read_csv(path, num_cpus=TASK_CPUS, override_num_blocks=1)
    elif suffix == ".parquet":
        ds = ray.data.read_parquet(path, num_cpus=TASK_CPUS, override_num_blocks=1)
    else:
        raise ManifestError(f"unknown manifest format {suffix!r} (use .jsonl, .csv, .parquet or a folder of audio): "
                            f"{path}")
    base = os.path.abspath(path) if os.path.isdir(path) else os.path.dirname(os.path.abspath(path))
    return ds.map_batches(manifest_rows, batch_format="pyarrow", num_cpus=TASK_CPUS,
                          fn_kwargs={"base": base, "corpus": corpus_name(Path(path)), "manifest": path})


def sample_rate(model_dir: str) -> int:
    """The audio rate in Hz of the model in ``model_dir`` (its feature extractor's ``sampling_rate``; 16 kHz for
    Whisper)."""
    from transformers import AutoFeatureExtractor

    return int(AutoFeatureExtractor.from_pretrained(model_dir).sampling_rate)


def set_aside_unreadable(folder: str) -> list[str]:
    """Rename the Parquet files of ``folder`` that cannot be read to ``<name>.unreadable`` (``write_parquet`` writes
    in place, so a job killed mid-write can leave a truncated file), so that this run redoes their rows instead of
    failing on them. Returns the renamed files' former paths."""
    import glob

    import pyarrow.parquet as pq

    bad = []
    for path in sorted(glob.glob(os.path.join(folder, "*.parquet"))):
        try:
            pq.read_metadata(path)
        except (OSError, ValueError):  # pyarrow.ArrowInvalid is a ValueError
            os.replace(path, path + ".unreadable")
            bad.append(path)
    return bad


def pool_size(args, actor_bytes: int) -> int:
    """The default ``--concurrency``: one actor per GPU share (``--actor-gpus``), else one per CPU of the cluster
    (one-thread actors side by side outran one many-thread actor on CPUs: ``bench/ray-jobs``), at most as many as
    the cluster's memory holds at ``actor_bytes`` each (:func:`actors.pool.actor_memory_bytes`)."""
    have = ray.cluster_resources()
    if args.actor_gpus:
        return max(1, int(have.get("GPU", 0) / args.actor_gpus + 1e-9))
    return max(1, min(int(have.get("CPU", 1)), memory_fit(actor_bytes)))


def startup_seconds(ds: "ray.data.Dataset", t0: float, end: float) -> float:
    """Seconds from ``t0`` to the first :class:`~actors.data.Transcribe` call of the executed dataset ``ds``: the
    pipeline's start-up (manifest read, actor start-up, model loading), the part of a run that the actor-pool job
    counts apart from its wall time.

    Read from Ray Data's execution stats (``Dataset.get_stats_summary``): each task's start is stamped on its node's
    monotonic clock, the clock of the driver's ``time.perf_counter()`` when every node runs on the driver's machine.

    Args:
        ds: the executed dataset; t0, end: ``time.perf_counter()`` on the driver as the run began and ended.

    Returns:
        The start-up in seconds, 0.0 where it cannot be known: nodes on other machines (their monotonic clocks
        differ), stats without the transcriber's operator, or a start outside ``[t0, end]``.
    """
    from actors.data import Transcribe

    here = ray.util.get_node_ip_address()
    if any(n["NodeManagerAddress"] != here for n in ray.nodes() if n["Alive"]):
        return 0.0
    starts = []
    try:
        pending = [ds.get_stats_summary()]
        while pending:  # the write's stats, then those of the operators before it
            stats = pending.pop()
            starts += [op.earliest_start_time for op in stats.operators_stats
                       if Transcribe.__name__ in op.operator_name]
            pending += stats.parents
    except AttributeError:  # stats laid out otherwise (another Ray version): unknown
        return 0.0
    first = min((s for s in starts if s is not None), default=None)
    return first - t0 if first is not None and t0 <= first <= end else 0.0


def transcribe_data(args) -> RunSummary:
    """Run the pipeline over ``args.input`` into the folder ``args.output`` (skipping ids already there).

    The summary's ``wall_s`` counts from the first transcription call to the last file written, as the actor-pool
    job's; ``startup_s`` is the time before it: reading the manifest, starting the actor pool (Ray Data starts it as
    the data arrives) and loading the models (:func:`startup_seconds`; where that cannot be measured, ``startup_s`` is
    0 and ``wall_s`` holds it all).

    Raises:
        ManifestError: an unreadable manifest; ModelLoadError: a target that cannot load.
    """
    from importlib import resources

    import pyarrow as pa

    from actors.data import MANIFEST_SCHEMA, Transcribe, drop_done, load_audio_batch

    if (args.concurrency or 1) < 1 or args.batch_size < 1:
        raise SystemExit("--concurrency and --batch-size must be >= 1")
    resolve_paths(args)
    source = args.input or str(resources.files("rayspec").joinpath("samples", "manifest.jsonl"))
    model_dir = resolve_model(args.target)
    config = read_config(model_dir)  # a model that cannot load: one line here
    budget = budget_from_args(args, config)
    for path in set_aside_unreadable(args.output):
        print(f"warning: {path} cannot be read (a write cut short?); renamed to .unreadable, its rows are redone",
              file=sys.stderr)
    done = done_ids(args.output)
    connect(args.address, args.num_cpus)
    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False
    t0 = time.perf_counter()
    # The manifest's rows (ids, paths, texts) to the driver, as the actor-pool job holds them, sorted longest first
    # there: one streaming execution from then on, whose actors start at once (Ray Data's sort and repartition tasks
    # would each wait for a whole CPU, which the actors hold).
    todo = (read_manifest_dataset(source)
            .map_batches(drop_done, batch_format="pyarrow", num_cpus=TASK_CPUS, fn_kwargs={"done": frozenset(done)})
            .take_all())
    summary = RunSummary(skipped=len(done))
    if not todo:
        return summary
    todo.sort(key=lambda r: -r["est_s"])
    # the actors' continuous batch holds as many rows as the largest planned batch, as in rayspec transcribe
    slots = max(len(b) for b in plan_batches(todo, [r["est_s"] for r in todo], budget))
    concurrency = args.concurrency or pool_size(args, actor_memory_bytes(model_dir, config, slots))
    threads = args.threads or max(1, int(ray.cluster_resources().get("CPU", 1) // concurrency))
    device = "cuda" if args.actor_gpus else args.device
    kwargs = transcriber_spec(args).kwargs(device)  # the compute type resolved by each actor on its own node
    # an actor gets a block only when a call of its own is free: the blocks go to whichever actor frees first
    pool = ray.data.ActorPoolStrategy(size=concurrency, max_concurrent_calls_per_actor=CALLS_PER_ACTOR,
                                      max_tasks_in_flight_per_actor=CALLS_PER_ACTOR, enable_true_multi_threading=True)
    # one block per Ray Data batch (the actor pool hands out blocks: one block would feed one actor), --batch-size
    # rows each, then fewer towards the end, so that the actors run dry within about a row of each other
    n = args.batch_size
    cut = guided_split([todo[i : i + n] for i in range(0, len(todo), n)], concurrency * CALLS_PER_ACTOR)
    blocks = [pa.Table.from_pylist(b, schema=MANIFEST_SCHEMA) for b in cut]
    rows = (ray.data.from_arrow(blocks)
            .map_batches(load_audio_batch, batch_format="numpy", num_cpus=TASK_CPUS,
                         fn_kwargs={"sample_rate": sample_rate(model_dir), "max_seconds": args.max_audio_seconds})
            .map_batches(Transcribe, fn_constructor_args=(kwargs, threads, budget, slots), batch_format="numpy",
                         batch_size=None, compute=pool, num_cpus=args.actor_cpus,
                         num_gpus=args.actor_gpus))
    rows.write_parquet(args.output, ray_remote_args={"num_cpus": TASK_CPUS}, min_rows_per_file=ROWS_PER_FILE)
    end = time.perf_counter()
    summary.startup_s = startup_seconds(rows, t0, end)
    summary.wall_s = end - t0 - summary.startup_s
    ids = {r["id"] for r in todo}
    summary.add(ResultRow(**r) for r in read_results(args.output).to_pylist() if r["id"] in ids)
    return summary


def run(args) -> int:
    """The job: :func:`transcribe_data`, then the summary line and, with references, a WER table."""
    return report(transcribe_data(args), args.output)


def main(argv=None) -> int:
    return run_command(run, build_parser().parse_args(argv), prog="python -m jobs.transcribe_data")


if __name__ == "__main__":
    sys.exit(main())
