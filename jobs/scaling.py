"""Scaling run: throughput (RTFx, utterances/s) against drafter/target actor counts and the batch token budget.

    ray job submit --working-dir . -- python -m jobs.scaling an4/test.jsonl \\
        --targets 1 2 --batch-tokens 2000 8000 --method draft -o bench/scaling

Each point runs the full pipeline of :mod:`jobs.transcribe` in its split layout (drafter and target actors, object
refs, bounded in-flight batches) into a fresh output; a reference row per method and budget ("in-process", 0
actors) runs the same decoder without Ray in the driver, with ``--reference-threads`` torch threads (default: the
cluster's CPUs, so the reference uses the same cores as the actors it is compared with). Throughput is timed from
the first batch to the last row (actor start-up and model loading are reported apart); NFE per utterance comes
from the rows.
Arguments not listed below (model paths, decoder options, --max-batch, ...) are passed to every point's job.
Writes ``scaling.md`` (with the cluster's resources and the machine), ``scaling.csv`` and ``scaling.png`` to the
output folder.
"""

from __future__ import annotations

import argparse
import csv
import os
import platform
import sys
import tempfile
import time

from actors.pool import connect, resolve_paths  # first: sets the loopback environment for Ray
from jobs.transcribe import build_parser as job_parser
from jobs.transcribe import transcribe
from rayspec.options import budget_from_args, build_transcriber
from rayspec.manifest import read_manifest
from rayspec.runs import RunSummary, run_corpus
from rayspec.results import read_results

import ray  # noqa: E402

