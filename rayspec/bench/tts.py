"""``rayspec bench --suite tts``: speculative speech synthesis side by side with target-only sampling.

Every configuration synthesises the same sentences in one run, at each batch size, with the same threads:
target-only sampling, ``sd`` (exact), ``ssd`` over a beta sweep and ``pcg`` over a theta sweep (the PCG paper's
Figure 3). Each configuration is timed ``--repeats`` times per batch size, round-robin over the configurations, and
its fastest run counts. Per row: intelligibility (WER/CER by pocketsphinx, an independent recogniser; WER by
rayspec's ASR target, Whisper base by default), MCD against the teacher's audio (the real recordings without a
teacher), acceptance rate, tokens per target pass, target passes per second of audio, RTFx and the wall-clock
speed-up over target-only at each batch size, end to end and for generating the tokens alone (the Lyra vocoder, a
fixed cost of every configuration, runs beside generation on a thread of its own; see ``Synthesizer.synthesize``).
Floors, judged the same way: the teacher voice's own audio of the same sentences (the Piper voice the models learn
from) and its Lyra 16-codebook resynthesis, and the real recordings and their resynthesis where the manifest has
audio. A second table estimates acceptance offline from teacher-forced
distributions on the teacher's token sequences (the real recordings' without a teacher). Sampling draws are per
row, so the audio (and WER) of a configuration does not depend on the batch size or the run; only the time does.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from dataclasses import dataclass, field

import numpy as np
import torch
from tqdm import tqdm

from .tables import write_table
from ..metrics import error_rates
from ..tts.flags import DEFAULT_LOOKAHEAD, DEFAULT_SPEED, SamplingOptions


@dataclass
class TTSBenchRow:
    name: str
    method: str
    param: str = ""
    wer: float = float("nan")
    cer: float = float("nan")
    asr_wer: float = float("nan")
    mcd: float = float("nan")
    acceptance: float = float("nan")
    tokens_per_pass: float = float("nan")
    passes_per_audio_s: float = float("nan")
    rtfx: dict = field(default_factory=dict)  # batch size -> audio seconds / wall seconds
    speedup: dict = field(default_factory=dict)  # batch size -> target-only wall / this wall
    token_speedup: dict = field(default_factory=dict)  # the same for token generation only (no Lyra decoder)
    asr_texts: list = field(default_factory=list)  # rayspec ASR's transcript of each sentence (empty without it)


def configs(betas=(0.1, 0.3, 0.5), thetas=(0.98, 0.95, 0.9), temperature=SamplingOptions.temperature, lookahead=None,
            groups="codec"):
    """``(name, SamplingOptions)`` of the suite, target-only first; ``lookahead`` None: each method's default."""
    out = [("target-only", SamplingOptions("target", temperature, lookahead)),
           ("sd", SamplingOptions("sd", temperature, lookahead))]
    out += [(f"ssd beta={b:g}", SamplingOptions("ssd", temperature, lookahead, beta=b)) for b in betas]
    out += [(f"pcg theta={t:g}", SamplingOptions("pcg", temperature, lookahead, theta=t, groups=groups))
            for t in thetas]
    return out


def _judge(judge, asr, audios, texts):
    """``(WER, CER, rayspec-ASR WER, rayspec ASR's transcripts)`` of ``audios`` against ``texts``."""
    hyps = [judge.transcribe(a) for a in audios]
    rates = error_rates(texts, hyps)
    asr_wer, asr_texts = float("nan"), []
    if asr is not None:
        from ..manifest import Utterance

        rows = asr.transcribe([Utterance(f"u{i}", "") for i in range(len(audios))], list(audios))
        asr_texts = [r.text for r in rows]
        asr_wer = error_rates(texts, asr_texts).wer
    return rates.wer, rates.cer, asr_wer, asr_texts


