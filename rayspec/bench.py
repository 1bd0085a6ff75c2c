"""``rayspec bench``: speculative decoding against AR, measured side by side in one run (SpecASR Table II ablation).

For each batch size, every configuration decodes the same preloaded audio with the same models: AR greedy, fixed
draft lengths, then adaptive drafting, recycling and the token tree added in turn, and (batch 1 only) transformers'
assisted generation with the same draft. Timings cover features, encoders and decoding (audio decoding excluded);
each configuration runs a warm-up batch first. Output: ``bench.md`` (Markdown table), ``bench.csv`` and
``bench.png`` (speed-up and NFE per configuration) in the output folder.
"""

from __future__ import annotations

import contextlib
import csv
import os
import time
from dataclasses import dataclass, replace

import torch
from tqdm import tqdm

from .batching import BatchBudget, plan_batches
from .decoding.ar import greedy_decode
from .decoding.common import DEFAULT_MAX_TOKENS_PER_SECOND, Hypothesis, token_cap
from .decoding.speculative import SpeculationOptions, speculative_decode

ABLATION = [
    ("ar", None),
    ("fixed-8", SpeculationOptions(max_draft=8, threshold=0.0, recycle=False, tree=False)),
    ("fixed-16", SpeculationOptions(max_draft=16, threshold=0.0, recycle=False, tree=False)),
    ("+adaptive", SpeculationOptions(recycle=False, tree=False)),
    ("+recycle", SpeculationOptions(tree=False)),
    ("+tree", SpeculationOptions()),
]


@dataclass
class BenchRow:
    config: str
    batch_size: int
    utterances: int
    audio_s: float
    wall_s: float
    nfe_per_utt: float
    draft_passes_per_utt: float
    mean_accepted_length: float
    acceptance_rate: float
    identical_to_ar: int
    rtfx: float = 0.0
    speedup: float = 0.0
    nfe_reduction: float = 0.0


def _hf_assisted(target, draft, audio, cap) -> Hypothesis:
    """transformers' assisted generation (batch 1 only) with our draft; counts target passes via a forward hook."""
    from transformers import GenerationMixin
    from transformers.modeling_outputs import BaseModelOutput

    feats, lengths = target.features([audio])
    enc = target.encode(feats, lengths)
    dfeats, dlengths = draft.features([audio])
    calls = {"n": 0}
    hook = target.model.register_forward_hook(lambda *_: calls.__setitem__("n", calls["n"] + 1))
    # The draft's transformers encoder insists on a 30 s window; at batch 1 our adapter's encoder is the same
    # computation on the unpadded input, so the assistant's encoder is routed through it.
    encoder = draft.model.model.encoder
    original = encoder.forward
    encoder.forward = lambda input_features, *a, **k: BaseModelOutput(
        last_hidden_state=draft.encode(input_features, dlengths).states)
    try:
        out = GenerationMixin.generate(
            target.model, input_features=dfeats, encoder_outputs=BaseModelOutput(last_hidden_state=enc.states),
            decoder_input_ids=torch.tensor([target.prompt_ids]), assistant_model=draft.model,
            max_new_tokens=cap + 1, do_sample=False, suppress_tokens=target.suppress_tokens,
            begin_suppress_tokens=target.begin_suppress_tokens, eos_token_id=target.eos_token_id,
            pad_token_id=target.eos_token_id,
        )
    finally:
        encoder.forward = original
        hook.remove()
    ids = out[0, len(target.prompt_ids):].tolist()
    finished = target.eos_token_id in ids
    ids = ids[: ids.index(target.eos_token_id)] if finished else ids[:cap]
    h = Hypothesis(ids, finished, "hf-assisted")
    h.stats.target_forward_passes = calls["n"]
    return h


def _run(config, spec, target, draft, audios, durations, batches, caps_of) -> list[Hypothesis]:
    out: dict[int, Hypothesis] = {}
    for batch in batches:
        a = [audios[i] for i in batch]
        caps = [caps_of[i] for i in batch]
        if config == "hf-assisted":
            hyps = [_hf_assisted(target, draft, a[0], caps[0])]
        else:
            f, l = target.features(a)
            enc = target.encode(f, l)
            if spec is None:
                hyps = greedy_decode(target, enc, caps)
            else:
                df, dl = draft.features(a)
                hyps = speculative_decode(target, enc, draft, draft.encode(df, dl), caps, spec)
        out.update(zip(batch, hyps))
    return [out[i] for i in range(len(audios))]


