"""What a user waits for: ``ray job submit`` of the transcription job, from the command to its exit, against
``rayspec transcribe`` as a whole process, on the same manifest and CPUs, with the same texts checked.

    python -m jobs.ray_e2e clips.jsonl -o bench/ray-jobs/e2e --repeats 2

Starts a local Ray head with a job server (``ray start --head --block`` on loopback, ``--cpus`` CPUs, its own
ports and temporary folder; stopped at the end), unless ``--address`` names a running cluster's job server
(``http://127.0.0.1:8265``). Rounds alternate the order. Each run is a fresh process, timed from its start to its exit
(start-up, model loading, audio decoding, transcription, the Parquet write, Ray's job submission and log tailing). The
table also splits each run with the summary line the command prints itself: ``transcribe_s`` (first batch to last
row) and, for the job, ``startup_s`` (the actors' start and model loading); ``other_s`` is the rest (process start-up
and imports, the in-process model loading, Ray's job submission, the driver's start and the job's end). Arguments
not listed below (``--method``, ``--target``, ...) go to both commands. Writes ``ray-e2e.md`` and ``ray-e2e.csv``.
"""

from __future__ import annotations

import argparse
import os
import re
import socket
import subprocess
import sys
import tempfile
import time

from rayspec.bench.tables import write_table
from rayspec.results import read_results

COLUMNS = ["config", "repeat", "utterances", "audio_s", "end_to_end_s", "transcribe_s", "startup_s", "other_s",
           "vs_in_process", "texts_equal"]
