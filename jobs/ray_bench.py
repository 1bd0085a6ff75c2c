"""The Ray jobs against one process: the in-process ``rayspec transcribe`` path, the Ray job (default colocated
layout) and the Ray Data pipeline on one node of 2 CPUs, and the Ray job on 2 nodes of 1 CPU (local clusters of
several raylets on loopback, :mod:`actors.local_cluster`), on the same manifest, with the same texts checked.

    python -m jobs.ray_bench /tmp/lj.jsonl -o bench/ray-jobs --repeats 1

Every configuration gets the same CPUs: the in-process run ``--cpus`` torch threads; a Ray node of ``--cpus`` CPUs;
or ``--cpus`` nodes of one CPU. The Ray job and the Ray Data pipeline run with their defaults (one one-thread
transcriber actor per CPU), plus, on one node, the Ray job with one actor of ``--cpus`` threads (``--targets 1
--actor-cpus N``: one model copy, the least memory). Each cluster has a head node without CPUs (GCS and driver). Rounds
alternate the order (in-process, 1 node, N nodes, then reversed). Times: ``wall_s`` from the first batch (Ray Data:
its first transcription call) to the last row; ``load_s`` the model loading or actor start-up before it (Ray Data:
also its manifest read, ``jobs.transcribe_data.startup_seconds``); ``total_s`` their sum. Arguments not listed below
(``--target``, ``--method``, ...) go to every configuration. Writes ``ray-jobs.md``, ``ray-jobs.csv`` and
``ray-jobs.png``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import actors.pool  # noqa: F401 - first: sets the loopback Ray environment
import ray  # noqa: E402

from jobs.transcribe import build_parser as job_parser  # noqa: E402
from jobs.transcribe import transcribe  # noqa: E402
from jobs.transcribe_data import build_parser as data_parser  # noqa: E402
from jobs.transcribe_data import transcribe_data  # noqa: E402
from jobs.scaling import cpu_model, in_process  # noqa: E402
from actors.local_cluster import start_local_cluster  # noqa: E402
from rayspec.bench.tables import write_table  # noqa: E402
from rayspec.manifest import read_manifest  # noqa: E402
from rayspec.results import read_results  # noqa: E402

COLUMNS = ["config", "nodes", "cpus_per_node", "repeat", "utterances", "audio_s", "load_s", "wall_s", "total_s",
           "rtfx", "utt_per_s", "wall_vs_in_process", "total_vs_in_process", "texts_equal"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m jobs.ray_bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("input", help="manifest (absolute audio paths, or paths relative to it)")
    p.add_argument("-o", "--output", default="bench/ray-jobs", help="output folder (default bench/ray-jobs)")
    p.add_argument("--cpus", type=int, default=2, help="CPUs of every configuration (default 2)")
    p.add_argument("--repeats", type=int, default=1, help="rounds, alternating the order (default 1)")
    return p


def _texts(out: str) -> dict:
    return {r["id"]: r["text"] for r in read_results(out).to_pylist()}


def in_process_run(manifest: str, out: str, extra: list[str], cpus: int) -> dict:
    """``rayspec transcribe``'s path (:func:`jobs.scaling.in_process`) with ``cpus`` torch threads."""
    s = in_process(manifest, out, extra, cpus)
    return {"utterances": s.written, "audio_s": s.audio_s, "load_s": s.startup_s, "wall_s": s.wall_s}


def ray_job(manifest: str, out: str, extra: list[str], count: int | None = None, cpus: int = 1) -> dict:
    """The Ray job, colocated layout: its default (one one-thread actor per CPU), or ``count`` actors of ``cpus``
    CPUs (and torch threads) each."""
    flags = [] if count is None else ["--targets", str(count), "--actor-cpus", str(cpus)]
    s = transcribe(job_parser().parse_args([manifest, "-o", out, *flags, *extra]))
    return {"utterances": s.written, "audio_s": s.audio_s, "load_s": s.startup_s, "wall_s": s.wall_s}


def ray_data(manifest: str, out: str, extra: list[str]) -> dict:
    """The Ray Data pipeline with its defaults (one one-thread transcriber actor per CPU)."""
    s = transcribe_data(data_parser().parse_args([manifest, "-o", out, *extra]))
    return {"utterances": s.written, "audio_s": s.audio_s, "load_s": s.startup_s, "wall_s": s.wall_s}


def caption(args, extra: list[str], n: int) -> str:
    return (f"{n} utterances of {os.path.basename(args.input)}; {args.cpus} CPUs per configuration ({cpu_model()}); "
            f"{args.repeats} round(s), alternating; options: {' '.join(extra) or 'defaults'}; "
            f"{time.strftime('%Y-%m-%d', time.gmtime())}")


