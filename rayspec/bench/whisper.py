"""``rayspec bench --suite whisper``: real Whisper on rayspec's engine, checked against the references that define it.

For each target (default ``whisper-base`` and ``whisper-tiny.en``) and each manifest, in one run:

- WER after Whisper's English normalizer and the space-free CER (:mod:`rayspec.metrics`) of rayspec's own pipeline
  (``Transcriber``: method ar, greedy, fp32, the default batching), with RTFx;
- token identity of rayspec's ``ar`` against transformers' ``WhisperForConditionalGeneration.generate`` (greedy) on
  the converted checkpoint, and against CTranslate2's greedy ``generate`` on the original ``model.bin`` (the same
  log-mel features for all three; token caps lifted to the 448-position limit so no engine stops early), on the
  first ``--identity-limits`` utterances of each manifest.

``--whisper-targets`` entries may name an encoder compute type after ``@`` (``whisper-base@bfloat16``: the encoder in
bfloat16, the decoder in float32) and a short encoder window after ``:short=`` (``whisper-base:short=10``: the
``--short-window 10`` of :class:`~rayspec.decoding.options.DecodeOptions`), so a lossy setting's WER and speed sit beside the
reference's in the same run.

Writes ``bench-whisper.md`` / ``.csv`` into the output folder.
"""

from __future__ import annotations

import os
import time

import numpy as np
import torch
from tqdm import tqdm

from ..audio import load_audio
from ..manifest import read_manifest
from ..metrics import error_rates
from ..models.whisper import WhisperASR
from ..pipeline import DecodeOptions, Transcriber, decode_batch

BATCH = 8


def _generate_hf(model: WhisperASR, audios: list[np.ndarray]) -> list[list[int]]:
    feats, _ = model.features(audios)
    mask = torch.ones(feats.shape[0], feats.shape[-1], dtype=torch.long)
    with torch.inference_mode():
        out = model.model.generate(feats, attention_mask=mask, max_new_tokens=model.max_target_positions
                                   - len(model.prompt_ids))
    special = set(model.prompt_ids) | {model.eos_token_id}
    return [[t for t in row.tolist() if t not in special] for row in out]


def _generate_ct2(ct2_model, model: WhisperASR, audios: list[np.ndarray]) -> list[list[int]]:
    import ctranslate2

    feats, _ = model.features(audios)
    out = ct2_model.generate(ctranslate2.StorageView.from_array(feats.numpy()), [model.prompt_ids] * len(audios),
                             beam_size=1, max_length=model.max_target_positions)
    return [r.sequences_ids[0] for r in out]


def _ct2_model(name: str):
    """CTranslate2's own Whisper (float32) on the original files of the installed model ``name``; None without the
    ``ctranslate2`` package or for a model that is not a name. A ``model.bin`` split across packages is joined into a
    temporary folder, removed once CTranslate2 has read it."""
    import tempfile

    from ..models.registry import MODELS, ct2_folder

    try:
        import ctranslate2
    except ImportError:
        return None
    if name not in MODELS:
        return None
    with tempfile.TemporaryDirectory(prefix=f"{name}-ct2-") as tmp:
        return ctranslate2.models.Whisper(ct2_folder(name, tmp), compute_type="float32",
                                          intra_threads=torch.get_num_threads())


def _identity(name: str, model: WhisperASR, ct2_model, audios: list[np.ndarray]) -> dict:
    """Counts of utterances whose rayspec ``ar`` tokens equal transformers' and CTranslate2's (``ct2_model``, or
    None) greedy tokens."""
    options = DecodeOptions("ar", max_tokens_per_second=1e6)
    ours, hf, ct = [], [], []
    for s in tqdm(range(0, len(audios), BATCH), desc=f"identity {name}", leave=False):
        a = audios[s: s + BATCH]
        ours += [h.tokens for h in decode_batch(model, options, a, [len(x) / model.sample_rate for x in a])]
        hf += _generate_hf(model, a)
        if ct2_model is not None:
            ct += _generate_ct2(ct2_model, model, a)
    out = {"n": len(ours), "hf_same": sum(x == y for x, y in zip(ours, hf))}
    out["ct2_same"] = sum(x == y for x, y in zip(ours, ct)) if ct2_model is not None else None
    out["ct2_diff_ids"] = [i for i, (x, y) in enumerate(zip(ours, ct)) if x != y]
    out["hf_diff_ids"] = [i for i, (x, y) in enumerate(zip(ours, hf)) if x != y]
    return out