def offline_acceptance(synth, examples, thetas, temperature: float, lookahead: int | None = None, groups="codec"
                       ) -> list[dict]:
    """Teacher-forced acceptance estimates on real token sequences (see :mod:`rayspec.tts.evaluate`)."""
    from ..spec_decode.sampling import GroupRatio, similarity_groups
    from ..train.tts import collate
    from ..tts.speculative import group_vectors
    from ..tts.evaluate import acceptance_rates, expected_tokens_per_pass

    target, draft = synth.target, synth.draft
    with torch.no_grad():
        b = collate(examples, target.bos, draft.context)
        enc = target.encode_phones(b["phones"], b["phone_mask"])
        hidden = target(target.condition(enc, b["index"], b["since"], b["to_end"]), b["prev"])
        m = b["frame_mask"]
        p = (target.head(hidden)[m] / temperature).softmax(-1)
        q = (draft(b["window"][m], b["since"][m], b["to_end"][m], b["history"][m]) / temperature).softmax(-1)
    rows = []
    emb = group_vectors(target, SamplingOptions(groups=groups), synth.codec)
    for name, ratio in [("sd", None)] + [(f"pcg theta={t:g}", GroupRatio(similarity_groups(emb, t))) for t in thetas]:
        a = float(acceptance_rates(p, q, ratio).mean())
        groups = "" if ratio is None else int(ratio.groups.shape[0])
        method = "sd" if ratio is None else "pcg"
        rows.append({"rule": name, "groups": groups, "acceptance": a, "tokens_per_pass": expected_tokens_per_pass(
            a, lookahead or DEFAULT_LOOKAHEAD[method])})
    return rows


def run_tts_bench(synth, texts: list[str], real_audio: list, batch_sizes=(1, 16), betas=(0.1, 0.3, 0.5),
                  thetas=(0.98, 0.95, 0.9), temperature=SamplingOptions.temperature, lookahead=None, seed=0, asr=None,
                  groups="codec", teacher_audio: list | None = None, repeats: int = 1,
                  speed: float = DEFAULT_SPEED):
    """Rows for the floors and every configuration (see the module docstring); ``teacher_audio``: the teacher
    voice's 16 kHz audio of ``texts``, the MCD reference when given (else the real recordings). Each configuration
    is timed ``repeats`` times per batch size, round-robin over the configurations; the fastest run counts.
    ``speed``: the student's speaking rate (:meth:`~rayspec.tts.synthesis.Synthesizer.synthesize`)."""
    from ..tts.evaluate import PocketsphinxJudge, mcd

    judge = PocketsphinxJudge()
    rows = []
    have_real = [a for a in real_audio if a is not None]
    reference = teacher_audio or (real_audio if len(have_real) == len(texts) else None)

    def mean_mcd(audios):
        return float(np.mean([mcd(a, r) for a, r in zip(audios, reference)])) if reference else float("nan")

    floors = []
    if teacher_audio:
        floors += [("teacher (Piper) audio", teacher_audio, False), ("teacher, Lyra resynthesis", teacher_audio, True)]
    if len(have_real) == len(texts):
        floors += [("real recordings", real_audio, False), ("real, Lyra resynthesis", real_audio, True)]
    for name, audios, resynth in floors:
        if resynth:
            audios = [synth.codec.decode(synth.codec.encode(a)) for a in audios]
        wer, cer, asr_wer, asr_texts = _judge(judge, asr, audios, texts)
        rows.append(TTSBenchRow(name, "floor", wer=wer, cer=cer, asr_wer=asr_wer, mcd=mean_mcd(audios),
                                asr_texts=asr_texts))
    synth.synthesize(texts[:2], SamplingOptions("sd"), seed)  # warm-up
    cfgs = configs(betas, thetas, temperature, lookahead, groups)
    walls: dict = {}  # (config, batch size) -> wall seconds of each run
    token_walls: dict = {}  # the same for generating the tokens (Synthesis.decode_s: no Lyra decoder)
    outputs: dict = {}  # config -> its results (draws are per row: the same at every batch size and run)
    with tqdm(total=repeats * len(batch_sizes) * len(cfgs), desc="tts runs") as bar:
        for _ in range(repeats):
            for bs in batch_sizes:
                for name, opts in cfgs:
                    t0 = time.perf_counter()
                    outputs[name] = synth.synthesize(texts, opts, seed, batch_size=bs, speed=speed)
                    walls.setdefault((name, bs), []).append(time.perf_counter() - t0)
                    token_walls.setdefault((name, bs), []).append(sum(r.decode_s for r in outputs[name]))
                    bar.update()
    base_name = cfgs[0][0]
    for name, opts in tqdm(cfgs, desc="tts judges"):
        results = outputs[name]
        row = TTSBenchRow(name, opts.method, {"ssd": f"beta={opts.beta:g}", "pcg": f"theta={opts.theta:g}"}.get(
            opts.method, ""))
        audio_s = sum(r.duration_s for r in results)
        for bs in batch_sizes:
            row.rtfx[bs] = audio_s / min(walls[name, bs])
            row.speedup[bs] = min(walls[base_name, bs]) / min(walls[name, bs])
            row.token_speedup[bs] = min(token_walls[base_name, bs]) / min(token_walls[name, bs])
        frames = sum(r.frames for r in results)
        passes = sum(r.target_passes for r in results)
        proposed = sum(r.draft_proposed for r in results)
        row.acceptance = sum(r.draft_accepted for r in results) / proposed if proposed else float("nan")
        row.tokens_per_pass = frames / passes
        row.passes_per_audio_s = passes / audio_s
        audios = [r.audio for r in results]
        row.wer, row.cer, row.asr_wer, row.asr_texts = _judge(judge, asr, audios, texts)
        row.mcd = mean_mcd(audios)
        rows.append(row)
    return rows


