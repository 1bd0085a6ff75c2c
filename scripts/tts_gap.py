"""Split the speech-token TTS student's intelligibility gap to its Piper teacher, judged by Whisper base.

    python scripts/tts_gap.py ljspeech/clips.jsonl ljspeech/metadata_text_only.csv -o bench/tts-gap \
        [--espeak-ipa espeak.json]

Sentences: LJ002-0002..0100 of ``clips.jsonl`` (its text is LJSpeech's normalized form; the raw form comes from the
``id|raw|normalized`` metadata). Per audio it writes the WER over all of them and over LJ002-0071..0100 (the tts
benchmark's sentences, never trained on; 51 of LJ002-0002..0070 were in the teacher data, see the tts-target card):

- the teacher (Piper en_US-joe-medium, noise_w 0) through rayspec's G2P on the normalized text and on the raw text
  (rayspec's own normalisation of numbers, ordinals and abbreviations), and, with ``--espeak-ipa`` (a JSON object id ->
  espeak-ng's en-us IPA of the normalized text, Piper's form, made by any espeak-ng outside rayspec: it is GPL), on
  the phonemes it was trained on;
- the teacher's Lyra resynthesis (16 codebooks), and the teacher's coarse tokens with the student's depth head for
  the 14 fine codebooks (teacher-forced): the codec's and the depth head's share;
- the student (tts-target, seed 0) target-only and ``pcg`` at the defaults, at temperature 0.3, with the teacher's
  phone durations instead of its own duration predictor's, and at ``--speed 0.85``.

Each row also splits its word errors (after Whisper's normalizer, aligned to the reference) into words the teacher
also missed, numbers, names (capitalised words inside a sentence), and the rest with insertions.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import re
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from rayspec.bench.tables import write_table  # noqa: E402
from rayspec.metrics import error_rates, normalize  # noqa: E402

IDS = [f"LJ002-{i:04d}" for i in range(2, 101)]
_NUMBER = re.compile(r"^\d+(st|nd|rd|th)?$")


def missed(ref: str, hyp: str) -> tuple[set, int]:
    """Indices of the normalized reference's words substituted or deleted in ``hyp``, and the inserted words."""
    import jiwer

    bad, inserted = set(), 0
    for ch in jiwer.process_words(ref or "-", hyp or "").alignments[0]:
        if ch.type in ("substitute", "delete"):
            bad.update(range(ch.ref_start_idx, ch.ref_end_idx))
        elif ch.type == "insert":
            inserted += ch.hyp_end_idx - ch.hyp_start_idx
    return bad, inserted


