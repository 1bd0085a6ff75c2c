"""Peak memory of a command and every process it starts (a Ray job: the driver, raylet, GCS, actors...).

Samples the process tree every ``--every`` seconds and prints the peak of the summed RSS and of the summed PSS
(proportional set size: a page shared by N processes counts 1/N in each, so Ray's shared object store and shared
libraries are not counted once per process, as the RSS sum does), plus the largest single process.

    python scripts/peak_rss.py -- python -m jobs.transcribe ../shared/data/ljspeech/clips.jsonl -o /tmp/lj.parquet
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--every", type=float, default=0.25, help="seconds between samples")
    p.add_argument("command", nargs=argparse.REMAINDER, help="the command, after --")
    args = p.parse_args()
    cmd = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not cmd:
        p.error("no command given")
    import psutil

    proc = subprocess.Popen(cmd)
    root = psutil.Process(proc.pid)
    peak_rss = peak_pss = peak_one = 0
    biggest = ""
    at_peak: list[tuple[int, int, str]] = []  # (pss, rss, name) of each process when the summed PSS peaked
    t0 = time.perf_counter()
    while proc.poll() is None:
        rss = pss = 0
        sample = []
        for q in [root, *root.children(recursive=True)]:
            try:
                info = q.memory_full_info()
                name = " ".join(q.cmdline()[:3])[:80]
            except psutil.Error:
                continue
            rss, pss = rss + info.rss, pss + info.pss
            sample.append((info.pss, info.rss, name))
            if info.rss > peak_one:
                peak_one, biggest = info.rss, name
        if pss > peak_pss:
            at_peak = sorted(sample, reverse=True)
        peak_rss, peak_pss = max(peak_rss, rss), max(peak_pss, pss)
        time.sleep(args.every)
    mib = 1 << 20
    print(f"exit status {proc.returncode}, {time.perf_counter() - t0:.1f} s; peak summed RSS {peak_rss / mib:.0f} MiB, "
          f"peak summed PSS {peak_pss / mib:.0f} MiB; largest process {peak_one / mib:.0f} MiB RSS ({biggest})",
          file=sys.stderr)
    print("processes at the peak of the summed PSS (PSS / RSS MiB):", file=sys.stderr)
    for p_, r_, name in at_peak:
        print(f"  {p_ / mib:7.0f} {r_ / mib:7.0f}  {name}", file=sys.stderr)
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