def _fmt(x, spec="{:.1f}"):
    return "" if x is None or (isinstance(x, float) and np.isnan(x)) else spec.format(x)


def write_sentences(rows, ids: list[str], texts: list[str], path: str) -> None:
    """``path`` (CSV): per sentence and configuration, rayspec ASR's transcript and its word errors after Whisper's
    normalizer (``id, config, errors, words, WER %, reference, transcript``), for rows judged by rayspec ASR: where
    each configuration's errors go (names, numbers, the student's slurs) beside the teacher's on the same sentence."""
    import csv

    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["id", "config", "errors", "words", "WER %", "reference", "transcript"])
        for r in rows:
            for key, ref, hyp in zip(ids, texts, r.asr_texts):
                e = error_rates([ref], [hyp])
                errors = round(e.wer * e.words)
                w.writerow([key, r.name, errors, e.words, _fmt(100 * e.wer), ref, hyp])


def write_tts_outputs(rows, offline, out_dir: str, title: str, batch_sizes, ids: list[str] | None = None,
                      texts: list[str] | None = None) -> str:
    """``bench-tts.md`` / ``.csv`` / ``.png`` (speed-up vs WER) in ``out_dir``, and with ``ids`` and ``texts``
    ``bench-tts-sentences.csv`` (:func:`write_sentences`); returns the Markdown."""
    os.makedirs(out_dir, exist_ok=True)
    header = (["config", "WER % (pocketsphinx)", "CER %", "WER % (rayspec ASR)", "MCD dB", "acceptance %",
               "tokens / target pass", "target passes / audio s"]
              + [f"RTFx bs{b}" for b in batch_sizes] + [f"speed-up bs{b}" for b in batch_sizes]
              + [f"tokens only: speed-up bs{b}" for b in batch_sizes])
    body = []
    for r in rows:
        body.append([r.name, _fmt(100 * r.wer), _fmt(100 * r.cer), _fmt(100 * r.asr_wer), _fmt(r.mcd, "{:.2f}"),
                     _fmt(100 * r.acceptance), _fmt(r.tokens_per_pass, "{:.2f}"),
                     _fmt(r.passes_per_audio_s, "{:.1f}")]
                    + [_fmt(r.rtfx.get(b), "{:.2f}") for b in batch_sizes]
                    + [_fmt(r.speedup.get(b), "{:.2f}x") for b in batch_sizes]
                    + [_fmt(r.token_speedup.get(b), "{:.2f}x") for b in batch_sizes])
    notes = ["", "Offline acceptance (teacher-forced on the teacher's token sequences of the same sentences, or the "
             "real recordings' without a teacher):", "",
             "| rule | groups | acceptance % | expected tokens / target pass |", "|---|---|---|---|"]
    notes += [f"| {o['rule']} | {o['groups']} | {100 * o['acceptance']:.1f} | {o['tokens_per_pass']:.2f} |"
              for o in offline]
    stem = os.path.join(out_dir, "bench-tts")
    text = write_table(stem, title, header, body, "\n".join(notes) + "\n")
    _plot(rows, stem + ".png", title, batch_sizes)
    if ids and texts and any(r.asr_texts for r in rows):
        write_sentences(rows, ids, texts, stem + "-sentences.csv")
    return text