def error_shares(texts: list[str], hyps: list[str], teacher: list[str]) -> dict[str, float]:
    """Word errors in % of the reference words: those the teacher also missed, numbers, names, the rest."""
    names = {w.lower() for t in texts for w in re.findall(r"(?<=\w )([A-Z][a-z]+)", t)}
    shares = dict.fromkeys(("teacher also", "numbers", "names", "rest + insertions"), 0)
    words = 0
    for text, hyp, th in zip(texts, hyps, teacher):
        ref = normalize(text)
        bad, inserted = missed(ref, normalize(hyp))
        bad_teacher, _ = missed(ref, normalize(th))
        w = ref.split()
        words += len(w)
        shares["rest + insertions"] += inserted
        for j in bad:
            shares["teacher also" if j in bad_teacher else "numbers" if _NUMBER.match(w[j]) else
                   "names" if w[j] in names else "rest + insertions"] += 1
    return {k: 100 * v / words for k, v in shares.items()}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("clips", help="LJSpeech clips.jsonl (normalized text)")
    p.add_argument("metadata", help="LJSpeech id|raw|normalized metadata holding the same ids")
    p.add_argument("-o", "--output", default="bench/tts-gap")
    p.add_argument("--espeak-ipa", help="JSON id -> espeak-ng IPA of the normalized text (optional)")
    p.add_argument("--ids", help="comma-separated ids instead of LJ002-0002..0100 (a quick check)")
    args = p.parse_args()
    ids = args.ids.split(",") if args.ids else IDS

    import soxr

    from rayspec.manifest import Utterance
    from rayspec.pipeline import Transcriber
    from rayspec.train.tts import collate
    from rayspec.train.tts_data import teacher_example
    from rayspec.tts.piper import PiperVoice
    from rayspec.tts.flags import SamplingOptions
    from rayspec.tts.speculative import generate
    from rayspec.tts.synthesis import Synthesizer

    torch.set_num_threads(1)
    rows = {r["id"]: r for r in map(json.loads, open(args.clips, encoding="utf-8"))}
    raw = dict(line.split("|")[:2] for line in open(args.metadata, encoding="utf-8"))
    texts = [rows[i]["text"] for i in ids]
    synth, asr = Synthesizer(), Transcriber("whisper-base")
    voice = PiperVoice(noise_w=0.0, durations=True)
    examples = [teacher_example(voice, synth.codec, k, t) for k, t in zip(ids, texts)]

    def teacher_from(symbols: list[list[str]]) -> list[np.ndarray]:
        return [soxr.resample(voice.speak(voice.ids(s)), voice.sample_rate, 16000) for s in symbols]

    def student_on_teacher_durations(opts: SamplingOptions) -> list[np.ndarray]:
        order = sorted(range(len(ids)), key=lambda i: len(examples[i][0].codes))
        out = {}
        for s in range(0, len(order), 16):
            b = [examples[i][0] for i in order[s:s + 16]]
            got = generate(synth.target, synth.draft, [e.phones for e in b], [e.durations for e in b],
                           [1000 + i for i in order[s:s + 16]], opts, synth._ratio(opts))
            out.update(zip(order[s:s + 16], got))
        return [synth.codec.decode(out[i].codes) for i in range(len(ids))]

    @torch.no_grad()
    def teacher_coarse_student_fine() -> list[np.ndarray]:
        target, audios = synth.target, []
        for e, _ in examples:
            b = collate([e], target.bos)
            enc = target.encode_phones(b["phones"], b["phone_mask"])
            hidden = target(target.condition(enc, b["index"], b["since"], b["to_end"]), b["prev"])[0]
            coarse = b["coarse"][0]
            codes = torch.cat([torch.stack([coarse // 16, coarse % 16], -1), target.fine_codes(hidden, coarse)], -1)
            audios.append(synth.codec.decode(codes.numpy()))
        return audios

    def student(method: str, temperature: float = SamplingOptions.temperature, speed: float = 1.0):
        return [r.audio for r in synth.synthesize(texts, SamplingOptions(method, temperature), 0, speed=speed)]

    configs = [("teacher, rayspec G2P", lambda: [a for _, a in examples]),
               ("teacher, rayspec G2P on the raw text", lambda: teacher_from([voice.symbols(raw[i]) for i in ids]))]
    if args.espeak_ipa:
        ipa = json.load(open(args.espeak_ipa, encoding="utf-8"))
        configs.append(("teacher, espeak-ng's phonemes", lambda: teacher_from(
            [["^", "_"] + [s for c in ipa[i] if c in voice.id_map for s in (c, "_")] + ["$"] for i in ids])))
    configs += [("teacher, Lyra resynthesis", lambda: [synth.codec.decode(synth.codec.encode(a)) for _, a in examples]),
                ("teacher's coarse tokens + the student's depth head", teacher_coarse_student_fine),
                ("student target-only", lambda: student("target")),
                ("student pcg", lambda: student("pcg")),
                ("student target-only, temperature 0.3", lambda: student("target", 0.3)),
                ("student pcg, temperature 0.3", lambda: student("pcg", 0.3)),
                ("student target-only, the teacher's durations",
                 lambda: student_on_teacher_durations(SamplingOptions("target"))),
                ("student target-only, speed 0.85", lambda: student("target", speed=0.85))]
    hyps = {}
    for name, make in configs:
        audios = make()
        hyps[name] = [r.text for r in asr.transcribe([Utterance(k, "") for k in ids], audios)]
        print(name, f"{100 * error_rates(texts, hyps[name]).wer:.1f}", flush=True)
    teacher = hyps["teacher, rayspec G2P"]
    held = [i for i, k in enumerate(ids) if k >= "LJ002-0071"]  # never trained on

    def held_wer(h: list[str]) -> str:
        return f"{100 * error_rates([texts[i] for i in held], [h[i] for i in held]).wer:.1f}" if held else ""

    header = ["audio", "WER % (all)", "WER % (LJ002-0071..0100)", "teacher also %", "numbers %", "names %",
              "rest + insertions %"]
    body = [[name, f"{100 * error_rates(texts, h).wer:.1f}", held_wer(h)]
            + [f"{v:.1f}" for v in error_shares(texts, h, teacher).values()] for name, h in hyps.items()]
    os.makedirs(args.output, exist_ok=True)
    print(write_table(os.path.join(args.output, "gap"), "tts: the student's WER gap to its teacher, Whisper base, "
                      f"{ids[0]}..{ids[-1]} ({len(ids)} sentences)", header, body))
    with open(os.path.join(args.output, "gap-sentences.csv"), "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["id", "reference", *hyps])
        w.writerows([k, t, *(h[i] for h in hyps.values())] for i, (k, t) in enumerate(zip(ids, texts)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