def run_whisper_suite(targets: list[str], manifests: list[str], limits: list[int], identity_limits: list[int],
                      threads: int) -> list[dict]:
    """One row per (target, manifest): WER, space-free CER, RTFx of the pipeline and identity counts."""
    rows = []
    for spec in targets:
        name, _, window = spec.partition(":short=")  # "whisper-base:short=10": a short encoder window (>= 10 s)
        name, _, encoder = name.partition("@")  # "whisper-base@bfloat16": the encoder computes in bfloat16
        t0 = time.perf_counter()
        transcriber = Transcriber(name, options=DecodeOptions("ar", short_window_s=float(window or 0)),
                                  encoder_dtype=getattr(torch, encoder) if encoder else None)
        load_s = time.perf_counter() - t0
        model = transcriber.target
        ct2_model = _ct2_model(name) if any(identity_limits) else None  # loaded once per target
        for manifest, limit, identity_limit in zip(manifests, limits, identity_limits):
            utts = read_manifest(manifest)
            utts = utts[:limit] if limit else utts
            audios = [load_audio(u.audio, model.sample_rate) for u in utts]
            t0 = time.perf_counter()
            results = []
            for s in tqdm(range(0, len(utts), 16), desc=f"{name} {os.path.basename(manifest)}", leave=False):
                results += transcriber.transcribe(utts[s: s + 16], audios[s: s + 16])
            wall = time.perf_counter() - t0
            rates = error_rates([u.text for u in utts], [r.text for r in results])
            k = min(identity_limit, len(utts))
            ident = _identity(name, model, ct2_model, audios[:k]) if k else {"n": 0, "hf_same": None, "ct2_same": None}
            label = name + (f" (encoder {encoder})" if encoder else "") + (f" (window >= {window} s)" if window else "")
            rows.append(dict(
                target=label, corpus=utts[0].corpus if utts else "-", n=len(utts), wer=rates.wer, cer=rates.cer,
                cer_nospace=rates.cer_nospace, rtfx=sum(len(a) for a in audios) / model.sample_rate / wall,
                no_speech=sum(r.route == "no_speech" for r in results),
                repetitive=sum(bool(r.repetitive) for r in results), load_s=load_s, threads=threads,
                identity_n=ident["n"], hf_same=ident["hf_same"], ct2_same=ident["ct2_same"],
                ct2_diff=",".join(utts[i].id for i in ident.get("ct2_diff_ids", [])),
                hf_diff=",".join(utts[i].id for i in ident.get("hf_diff_ids", [])),
            ))
            print(rows[-1], flush=True)
    return rows


def write_whisper_table(rows: list[dict], out_dir: str, title: str) -> str:
    """``bench-whisper.md`` and ``.csv`` in ``out_dir``; returns the Markdown."""
    import csv

    os.makedirs(out_dir, exist_ok=True)
    pct = lambda x: "-" if x is None else f"{100 * x:.1f}"  # noqa: E731
    same = lambda a, n: "-" if a is None else f"{a}/{n}"  # noqa: E731
    lines = [f"### {title}", "",
             "| target | corpus | n | WER % | CER % | CER no spaces % | RTFx | no_speech rows | repetitive rows "
             "| ar == transformers generate | ar == CTranslate2 |", "|" + "---|" * 11]
    for r in rows:
        lines.append(f"| {r['target']} | {r['corpus']} | {r['n']} | {pct(r['wer'])} | {pct(r['cer'])} | "
                     f"{pct(r['cer_nospace'])} | {r['rtfx']:.2f} | {r['no_speech']} | {r['repetitive']} | "
                     f"{same(r['hf_same'], r['identity_n'])} | {same(r['ct2_same'], r['identity_n'])} |")
    diffs = [f"- {r['target']} {r['corpus']}: differs from CTranslate2 on {r['ct2_diff'] or 'none'}; from "
             f"transformers on {r['hf_diff'] or 'none'}" for r in rows if r["identity_n"]]
    md = "\n".join(lines + ["", *diffs, ""])
    with open(os.path.join(out_dir, "bench-whisper.md"), "w") as f:
        f.write(md)
    with open(os.path.join(out_dir, "bench-whisper.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    return md


def cmd_bench_whisper(args) -> int:
    """The ``whisper`` suite from parsed ``rayspec bench`` arguments."""
    if args.threads:
        torch.set_num_threads(args.threads)
    if not args.manifests:
        raise ValueError("--suite whisper needs at least one manifest")
    per_manifest = lambda xs, default: (xs or [default]) * len(args.manifests) if len(xs) <= 1 else xs  # noqa: E731
    limits, identity = per_manifest(args.limits, 0), per_manifest(args.identity_limits, 130)
    targets = args.whisper_targets.split(",")
    rows = run_whisper_suite(targets, args.manifests, limits, identity, torch.get_num_threads())
    title = (f"whisper: {', '.join(targets)}, method ar, greedy, float32, {torch.get_num_threads()} threads, "
             f"Whisper's English normalizer; token identity on the first {', '.join(map(str, identity))} "
             "utterances of each corpus")
    print(write_whisper_table(rows, args.output, title))
    return 0
