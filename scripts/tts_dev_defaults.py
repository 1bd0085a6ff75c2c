"""How pcg's defaults (theta, lookahead) were chosen: speed and Whisper WER on dev sentences of the teacher data.

Dev sentences are LJSpeech text-only ids whose CRC-32 is 0 mod 50 (the TTS data recipe's dev rule: never trained
on) and that have no recording in ``clips.jsonl`` (so none of the tts benchmark's held-out sentences), 30 of them
spread over the file. Each configuration synthesises them at each batch size, round-robin over the configurations,
``--repeats`` times, the fastest run counting (1 torch thread + the vocoder's, as the tts benchmark); Whisper base
(rayspec's engine) transcribes the audio. Writes ``defaults.md`` and ``defaults.csv`` into ``-o``.

    python scripts/tts_dev_defaults.py ../shared/data/ljspeech -o bench/tts-dev
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import time
import zlib


def dev_sentences(ljspeech: str, n: int) -> list[list[str]]:
    """``n`` rows ``[id, text, normalized text]`` of ``metadata_text_only.csv`` by the dev rule (see above)."""
    with open(os.path.join(ljspeech, "clips.jsonl")) as f:
        recorded = {json.loads(line)["id"] for line in f}
    with open(os.path.join(ljspeech, "metadata_text_only.csv"), newline="") as f:
        rows = list(csv.reader(f, delimiter="|", quoting=csv.QUOTE_NONE))
    dev = [r for r in rows if zlib.crc32(r[0].encode()) % 50 == 0 and r[0] not in recorded]
    return dev[::max(1, len(dev) // n)][:n]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("ljspeech", help="the LJSpeech folder (metadata_text_only.csv, clips.jsonl)")
    p.add_argument("--sentences", type=int, default=30)
    p.add_argument("--thetas", type=float, nargs="+", default=[0.9, 0.8, 0.7])
    p.add_argument("--lookaheads", type=int, nargs="+", default=[3, 4, 5])
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[16, 1])
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("-o", "--output", required=True, help="folder for defaults.md / .csv")
    args = p.parse_args()

    import torch

    from rayspec.bench.tables import write_table
    from rayspec.manifest import Utterance
    from rayspec.metrics import error_rates
    from rayspec.pipeline import Transcriber
    from rayspec.tts.flags import SamplingOptions
    from rayspec.tts.synthesis import Synthesizer

    torch.set_num_threads(1)
    rows = dev_sentences(args.ljspeech, args.sentences)
    texts = [r[2] for r in rows]
    synth = Synthesizer()
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
    asr = Transcriber("whisper-base")
    cells = []
    for name, _ in cfgs:
        res = outputs[name]
        hyps = [r.text for r in asr.transcribe([Utterance(f"u{i}", "") for i in range(len(res))],
                                                [r.audio for r in res])]
        cells.append([name, f"{sum(r.frames for r in res) / sum(r.target_passes for r in res):.2f}",
                      f"{100 * error_rates(texts, hyps).wer:.1f}"]
                     + [f"{min(walls['target-only', b]) / min(walls[name, b]):.2f}x" for b in args.batch_sizes])
    os.makedirs(args.output, exist_ok=True)
    title = (f"pcg defaults on {len(texts)} dev sentences of the teacher data ({rows[0][0]} .. {rows[-1][0]}), "
             f"1 torch thread + the vocoder's, fastest of {args.repeats} round-robin runs, WER by Whisper base")
    print(write_table(os.path.join(args.output, "defaults"), title,
                      ["config", "frames / target pass", "WER %"] + [f"speed-up bs{b}" for b in args.batch_sizes],
                      cells))


if __name__ == "__main__":
    main()