COLUMNS = ["method", "drafters", "targets", "batch_tokens", "utterances", "audio_s", "startup_s", "wall_s", "rtfx",
           "utt_per_s", "nfe_per_utt"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m jobs.scaling", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("input", help="manifest or folder of audio")
    p.add_argument("-o", "--output", default="scaling", help="output folder (default: scaling)")
    p.add_argument("--drafters", type=int, nargs="+", default=[1], help="drafter actor counts to try")
    p.add_argument("--targets", type=int, nargs="+", default=[1, 2], help="target actor counts to try")
    p.add_argument("--batch-tokens", type=int, nargs="+", default=[2000, 8000], help="batch token budgets to try")
    p.add_argument("--method", nargs="+", default=["ar", "draft"], help="decoding methods to try")
    p.add_argument("--address", help="Ray address (default: RAY_ADDRESS, else an embedded local Ray)")
    p.add_argument("--num-cpus", type=int, default=None, help="CPUs of the embedded local Ray")
    p.add_argument("--reference-threads", type=int, default=0,
                   help="torch threads of the in-process reference rows (default: the cluster's CPUs)")
    return p


def cpu_model() -> str:
    """This machine's CPU model (``/proc/cpuinfo``'s model name where there is one), for tables' captions."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return cpu


def machine() -> str:
    """The cluster's resources and the driver machine's CPU, for the table's caption."""
    res = ray.cluster_resources()
    return (f"Ray cluster: {res.get('CPU', 0):g} CPUs, {res.get('GPU', 0):g} GPUs, {len(ray.nodes())} node(s); "
            f"driver CPU: {cpu_model()}")


def in_process(input_path: str, out: str, job_args: list[str], threads: int) -> RunSummary:
    """The same corpus and decoder without Ray: :func:`rayspec.runs.run_corpus` in this process (``rayspec
    transcribe``: continuous batching over the same planned batches, as the job's actors), with ``threads`` torch
    threads. The summary's ``startup_s`` is the model loading."""
    args = job_parser().parse_args([input_path, "-o", out, *job_args])
    args.threads = threads
    t0 = time.perf_counter()
    transcriber = build_transcriber(args)
    load_s = time.perf_counter() - t0
    s = run_corpus(read_manifest(input_path), transcriber, out, budget_from_args(args, transcriber.target.config))
    s.startup_s = load_s
    return s


def row(method: str, drafters: int, targets: int, budget: int, s: RunSummary, out: str) -> dict:
    table = [r for r in read_results(out).to_pylist() if not r["error"]]
    nfe = sum(r["target_forward_passes"] for r in table) / max(1, len(table))
    return {"method": method, "drafters": drafters, "targets": targets, "batch_tokens": budget,
            "utterances": s.written, "audio_s": round(s.audio_s, 1), "startup_s": round(s.startup_s, 1),
            "wall_s": round(s.wall_s, 2), "rtfx": round(s.rtfx, 1), "utt_per_s": round(s.written / s.wall_s, 2),
            "nfe_per_utt": round(nfe, 2)}


def main(argv=None) -> int:
    args, job_args = build_parser().parse_known_args(argv)
    resolve_paths(args)
    connect(args.address, args.num_cpus)
    threads = args.reference_threads or max(1, int(ray.cluster_resources().get("CPU", 1)))
    rows = []
    for method in args.method:
        for budget in args.batch_tokens:
            with tempfile.TemporaryDirectory() as tmp:
                out = os.path.join(tmp, "r.parquet")
                point = ["--batch-tokens", str(budget), "--method", method, *job_args]
                s = in_process(args.input, out, point, threads)
                rows.append(row(method, 0, 0, budget, s, out))
            print(rows[-1], flush=True)
        for drafters in args.drafters:
            for targets in args.targets:
                for budget in args.batch_tokens:
                    with tempfile.TemporaryDirectory() as tmp:
                        out = os.path.join(tmp, "r.parquet")
                        jargs = job_parser().parse_args([
                            args.input, "-o", out, "--actors", "split", "--drafters", str(drafters),
                            "--targets", str(targets),
                            "--batch-tokens", str(budget), "--method", method, *job_args])
                        rows.append(row(method, drafters, targets, budget, transcribe(jargs), out))
                    print(rows[-1], flush=True)
    write_outputs(args.output, rows, machine() + f"; in-process reference rows: {threads} torch threads; job options: "
                  + (" ".join(job_args) or "defaults"))
    return 0


def write_outputs(folder: str, rows: list[dict], caption: str) -> None:
    """``scaling.md`` (caption + table), ``scaling.csv`` and, with matplotlib, ``scaling.png`` in ``folder``."""
    os.makedirs(folder, exist_ok=True)
    md = [caption, "", "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    md += ["| " + " | ".join(str(r[c]) for c in COLUMNS) + " |" for r in rows]
    with open(os.path.join(folder, "scaling.md"), "w") as f:
        f.write("\n".join(md) + "\n")
    with open(os.path.join(folder, "scaling.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        w.writerows(rows)
    print("\n".join(md))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    methods = sorted({r["method"] for r in rows})
    ray_rows = [r for r in rows if r["targets"]]
    for key in sorted({(r["method"], r["drafters"], r["batch_tokens"]) for r in ray_rows}):
        sub = [r for r in ray_rows if (r["method"], r["drafters"], r["batch_tokens"]) == key]
        ax.plot([r["targets"] for r in sub], [r["rtfx"] for r in sub], color=f"C{methods.index(key[0])}",
                linestyle="-" if key[1] == 1 else "--", marker="o" if key[2] == min(r["batch_tokens"] for r in rows)
                else "s", label=f"{key[0]}, {key[1]} drafter(s), {key[2]} tokens")
    for r in rows:
        if not r["targets"]:  # in-process references
            ax.axhline(r["rtfx"], color=f"C{methods.index(r['method'])}", linewidth=0.6, linestyle=":")
    ax.set_xticks(sorted({r["targets"] for r in ray_rows}))
    ax.set_xlabel("target actors (dotted: the same decoder in one process, no Ray)")
    ax.set_ylabel("RTFx (audio s / wall s)")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(os.path.join(folder, "scaling.png"), dpi=120)


if __name__ == "__main__":
    sys.exit(main())