def main(argv=None) -> int:
    args, extra = build_parser().parse_known_args(argv)
    n = len(read_manifest(args.input))
    rows, ref = [], {}

    def record(config, nodes, per_node, r, res, out):
        texts = _texts(out)
        if config == "in-process":
            ref[r] = (res, texts)
        base, base_texts = ref[r]
        res = {"config": config, "nodes": nodes, "cpus_per_node": per_node, "repeat": r, **res}
        res["total_s"] = res["load_s"] + res["wall_s"]
        res["rtfx"] = res["audio_s"] / res["wall_s"]
        res["utt_per_s"] = res["utterances"] / res["wall_s"]
        res["wall_vs_in_process"] = res["wall_s"] / (base["wall_s"])
        res["total_vs_in_process"] = res["total_s"] / (base["load_s"] + base["wall_s"])
        res["texts_equal"] = f"{sum(texts.get(k) == v for k, v in base_texts.items())}/{len(base_texts)}"
        rows.append({k: round(v, 3) if isinstance(v, float) else v for k, v in res.items()})
        write_outputs(args.output, rows, caption(args, extra, n))  # after every run: a cut-short run keeps its rows

    for r in range(args.repeats):
        steps = ["in-process", "one-node", "nodes"]
        order = steps if r % 2 == 0 else ["in-process"] + steps[:0:-1]  # the reference first: ratios need it
        for step in order:
            with tempfile.TemporaryDirectory() as tmp:
                if step == "in-process":
                    out = os.path.join(tmp, "r.parquet")
                    record("in-process", 1, args.cpus, r, in_process_run(args.input, out, extra, args.cpus), out)
                    continue
                nodes, per_node = (1, args.cpus) if step == "one-node" else (args.cpus, 1)
                cluster = start_local_cluster(nodes, per_node, object_store_mb=500)
                try:
                    if step == "one-node":
                        jobs = {"ray job": lambda out: ray_job(args.input, out, extra),
                                "ray data": lambda out: ray_data(args.input, out, extra),
                                "ray job, 1 actor": lambda out: ray_job(args.input, out, extra, 1, args.cpus)}
                        for name in (list(jobs) if r % 2 == 0 else list(jobs)[::-1]):
                            out = os.path.join(tmp, name.replace(" ", "-").replace(",", ""))
                            out += "" if name == "ray data" else ".parquet"
                            record(name, 1, args.cpus, r, jobs[name](out), out)
                    else:
                        out = os.path.join(tmp, "nodes.parquet")
                        record("ray job", nodes, 1, r, ray_job(args.input, out, extra), out)
                finally:
                    ray.shutdown()
                    cluster.shutdown()
    return 0


def summary(rows: list[dict]) -> list[str]:
    """The goals' table: per configuration, its wall seconds summed over the rounds over the in-process run's summed
    wall seconds (the rounds alternate the order, so a slow spell of the host counts against every configuration),
    the same for the totals (model loading or actor start-up included), and
    its throughput (utterances per second) over the 1-node Ray job's."""
    keys = list(dict.fromkeys((r["config"], r["nodes"], r["cpus_per_node"]) for r in rows))

    def summed(col):
        return {k: sum(r[col] for r in rows if (r["config"], r["nodes"], r["cpus_per_node"]) == k) for k in keys}

    wall, total = summed("wall_s"), summed("total_s")
    runs = {k: sum((r["config"], r["nodes"], r["cpus_per_node"]) == k for r in rows) for k in keys}
    base = next((k for k in keys if k[0] == "in-process"), None)
    one_node = next((k for k in keys if k[0] == "ray job" and k[1] == 1), None)
    out = ["| configuration | nodes x CPUs | rounds | wall s, summed | wall / in-process, summed | "
           "total / in-process, summed | throughput / 1-node Ray job |", "|---|---|---|---|---|---|---|"]
    for k in keys:
        same = base and runs[k] == runs[base]
        vs = f"{wall[k] / wall[base]:.2f}x" if same else "-"
        vs_total = f"{total[k] / total[base]:.2f}x" if same else "-"
        tp = f"{wall[one_node] / wall[k]:.2f}x" if one_node and runs[k] == runs[one_node] else "-"
        out.append(f"| {k[0]} | {k[1]} x {k[2]} | {runs[k]} | {wall[k]:.2f} | {vs} | {vs_total} | {tp} |")
    return out


def write_outputs(folder: str, rows: list[dict], text: str) -> None:
    """``ray-jobs.md`` (caption, table, then the goals' :func:`summary`), ``ray-jobs.csv`` and, with matplotlib,
    ``ray-jobs.png`` in ``folder``."""
    os.makedirs(folder, exist_ok=True)
    goals = summary(rows)
    write_table(os.path.join(folder, "ray-jobs"), text, COLUMNS, [[r[c] for c in COLUMNS] for r in rows],
                "\n" + "\n".join(goals) + "\n")
    print(goals[-1], flush=True)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(max(7, 1.1 * len(rows)), 4.5))
    labels = [f"{r['config'].replace(', ', chr(10))}\n{r['nodes']} x {r['cpus_per_node']} CPU\nround {r['repeat']}"
              for r in rows]
    ax.bar(range(len(rows)), [r["wall_s"] for r in rows], label="wall (first batch to last row)")
    ax.bar(range(len(rows)), [r["load_s"] for r in rows], bottom=[r["wall_s"] for r in rows],
           label="model loading / actor start-up", alpha=0.5)
    ax.set_xticks(range(len(rows)), labels, fontsize=7)
    ax.set_ylabel("seconds")
    ax.set_ylim(0, 1.25 * max(r["wall_s"] + r["load_s"] for r in rows))
    ax.legend(fontsize=8, loc="upper center", ncols=2)
    fig.tight_layout()
    fig.savefig(os.path.join(folder, "ray-jobs.png"), dpi=120)


if __name__ == "__main__":
    sys.exit(main())