SUMMARY = re.compile(r"(\d+) utterances written .*?, ([\d.]+) s of audio in ([\d.]+) s(?: after ([\d.]+) s of start-up)?")
"""The summary line both commands print (:func:`rayspec.options.print_summary`)."""
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m jobs.ray_e2e", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("input", help="manifest (absolute audio paths: the job runs in another folder)")
    p.add_argument("-o", "--output", default="bench/ray-jobs/e2e", help="output folder (default bench/ray-jobs/e2e)")
    p.add_argument("--cpus", type=int, default=2, help="CPUs of the local Ray head (default 2)")
    p.add_argument("--address", help="a running cluster's job server (default: start a local head)")
    p.add_argument("--repeats", type=int, default=1, help="rounds, alternating the order (default 1)")
    return p


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_head(cpus: int, temp_dir: str) -> tuple[subprocess.Popen, str]:
    """A local Ray head with a job server on loopback (``ray start --head --block``); returns the process and the
    job server's address once it answers.

    Raises:
        RuntimeError: the head did not answer within 120 s.
    """
    from ray.job_submission import JobSubmissionClient

    dash = _free_port()
    proc = subprocess.Popen(
        ["ray", "start", "--head", "--block", f"--num-cpus={cpus}", "--node-ip-address=127.0.0.1",
         f"--port={_free_port()}", "--include-dashboard=true", "--dashboard-host=127.0.0.1",
         f"--dashboard-port={dash}", f"--temp-dir={temp_dir}", "--disable-usage-stats"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    address = f"http://127.0.0.1:{dash}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            JobSubmissionClient(address).list_jobs()
            return proc, address
        except Exception:  # not up yet
            time.sleep(0.5)
    proc.terminate()
    raise RuntimeError("the local Ray head's job server did not answer within 120 s")


def timed(cmd: list[str], env: dict | None = None) -> tuple[float, str]:
    """Run ``cmd`` from the repository's root; its wall seconds and its output.

    Raises:
        RuntimeError: the command failed (its last lines in the message).
    """
    t0 = time.perf_counter()
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    if r.returncode:
        tail = "\n".join((r.stdout + r.stderr).splitlines()[-15:])
        raise RuntimeError(f"{' '.join(cmd[:4])} ... exited with {r.returncode}:\n{tail}")
    return seconds, r.stdout + r.stderr


def run_once(config: str, manifest: str, out: str, extra: list[str], address: str) -> dict:
    """One timed run of ``config`` ("in-process": ``rayspec transcribe``; "ray job submit": the job)."""
    if config == "in-process":
        cmd = [sys.executable, "-m", "rayspec.cli", "transcribe", manifest, "-o", out, "-q", *extra]
    else:
        cmd = ["ray", "job", "submit", f"--address={address}", "--working-dir", ".", "--",
               "python", "-m", "jobs.transcribe", manifest, "-o", out, *extra]
    seconds, log = timed(cmd)
    m = SUMMARY.search(log)
    if not m:
        raise RuntimeError(f"{config}: no summary line in its output")
    n, audio_s, wall_s, startup_s = int(m[1]), float(m[2]), float(m[3]), float(m[4] or 0)
    return {"config": config, "utterances": n, "audio_s": audio_s, "end_to_end_s": seconds, "transcribe_s": wall_s,
            "startup_s": startup_s, "other_s": seconds - wall_s - startup_s}


def main(argv=None) -> int:
    args, extra = build_parser().parse_known_args(argv)
    manifest = os.path.abspath(args.input)
    rows = []
    with tempfile.TemporaryDirectory(prefix="rayspec-e2e-") as tmp:
        head = None
        address = args.address
        if not address:
            head, address = start_head(args.cpus, os.path.join(tmp, "ray"))
        try:
            for r in range(args.repeats):
                order = ["in-process", "ray job submit"][:: 1 if r % 2 == 0 else -1]
                runs = {}
                for config in order:
                    out = os.path.join(tmp, f"{config.replace(' ', '-')}-{r}.parquet")
                    runs[config] = (run_once(config, manifest, out, extra, address), out)
                    print(f"round {r}: {config} {runs[config][0]['end_to_end_s']:.1f} s", flush=True)
                base, base_out = runs["in-process"]
                texts = {k: {x["id"]: x["text"] for x in read_results(o).to_pylist()} for k, (_, o) in runs.items()}
                for config in order:
                    row = dict(runs[config][0], repeat=r)
                    row["vs_in_process"] = row["end_to_end_s"] / base["end_to_end_s"]
                    same = sum(texts[config].get(k) == v for k, v in texts["in-process"].items())
                    row["texts_equal"] = f"{same}/{len(texts['in-process'])}"
                    rows.append({k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()})
                write_outputs(args.output, rows, caption(args, extra, rows))
        finally:
            if head is not None:
                head.terminate()
                head.wait(timeout=60)
    return 0


def caption(args, extra: list[str], rows: list[dict]) -> str:
    from jobs.scaling import cpu_model

    return (f"{rows[0]['utterances']} utterances of {os.path.basename(args.input)}; whole processes; a local Ray head "
            f"of {args.cpus} CPUs ({cpu_model()}); {args.repeats} round(s), alternating; options: "
            f"{' '.join(extra) or 'defaults'}; {time.strftime('%Y-%m-%d', time.gmtime())}")


def summary(rows: list[dict]) -> list[str]:
    """Per configuration, its end-to-end seconds and their parts summed over the rounds, and the sum over the
    in-process run's."""
    configs = list(dict.fromkeys(r["config"] for r in rows))
    total = {c: {k: sum(r[k] for r in rows if r["config"] == c) for k in
                 ("end_to_end_s", "transcribe_s", "startup_s", "other_s")} for c in configs}
    base = total["in-process"]["end_to_end_s"]
    out = ["| configuration | end to end s, summed | transcription s | actor start-up s | the rest s | "
           "end to end / in-process |", "|---|---|---|---|---|---|"]
    for c in configs:
        t = total[c]
        out.append(f"| {c} | {t['end_to_end_s']:.1f} | {t['transcribe_s']:.1f} | {t['startup_s']:.1f} | "
                   f"{t['other_s']:.1f} | {t['end_to_end_s'] / base:.2f}x |")
    return out


def write_outputs(folder: str, rows: list[dict], text: str) -> None:
    """``ray-e2e.md`` (caption, table, then the :func:`summary`) and ``ray-e2e.csv`` in ``folder``."""
    os.makedirs(folder, exist_ok=True)
    goals = summary(rows)
    write_table(os.path.join(folder, "ray-e2e"), text, COLUMNS, [[r[c] for c in COLUMNS] for r in rows],
                "\n" + "\n".join(goals) + "\n")
    print(goals[-1], flush=True)


if __name__ == "__main__":
    sys.exit(main())
