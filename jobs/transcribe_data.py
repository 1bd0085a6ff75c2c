"""Corpus transcription as a Ray Data pipeline:

    ray job submit --working-dir . -- python -m jobs.transcribe_data <manifest> -o results/corpus

The manifest is read with Ray Data's readers (``read_json`` for .jsonl, ``read_csv``, ``read_parquet``; a folder of
audio is listed by ``rayspec.manifest.read_manifest``), ids already in the output are dropped, the rest sorted
longest first; CPU tasks decode the audio (:func:`actors.data.load_audio_batch`), an actor pool of
``--concurrency`` actors with ``--actor-cpus`` / ``--actor-gpus`` each transcribes (:class:`actors.data.Transcribe`:
one continuous batch per actor, as ``rayspec transcribe``), and ``write_parquet`` writes the result rows (the
schema of ``rayspec.results``) into the output folder. A re-run writes only the ids not yet in the folder; every
results reader (``rayspec score``, ``rayspec.results.read_results``) reads the folder as one table.

Connects to ``RAY_ADDRESS`` / ``--address`` (set by ``ray job submit``), else starts an embedded local Ray on
127.0.0.1. ``--threads`` (torch threads per actor) defaults to the cluster's CPUs divided by ``--concurrency``. Exit
status: 0, 2 for usage, manifest or model errors (one line), 3 when some rows failed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from actors.pool import connect, resolve_paths  # first: sets the loopback Ray environment
import ray  # noqa: E402

from jobs.transcribe import report  # noqa: E402
from rayspec.batching import plan_batches  # noqa: E402
from rayspec.manifest import AUDIO_SUFFIXES, ManifestError, _corpus_name, read_manifest  # noqa: E402
from rayspec.models.registry import resolve_model  # noqa: E402
from rayspec.options import DTYPES, add_decode_args, add_model_args, budget_from_args  # noqa: E402
from rayspec.options import decode_options, encoder_dtype, limits_from_args, run_command  # noqa: E402
from rayspec.pipeline import RunSummary  # noqa: E402
from rayspec.results import ResultRow, done_ids, read_results  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m jobs.transcribe_data", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("input", nargs="?", default=None,
                   help="manifest (.jsonl, .csv, .parquet) or folder of audio (default: the bundled sample clips)")
    p.add_argument("-o", "--output", default="results/data", help="results folder (Parquet files; default results/data)")
    p.add_argument("--address", help="Ray address (default: RAY_ADDRESS, else an embedded local Ray)")
    p.add_argument("--num-cpus", type=int, default=None, help="CPUs of the embedded local Ray")
    p.add_argument("--concurrency", type=int, default=1, help="transcriber actors in the pool (default 1)")
    p.add_argument("--actor-cpus", type=float, default=1.0,
                   help="CPUs reserved per transcriber actor (default 1: on a small machine leave CPUs for the "
                        "read and audio tasks, or Ray Data waits forever; the actor's torch threads are --threads)")
    p.add_argument("--actor-gpus", type=float, default=0.0, help="GPUs per transcriber actor (fractions share one)")
    p.add_argument("--batch-size", type=int, default=128,
                   help="utterances per Ray Data batch handed to an actor (cut there into token-budget batches that "
                        "share the actor's continuous batch; default 128)")
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
    if os.path.isdir(path) or suffix in AUDIO_SUFFIXES:
        from dataclasses import asdict

        ds = ray.data.from_items([asdict(u) for u in read_manifest(path)])
    elif suffix in (".jsonl", ".json"):
        ds = ray.data.read_json(path, lines=True, file_extensions=None)
    elif suffix == ".csv":
        ds = ray.data.read_csv(path)
    elif suffix == ".parquet":
        ds = ray.data.read_parquet(path)
    else:
        raise ManifestError(f"unknown manifest format {suffix!r} (use .jsonl, .csv, .parquet or a folder of audio): "
                            f"{path}")
    base = os.path.dirname(os.path.abspath(path))
    return ds.map_batches(manifest_rows, batch_format="pyarrow",
                          fn_kwargs={"base": base, "corpus": _corpus_name(Path(path))})


def sample_rate(target: str) -> int:
    """The target's audio rate in Hz (its feature extractor's ``sampling_rate``; 16 kHz for Whisper)."""
    try:
        with open(os.path.join(resolve_model(target), "preprocessor_config.json")) as f:
            return int(json.load(f).get("sampling_rate", 16000))
    except OSError:
        return 16000


def transcribe_data(args) -> RunSummary:
    """Run the pipeline over ``args.input`` into the folder ``args.output`` (skipping ids already there).

    The summary's ``wall_s`` counts from reading the manifest to the last file written, the actors' model loading
    included (Ray Data starts the pool as the data arrives).

    Raises:
        ManifestError: an unreadable manifest; ModelLoadError: a target that cannot load.
    """
    from importlib import resources

    from transformers import AutoConfig

    from actors.data import Transcribe, drop_done, load_audio_batch

    if args.concurrency < 1 or args.batch_size < 1:
        raise SystemExit("--concurrency and --batch-size must be >= 1")
    resolve_paths(args)
    source = args.input or str(resources.files("rayspec").joinpath("samples", "manifest.jsonl"))
    config = AutoConfig.from_pretrained(resolve_model(args.target))  # a model that cannot load: one line here
    budget = budget_from_args(args, config)
    done = done_ids(args.output)
    connect(args.address, args.num_cpus)
    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False
    t0 = time.perf_counter()
    todo = (read_manifest_dataset(source)
            .map_batches(drop_done, batch_format="pyarrow", fn_kwargs={"done": frozenset(done)})
            .sort("est_s", descending=True)
            .materialize())  # ids and paths only: sizes the actors' continuous batch
    seconds = [r["est_s"] for r in todo.select_columns(["est_s"]).take_all()]
    summary = RunSummary()
    if not seconds:
        summary.skipped = len(done)
        return summary
    slots = max(len(b) for b in plan_batches(range(len(seconds)), seconds, budget))
    threads = args.threads or max(1, int(ray.cluster_resources().get("CPU", 1) // args.concurrency))
    kwargs = {"target": args.target, "draft": args.draft, "ctc": args.ctc, "options": decode_options(args),
              "device": "cuda" if args.actor_gpus else args.device, "dtype": DTYPES[args.dtype],
              "limits": limits_from_args(args), "encoder_dtype": encoder_dtype(args)}
    rows = (todo.map_batches(load_audio_batch, batch_format="numpy",
                             fn_kwargs={"sample_rate": sample_rate(args.target),
                                        "max_seconds": args.max_audio_seconds})
            .map_batches(Transcribe, fn_constructor_args=(kwargs, threads, budget, slots), batch_format="numpy",
                         batch_size=args.batch_size, compute=ray.data.ActorPoolStrategy(size=args.concurrency),
                         num_cpus=args.actor_cpus, num_gpus=args.actor_gpus))
    rows.write_parquet(args.output)
    summary.wall_s = time.perf_counter() - t0
    ids = set(todo.select_columns(["id"]).to_pandas()["id"])
    summary.add(ResultRow(**r) for r in read_results(args.output).to_pylist() if r["id"] in ids)
    summary.skipped = len(done)
    return summary


def run(args) -> int:
    """The job: :func:`transcribe_data`, then the summary line and, with references, a WER table."""
    return report(transcribe_data(args), args.output)


def main(argv=None) -> int:
    return run_command(run, build_parser().parse_args(argv), prog="python -m jobs.transcribe_data")


if __name__ == "__main__":
    sys.exit(main())