def run_bench(target, draft, audios, batch_sizes=(1, 16), configs=None, hf_assisted=True, progress=True):
    """Run the ablation; returns :class:`BenchRow` s (speed-ups relative to AR at the same batch size).

    Args:
        target, draft: :class:`~rayspec.models.whisper.WhisperASR` models sharing a tokenizer.
        audios: float32 waveforms at the target's sample rate.
        configs: (name, :class:`SpeculationOptions` or None for AR) pairs; default :data:`ABLATION`.
    """
    configs = list(configs or ABLATION)
    durations = [len(a) / target.sample_rate for a in audios]
    limit = target.max_target_positions - len(target.prompt_ids) - 1
    caps = [token_cap(d, DEFAULT_MAX_TOKENS_PER_SECOND, limit) for d in durations]
    rows: list[BenchRow] = []
    for bs in batch_sizes:
        batches = plan_batches(list(range(len(audios))), durations, BatchBudget(tokens=10**9, max_rows=bs))
        todo = configs + ([("hf-assisted", None)] if hf_assisted and bs == 1 else [])
        reference = None
        for name, spec in tqdm(todo, desc=f"bench batch {bs}", disable=not progress):
            with torch.inference_mode() if name != "hf-assisted" else contextlib.nullcontext():
                _run(name, spec, target, draft, audios, durations, batches[:1], caps)  # warm-up
                t0 = time.perf_counter()
                hyps = _run(name, spec, target, draft, audios, durations, batches, caps)
                wall = time.perf_counter() - t0
            if reference is None:
                reference = [h.tokens for h in hyps]
            n = len(hyps)
            st = [h.stats for h in hyps]
            rounds = sum(s.rounds for s in st)
            proposed = sum(s.draft_tokens_proposed for s in st)
            accepted = sum(s.draft_tokens_accepted for s in st)
            rows.append(BenchRow(
                name, bs, n, sum(durations), wall, sum(s.target_forward_passes for s in st) / n,
                sum(s.draft_forward_passes for s in st) / n, (accepted + rounds) / rounds if rounds else 1.0,
                accepted / proposed if proposed else 0.0, sum(h.tokens == r for h, r in zip(hyps, reference)),
            ))
        base = next(r for r in rows if r.batch_size == bs and r.config == "ar")
        for r in rows:
            if r.batch_size == bs:
                r.rtfx = r.audio_s / r.wall_s
                r.speedup = base.wall_s / r.wall_s
                r.nfe_reduction = base.nfe_per_utt / r.nfe_per_utt if r.nfe_per_utt else 0.0
    return rows


HEADER = ["config", "batch", "utts", "NFE/utt", "NFE reduction", "draft passes/utt", "mean accepted length",
          "acceptance rate", "wall s", "RTFx", "speed-up vs AR", "identical to AR"]


def write_outputs(rows: list[BenchRow], out_dir: str, title: str) -> str:
    """Write bench.md, bench.csv and bench.png to ``out_dir``; returns the Markdown."""
    os.makedirs(out_dir, exist_ok=True)
    cells = [[r.config, r.batch_size, r.utterances, f"{r.nfe_per_utt:.2f}", f"{r.nfe_reduction:.2f}x",
              f"{r.draft_passes_per_utt:.2f}", f"{r.mean_accepted_length:.2f}", f"{r.acceptance_rate:.3f}",
              f"{r.wall_s:.2f}", f"{r.rtfx:.1f}", f"{r.speedup:.2f}x", f"{r.identical_to_ar}/{r.utterances}"]
             for r in rows]
    md = [f"### {title}", "", "| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    md += ["| " + " | ".join(str(c) for c in row) + " |" for row in cells]
    text = "\n".join(md) + "\n"
    with open(os.path.join(out_dir, "bench.md"), "w") as f:
        f.write(text)
    with open(os.path.join(out_dir, "bench.csv"), "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(HEADER)
        w.writerows(cells)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return text
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for bs in sorted({r.batch_size for r in rows}):
        sub = [r for r in rows if r.batch_size == bs]
        axes[0].plot([r.config for r in sub], [r.speedup for r in sub], marker="o", label=f"batch {bs}")
        axes[1].plot([r.config for r in sub], [r.nfe_per_utt for r in sub], marker="o", label=f"batch {bs}")
    axes[0].axhline(1.0, color="gray", lw=0.8)
    axes[0].set_ylabel("wall-clock speed-up vs AR")
    axes[1].set_ylabel("target passes (NFE) per utterance")
    for ax in axes:
        ax.tick_params(axis="x", rotation=30)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "bench.png"), dpi=120)
    return text


def cmd_bench(args) -> int:
    from .audio import load_audio
    from .manifest import read_manifest
    from .models.whisper import WhisperASR
    from .pipeline import zoo_path

    if args.threads:
        torch.set_num_threads(args.threads)
    target = WhisperASR.from_pretrained(args.target or zoo_path("target"), args.device)
    draft = WhisperASR.from_pretrained(args.draft or zoo_path("draft"), args.device)
    utts = [u for m in args.manifests for u in read_manifest(m)]
    if args.limit:
        utts = utts[: args.limit]
    audios = [load_audio(u.audio, target.sample_rate) for u in tqdm(utts, desc="audio")]
    configs = ABLATION
    if args.max_draft:
        configs = [(n, None if s is None else (s if n.startswith("fixed") else replace(s, max_draft=args.max_draft)))
                   for n, s in configs]
    rows = run_bench(target, draft, audios, tuple(args.batch_sizes), configs, hf_assisted=not args.no_hf)
    title = (f"{target.name} + draft {draft.name} on {', '.join(os.path.basename(m) for m in args.manifests)} "
             f"({len(audios)} utterances, {sum(len(a) for a in audios) / target.sample_rate:.0f} s), "
             f"{args.device}, {torch.get_num_threads()} threads")
    print(write_outputs(rows, args.output, title))
    return 0


def add_bench_parser(sub) -> None:
    p = sub.add_parser(
        "bench", help="benchmark speculative decoding against AR (table + plot)",
        description="Decode the same audio with AR, fixed-length speculation and each SpecASR technique added in "
                    "turn (plus transformers' assisted generation at batch 1), side by side in one run; writes "
                    "bench.md, bench.csv and bench.png. NFE = target forward passes, which do not depend on "
                    "machine noise; wall-clock ratios are measured in the same run.",
    )
    p.add_argument("manifests", nargs="+", help="manifests or folders of audio")
    p.add_argument("-o", "--output", default="bench", help="output folder (default: bench)")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
    p.add_argument("--limit", type=int, default=0, help="use only the first N utterances")
    p.add_argument("--max-draft", type=int, default=0, help="override max draft length of the adaptive configs")
    p.add_argument("--no-hf", action="store_true", help="skip transformers' assisted generation")
    p.add_argument("--target")
    p.add_argument("--draft")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=0)
    p.set_defaults(func=cmd_bench)