def _plot(rows, path, title, batch_sizes) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(batch_sizes), figsize=(5.5 * len(batch_sizes), 4.2), squeeze=False)
    for ax, bs in zip(axes[0], batch_sizes):
        for method, style in (("ssd", "s--"), ("pcg", "o-")):
            pts = [(100 * r.wer, r.speedup[bs], r.param) for r in rows if r.method == method]
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=method)
                for x, y, lab in pts:
                    ax.annotate(lab, (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
        for r in rows:
            if r.method in ("target", "sd"):
                ax.plot(100 * r.wer, r.speedup[bs], "k^" if r.method == "sd" else "kx", label=r.name)
            elif r.method == "floor":
                ax.axvline(100 * r.wer, color="gray", lw=0.8, ls=":")
                ax.annotate(r.name, (100 * r.wer, ax.get_ylim()[0]), fontsize=6, rotation=90, color="gray")
        ax.set_xlabel("WER % (pocketsphinx)")
        ax.set_ylabel(f"wall-clock speed-up over target-only (batch {bs})")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def cmd_bench_tts(args) -> int:
    """The ``tts`` suite of ``rayspec bench`` (manifests with ``text`` and, for floors and MCD, ``audio``)."""
    from ..audio import load_audio
    from ..manifest import read_manifest
    from ..train.tts_data import DEV_IDS, prepare
    from ..tts.synthesis import Synthesizer

    if args.threads:
        torch.set_num_threads(args.threads)
    args.temperature = args.temperature or SamplingOptions.temperature
    args.speed = args.speed or DEFAULT_SPEED
    synth = Synthesizer(args.tts_target, args.tts_draft, args.codec)
    utts = [u for m in args.manifests for u in read_manifest(m)]
    if args.tts_ids != "all":
        keep = set(DEV_IDS) if args.tts_ids == "dev" else set(args.tts_ids.split(","))
        utts = [u for u in utts if u.id in keep]
    utts = utts[: args.limit or None]
    texts = [u.text for u in utts]
    real = [load_audio(u.audio, 16000) if u.audio and os.path.exists(u.audio) else None for u in utts]
    asr = None
    if not args.no_asr:
        from ..pipeline import Transcriber

        asr = Transcriber(args.target)
    teacher = []  # (TTSExample, 16 kHz audio) per text, read by the teacher voice as in its training data
    if args.teacher_voice != "none":
        from ..train.tts_data import teacher_example
        from ..tts.piper import PiperVoice

        voice = PiperVoice(args.teacher_voice, noise_w=0.0, durations=True)
        teacher = [teacher_example(voice, synth.codec, u.id, u.text) for u in utts]
    rows = run_tts_bench(synth, texts, real, tuple(args.batch_sizes), tuple(args.betas), tuple(args.thetas),
                         args.temperature, args.lookahead, args.seed, asr, args.groups, [a for _, a in teacher],
                         args.repeats, args.speed)
    examples = [e for e, _ in teacher]
    if not examples and all(a is not None for a in real):
        with tempfile.TemporaryDirectory() as tmp:
            manifest = os.path.join(tmp, "m.jsonl")
            with open(manifest, "w") as f:
                for u in utts:
                    f.write(json.dumps({"id": u.id, "audio": u.audio, "text": u.text}) + "\n")
            examples, _ = prepare([manifest], tmp, synth.codec.path)
    offline = offline_acceptance(synth, examples, tuple(args.thetas), args.temperature, args.lookahead,
                                 args.groups) if examples else []
    audio_s = sum(len(e.codes) for e in examples) / 50
    source = "the teacher's" if teacher else "real"
    threads = torch.get_num_threads()
    lookahead = args.lookahead or ", ".join(f"{m} {n}" for m, n in DEFAULT_LOOKAHEAD.items() if n)
    title = (f"tts: {os.path.basename(synth.target_dir)} + {os.path.basename(synth.draft_dir)}, {len(texts)} "
             f"held-out sentences ({audio_s:.0f} s of {source} speech), temperature {args.temperature:g}, lookahead "
             f"{lookahead}, pcg groups from {args.groups} vectors, {threads} torch thread{'s' * (threads != 1)} + "
             f"the vocoder's thread, the student's speaking rate {args.speed:g}, seed {args.seed}, fastest of "
             f"{args.repeats} round-robin runs, MCD against {source} audio")
    print(write_tts_outputs(rows, offline, args.output, title, tuple(args.batch_sizes), [u.id for u in utts], texts))
    return 0
