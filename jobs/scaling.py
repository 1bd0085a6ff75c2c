"""Scaling run: throughput (RTFx, utterances/s) against transcriber replicas and the batch token budget.

    ray job submit --working-dir . -- python -m jobs.scaling ../shared/data/an4/test.jsonl --actors 1 2 \
        --batch-tokens 4000 16000 -o scaling

Each point runs the full Ray pipeline of :mod:`jobs.transcribe` (actors, object refs, bounded in-flight batches)
into a fresh output and times it end to end, actor start-up and model loading included. Writes
``scaling.md`` (with the cluster's resources), ``scaling.csv`` and ``scaling.png`` to the output folder.
"""

from __future__ import annotations

import argparse
import csv
import os
import sys
import tempfile
import time

from jobs.transcribe import build_parser as job_parser  # first: sets the loopback environment for Ray
from jobs.transcribe import connect, run
from rayspec.manifest import read_manifest

import ray  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m jobs.scaling", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("input", help="manifest or folder of audio")
    p.add_argument("-o", "--output", default="scaling", help="output folder")
    p.add_argument("--actors", type=int, nargs="+", default=[1, 2])
    p.add_argument("--batch-tokens", type=int, nargs="+", default=[4000, 16000])
    p.add_argument("--actor-cpus", type=float, default=1.0)
    p.add_argument("--actor-gpus", type=float, default=0.0)
    p.add_argument("--method", default="ar")
    p.add_argument("--address")
    p.add_argument("--num-cpus", type=int, default=None)
    args = p.parse_args(argv)
    connect(args.address, args.num_cpus)
    utts = read_manifest(args.input)
    audio_s = sum(u.duration_s or 0 for u in utts)
    rows = []
    for n in args.actors:
        for budget in args.batch_tokens:
            with tempfile.TemporaryDirectory() as tmp:
                jargs = job_parser().parse_args([
                    args.input, "-o", os.path.join(tmp, "r.parquet"), "--actors", str(n), "--actor-cpus",
                    str(args.actor_cpus), "--actor-gpus", str(args.actor_gpus), "--batch-tokens", str(budget),
                    "--method", args.method])
                t0 = time.perf_counter()
                run(jargs)
                wall = time.perf_counter() - t0
            rows.append({"actors": n, "batch_tokens": budget, "utterances": len(utts), "audio_s": round(audio_s, 1),
                         "wall_s": round(wall, 2), "rtfx": round(audio_s / wall, 2),
                         "utt_per_s": round(len(utts) / wall, 2)})
            print(rows[-1], flush=True)
    os.makedirs(args.output, exist_ok=True)
    res = ray.cluster_resources()
    head = ["actors", "batch_tokens", "utterances", "audio_s", "wall_s", "rtfx", "utt_per_s"]
    md = [f"Cluster: {res.get('CPU', 0):.0f} CPUs, {res.get('GPU', 0):.0f} GPUs; method {args.method}; "
          f"{args.actor_cpus} CPU / {args.actor_gpus} GPU per actor; wall time includes actor start-up.", "",
          "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    md += ["| " + " | ".join(str(r[h]) for h in head) + " |" for r in rows]
    with open(os.path.join(args.output, "scaling.md"), "w") as f:
        f.write("\n".join(md) + "\n")
    with open(os.path.join(args.output, "scaling.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=head)
        w.writeheader()
        w.writerows(rows)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        for budget in args.batch_tokens:
            sub = [r for r in rows if r["batch_tokens"] == budget]
            ax.plot([r["actors"] for r in sub], [r["rtfx"] for r in sub], marker="o", label=f"{budget} tokens")
        ax.set_xlabel("transcriber actors")
        ax.set_ylabel("RTFx")
        ax.legend()
        fig.tight_layout()
        fig.savefig(os.path.join(args.output, "scaling.png"), dpi=120)
    except ImportError:
        pass
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
