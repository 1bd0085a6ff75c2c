"""Choose the word-start refinement's threshold (rayspec/activity.py ``DROP_DB``) on a dev split of Piper sentences.

The dev split: ``--sentences`` held-out sentences of ``metadata_text_only.csv`` (seed ``--seed``, default 1), none of
them an LJSpeech clip of ``clips.jsonl`` nor one of the timestamps benchmark's Piper set (seed 0), read by the Piper
voice with exact word times (:func:`rayspec.bench.timestamps_data.build_piper_set`). whisper-base (ar, 1 thread)
gives openai/whisper's word times once (``refine_words=False``); each threshold then refines starts only, or starts
and ends, and the mean start/end errors against the true times are printed as a Markdown table.

    flock /tmp/rayspec-cpu.lock python scripts/word_refine_dev.py ../shared/data/ljspeech/clips.jsonl
"""

import argparse
import copy
import json
import os

import numpy as np
import torch

from rayspec.activity import refine_words, speech_activity
from rayspec.audio import load_audio
from rayspec.bench.timestamps import WordScore
from rayspec.bench.timestamps_data import build_piper_set
from rayspec.manifest import read_manifest
from rayspec.methods import DecodeOptions
from rayspec.pipeline import Transcriber


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("clips", help="the LJSpeech clips manifest (its ids are excluded)")
    p.add_argument("--bench-data", default="runs/timestamps-data/piper-30-seed0.jsonl",
                   help="the benchmark's Piper set (its ids are excluded)")
    p.add_argument("--out", default="runs/timestamps-dev")
    p.add_argument("--sentences", type=int, default=20)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--drops", default="6,10,15,20,30,40,60")
    args = p.parse_args()
    torch.set_num_threads(1)
    texts = os.path.join(os.path.dirname(os.path.abspath(args.clips)), "metadata_text_only.csv")
    exclude = {u.id for u in read_manifest(args.clips)}
    with open(args.bench_data, encoding="utf-8") as f:
        exclude |= {json.loads(line)["id"] for line in f}
    manifest = build_piper_set(texts, args.out, exclude, args.sentences, args.seed)
    with open(manifest, encoding="utf-8") as f:
        truth = {r["id"]: r["words"] for r in map(json.loads, f)}
    utts = read_manifest(manifest)
    audios = [load_audio(u.audio, 16000) for u in utts]
    t = Transcriber("whisper-base", options=DecodeOptions("ar", timestamps="word", refine_words=False))
    recipe = [t.transcribe([u], [a])[0].words for u, a in zip(utts, audios)]

    def row(label: str, drop=None, ends=False) -> str:
        s = WordScore("rayspec", "dev")
        for u, a, words in zip(utts, audios, recipe):
            words = copy.deepcopy(words)
            if drop is not None:
                refine_words(words, speech_activity(a, 16000, drop), ends=ends)
            s.add(words, truth[u.id])
        st, en = 1000 * np.mean(s.start), 1000 * np.mean(s.end)
        return f"| {label} | {st:.0f} | {en:.0f} | {(st + en) / 2:.1f} |"

    print(f"dev split: {manifest}, {sum(len(w) for w in truth.values())} words\n")
    print("| refinement | start err mean ms | end err mean ms | start+end mean ms |\n|---|---|---|---|")
    print(row("none (recipe)"))
    for drop in map(float, args.drops.split(",")):
        print(row(f"{drop:g} dB, starts", drop))
        print(row(f"{drop:g} dB, starts and ends", drop, ends=True))


if __name__ == "__main__":
    main()
