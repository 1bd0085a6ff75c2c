"""How the TTS defaults were chosen on dev sentences of the teacher data: pcg's theta and lookahead (speed and
Whisper WER), and with ``--sweep`` the speaking rate and temperature (Whisper WER and frames per target pass).

Dev sentences are LJSpeech text-only ids whose CRC-32 is 0 mod 50 (the TTS data recipe's dev rule: never trained
on) and that have no recording in ``clips.jsonl`` (so none of the tts benchmark's held-out sentences, nor any of
LJ002-0002..0100), ``--sentences`` of them spread over the file. Whisper base (rayspec's engine) transcribes the
audio; WER after Whisper's normalizer.

Default mode: each configuration synthesises the sentences at each batch size, round-robin over the configurations,
``--repeats`` times, the fastest run counting (1 torch thread + the vocoder's, as the tts benchmark). Writes
``defaults.md`` and ``defaults.csv`` into ``-o``.

``--sweep``: WER only, no timing. Every ``--methods`` (pcg at its default theta and lookahead, and/or target-only)
x ``--speeds`` x ``--temperatures`` x ``--seeds`` cell synthesises the sentences at batch 16, seed-major (every cell
of seed 0 first). Each cell's counts are appended to ``sweep-runs.csv`` as it finishes, and cells already there
are skipped, so a sweep can run in pieces (``--max-minutes``). Then ``sweep.md`` / ``sweep.csv`` summarise each
(method, speed, temperature) over its seeds, and :func:`pick` names the chosen pcg cell.

    python scripts/tts_dev_defaults.py ../shared/data/ljspeech -o bench/tts-dev
    python scripts/tts_dev_defaults.py ../shared/data/ljspeech -o bench/tts-dev --sweep --sentences 100 --max-minutes 14
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import time
import zlib

RUN_FIELDS = ["method", "speed", "temperature", "seed", "sentences", "words", "errors", "frames", "target_passes",
              "audio_s"]


def dev_sentences(ljspeech: str, n: int) -> list[list[str]]:
    """``n`` rows ``[id, text, normalized text]`` of ``metadata_text_only.csv`` by the dev rule (see above)."""
    with open(os.path.join(ljspeech, "clips.jsonl")) as f:
        recorded = {json.loads(line)["id"] for line in f}
    with open(os.path.join(ljspeech, "metadata_text_only.csv"), newline="") as f:
        rows = list(csv.reader(f, delimiter="|", quoting=csv.QUOTE_NONE))
    dev = [r for r in rows if zlib.crc32(r[0].encode()) % 50 == 0 and r[0] not in recorded]
    return dev[::max(1, len(dev) // n)][:n]


def whisper_wer(asr, texts: list[str], results) -> tuple[float, int, int]:
    """``(WER, words, word errors)`` of Whisper base's transcripts of ``results``' audio against ``texts``."""
    from rayspec.manifest import Utterance
    from rayspec.metrics import error_rates

    hyps = [r.text for r in asr.transcribe([Utterance(f"u{i}", "") for i in range(len(results))],
                                            [r.audio for r in results])]
    e = error_rates(texts, hyps)
    return e.wer, e.words, round(e.wer * e.words)


def timed_defaults(args, synth, asr, rows) -> str:
    """The default mode (see the module docstring): ``defaults.md`` / ``.csv``; returns the Markdown."""
    from rayspec.bench.tables import write_table
    from rayspec.tts.flags import SamplingOptions

    texts = [r[2] for r in rows]
    synth.synthesize(texts[:2], SamplingOptions("sd"), 0)  # warm-up
    cfgs = [("target-only", SamplingOptions("target")), ("sd", SamplingOptions("sd"))]
    cfgs += [(f"pcg theta={t:g} lookahead={k}", SamplingOptions("pcg", theta=t, lookahead=k))
             for t in args.thetas for k in args.lookaheads]
    walls: dict = {}
    outputs: dict = {}
    for _ in range(args.repeats):
        for bs in args.batch_sizes:
            for name, opts in cfgs:
                t0 = time.perf_counter()
                outputs[name] = synth.synthesize(texts, opts, 0, batch_size=bs)
                walls.setdefault((name, bs), []).append(time.perf_counter() - t0)
                print(f"{name} batch {bs}: {walls[name, bs][-1]:.2f} s", flush=True)
    cells = []
    for name, _ in cfgs:
        res = outputs[name]
        cells.append([name, f"{sum(r.frames for r in res) / sum(r.target_passes for r in res):.2f}",
                      f"{100 * whisper_wer(asr, texts, res)[0]:.1f}"]
                     + [f"{min(walls['target-only', b]) / min(walls[name, b]):.2f}x" for b in args.batch_sizes])
    title = (f"pcg defaults on {len(texts)} dev sentences of the teacher data ({rows[0][0]} .. {rows[-1][0]}), "
             f"1 torch thread + the vocoder's, fastest of {args.repeats} round-robin runs, WER by Whisper base")
    return write_table(os.path.join(args.output, "defaults"), title,
                       ["config", "frames / target pass", "WER %"] + [f"speed-up bs{b}" for b in args.batch_sizes],
                       cells)


def read_runs(path: str) -> list[dict]:
    """The rows of ``sweep-runs.csv`` (none if it does not exist yet)."""
    if not os.path.exists(path):
        return []
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def cell_key(method: str, speed, temperature, seed) -> tuple:
    return method, f"{float(speed):g}", f"{float(temperature):g}", int(seed)


def sweep(args, synth, asr, rows, deadline: float) -> bool:
    """Run the sweep's missing cells (see the module docstring) until ``deadline`` (``time.monotonic``); returns
    whether every cell is done."""
    from rayspec.tts.flags import SamplingOptions

    texts = [r[2] for r in rows]
    path = os.path.join(args.output, "sweep-runs.csv")
    done = {cell_key(r["method"], r["speed"], r["temperature"], r["seed"]) for r in read_runs(path)}
    todo = [cell_key(m, s, t, seed) for seed in args.seeds for m in args.methods for s in args.speeds
            for t in args.temperatures]
    todo = [k for k in todo if k not in done]
    for method, speed, temperature, seed in todo:
        if time.monotonic() > deadline:
            return False
        t0 = time.perf_counter()
        res = synth.synthesize(texts, SamplingOptions(method, float(temperature)), seed, speed=float(speed))
        t1 = time.perf_counter()
        wer, words, errors = whisper_wer(asr, texts, res)
        new = not os.path.exists(path)
        with open(path, "a", newline="") as f:
            w = csv.writer(f)
            if new:
                w.writerow(RUN_FIELDS)
            w.writerow([method, speed, temperature, seed, len(texts), words, errors, sum(r.frames for r in res),
                        sum(r.target_passes for r in res), f"{sum(r.duration_s for r in res):.2f}"])
        print(f"{method} speed {speed} temperature {temperature} seed {seed}: WER {100 * wer:.1f}% "
              f"(synthesis {t1 - t0:.0f} s, Whisper {time.perf_counter() - t1:.0f} s)", flush=True)
    return True


def summarize(runs: list[dict]) -> list[dict]:
    """Per (method, speed, temperature): seeds, mean and per-seed WER (%), and frames per target pass pooled over
    the seeds."""
    groups: dict = {}
    for r in runs:
        groups.setdefault((r["method"], float(r["speed"]), float(r["temperature"])), []).append(r)
    out = []
    for (method, speed, temperature), rs in sorted(groups.items(), key=lambda g: (g[0][0] != "pcg", -g[0][1],
                                                                                   -g[0][2])):
        rs.sort(key=lambda r: int(r["seed"]))
        wers = [100 * int(r["errors"]) / int(r["words"]) for r in rs]
        out.append({"method": method, "speed": speed, "temperature": temperature, "seeds": [int(r["seed"]) for r in rs],
                    "wers": wers, "wer": statistics.mean(wers),
                    "frames_per_pass": sum(int(r["frames"]) for r in rs) / sum(int(r["target_passes"]) for r in rs),
                    "audio_s": statistics.mean(float(r["audio_s"]) for r in rs)})
    return out


def pick(cells: list[dict], min_frames_per_pass: float, noise: float, speed: float, temperature: float) -> dict:
    """The chosen pcg cell: of those with every seed run and at least ``min_frames_per_pass`` frames per target
    pass, the lowest mean WER; then, of the cells within ``noise`` points of it, the mildest change from the
    defaults before the sweep, ``speed`` and ``temperature`` (the rate nearest ``speed`` first, then the temperature
    nearest ``temperature``)."""
    full = max(len(c["seeds"]) for c in cells)
    ok = [c for c in cells if c["method"] == "pcg" and len(c["seeds"]) == full
          and c["frames_per_pass"] >= min_frames_per_pass]
    best = min(c["wer"] for c in ok)
    return min((c for c in ok if c["wer"] <= best + noise),
               key=lambda c: (abs(c["speed"] - speed), abs(c["temperature"] - temperature), c["wer"]))


def sweep_table(args, rows) -> str:
    """``sweep.md`` / ``.csv`` from ``sweep-runs.csv``; returns the Markdown."""
    from rayspec.bench.tables import write_table

    cells = summarize(read_runs(os.path.join(args.output, "sweep-runs.csv")))
    before = float(args.speeds[0]), float(args.temperatures[0])
    chosen = pick(cells, args.min_frames_per_pass, args.noise, *before)
    body = [[c["method"], f"{c['speed']:g}", f"{c['temperature']:g}", " / ".join(f"{w:.1f}" for w in c["wers"]),
             f"{c['wer']:.1f}", f"{c['frames_per_pass']:.2f}", f"{c['audio_s']:.0f}",
             "chosen" if c is chosen else ""] for c in cells]
    words = read_runs(os.path.join(args.output, "sweep-runs.csv"))[0]["words"]
    title = (f"speaking rate x temperature on {len(rows)} dev sentences of the teacher data ({rows[0][0]} .. "
             f"{rows[-1][0]}, {words} words), batch 16, WER by Whisper base, one draw per seed")
    notes = (f"\nChosen (`pick`): of the pcg cells with every seed and >= {args.min_frames_per_pass:g} frames per "
             f"target pass, the lowest mean WER; then, within {args.noise:g} points of it, the mildest change from the "
             f"defaults before the sweep (the rate nearest {before[0]:g}, then the temperature nearest {before[1]:g}). "
             "Each cell's counts: `sweep-runs.csv`.\n")
    return write_table(os.path.join(args.output, "sweep"), title,
                       ["method", "speed", "temperature", "WER % per seed", "mean WER %", "frames / target pass",
                        "audio s (mean)", ""], body, notes)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("ljspeech", help="the LJSpeech folder (metadata_text_only.csv, clips.jsonl)")
    p.add_argument("--sentences", type=int, default=30)
    p.add_argument("--thetas", type=float, nargs="+", default=[0.9, 0.8, 0.7])
    p.add_argument("--lookaheads", type=int, nargs="+", default=[3, 4, 5])
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[16, 1])
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--sweep", action="store_true", help="the speaking rate x temperature sweep (WER only)")
    p.add_argument("--methods", nargs="+", choices=["pcg", "target"], default=["pcg"], help="sweep: methods")
    p.add_argument("--speeds", nargs="+", default=["1", "0.9", "0.85", "0.8", "0.75"],
                   help="sweep: speaking rates, the one in use first (pick's mildest change is the nearest to it)")
    p.add_argument("--temperatures", nargs="+", default=["0.6", "0.45", "0.3"],
                   help="sweep: temperatures, the one used before first (as --speeds)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="sweep: base seeds")
    p.add_argument("--max-minutes", type=float, default=None,
                   help="sweep: start no cell after this many minutes (run again to go on)")
    p.add_argument("--min-frames-per-pass", type=float, default=4.0, help="sweep: pick's floor (see pick)")
    p.add_argument("--noise", type=float, default=1.0, help="sweep: pick's noise band in WER points (see pick)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (the timed mode: keep 1)")
    p.add_argument("-o", "--output", required=True, help="folder for the tables")
    args = p.parse_args()
    deadline = time.monotonic() + 60 * (args.max_minutes or float("inf"))

    import torch

    from rayspec.pipeline import Transcriber
    from rayspec.tts.synthesis import Synthesizer

    torch.set_num_threads(args.threads)
    os.makedirs(args.output, exist_ok=True)
    rows = dev_sentences(args.ljspeech, args.sentences)
    synth, asr = Synthesizer(), Transcriber("whisper-base")
    if not args.sweep:
        print(timed_defaults(args, synth, asr, rows))
    elif sweep(args, synth, asr, rows, deadline):
        print(sweep_table(args, rows))


if __name__ == "__main__":
    main()
