"""``rayspec bench --suite voicechat``: PredGen (greedy, top-k) against the plain cascade, turn by turn.

Every method answers the same turns in one run with the same LM, TTS and threads. Turns are MT-Bench's first-turn
questions (the set PredGen's paper evaluates on; FastChat, Apache-2.0, bundled as
``rayspec/chat/data/mt_bench_questions.jsonl``) or a file of the user's: typed, streamed as partial prompts at 600
characters per minute (the paper's rate), and spoken, read aloud by the Piper voice, fed in real time and
transcribed as it streams in by rayspec's ASR (Whisper tiny.en by default), the LLM answering the ASR's text. Per
turn: time to first sentence (TTFS), LLM passes to first sentence (NFETFS), audio latency (end of input -> first
audio sample), the verification outcome, and the extra LLM tokens and TTS audio spent on candidates that were thrown
away. Medians per configuration, the speed-up of the median audio latency over the cascade's, the share of replies
identical to the cascade's, and a latency CDF plot.
"""

from __future__ import annotations

import json
import os
import statistics
from dataclasses import dataclass, field
from importlib import resources

import numpy as np
import torch
from tqdm import tqdm

from .tables import write_table
from ..chat.predgen import PredGenOptions, TurnResult, run_turn


@dataclass
class VoiceChatRow:
    source: str  # "text" or "audio"
    voice: str
    method: str
    turns: list[TurnResult] = field(default_factory=list)
    same_as_cascade: list[bool] = field(default_factory=list)


def read_questions(path: str | None = None) -> list[str]:
    """User turns: the first turn of each JSONL row (MT-Bench's ``turns``; a ``text`` field works too) or the lines
    of a text file; default the bundled MT-Bench questions.

    Raises:
        ValueError: a file with no turns in it, or a JSONL line that is not a question row (path and line given).
    """
    if path is None:
        text = resources.files("rayspec").joinpath("chat", "data", "mt_bench_questions.jsonl").read_text()
        path = "mt_bench_questions.jsonl"
    else:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if path.endswith(".jsonl"):
        out = []
        for n, line in enumerate(lines, 1):
            try:
                row = json.loads(line)
                turns = row.get("turns") or [row.get("text", "")]
                if not isinstance(turns, list) or not isinstance(turns[0], str):
                    raise ValueError("'turns' must be a list of strings")
            except (ValueError, AttributeError) as e:
                raise ValueError(f"{path}, line {n}: not a question row ({e})") from None
            out.append(turns[0].strip())
        lines = out
    turns = [t for t in lines if t]
    if not turns:
        raise ValueError(f"no turns in {path}")
    return turns


def spoken_partials(questions: list[str], voice, asr, chunk_s: float) -> list[list[tuple[float, str]]]:
    """Each question read aloud by ``voice`` (a :class:`~rayspec.tts.piper.PiperVoice`), resampled to the ASR's
    rate and transcribed as it streams in (:func:`~rayspec.chat.streaming.audio_partials`); turns whose final
    transcript is empty are left out."""
    import soxr

    from ..chat.streaming import audio_partials

    out = []
    for q in tqdm(questions, desc="spoken turns (TTS + streaming ASR)", leave=False):
        audio = soxr.resample(voice.synthesize(q), voice.sample_rate, asr.sample_rate).astype(np.float32)
        parts = audio_partials(asr, audio, asr.sample_rate, chunk_s)
        if parts[-1][1]:
            out.append(parts)
    return out


def methods(top_k: int, base: PredGenOptions, verifiers: str = "greedy,topk") -> list[PredGenOptions]:
    """The cascade, then PredGen with each of ``verifiers`` (comma-separated: greedy, topk), sharing ``base``'s
    lengths, caps and drafts.

    Raises:
        ValueError: an unknown verifier.
    """
    kw = dict(candidate_tokens=base.candidate_tokens, max_reply_tokens=base.max_reply_tokens,
              max_wasted_tokens=base.max_wasted_tokens, draft_tokens=base.draft_tokens)
    return [PredGenOptions(speculate=False, **kw)] + [
        PredGenOptions(verifier=v, top_k=top_k, **kw) for v in verifiers.split(",") if v]


def run_voicechat_bench(lm, voices: dict, inputs: dict[str, list[list[tuple[float, str]]]], opts: list[PredGenOptions],
                        progress: bool = True) -> list[VoiceChatRow]:
    """Run every (input source, voice, method) over the same turns; methods alternate turn by turn so that machine
    drift hits all of them alike. One warm-up turn per voice is run first and not counted.

    Args:
        lm: :class:`~rayspec.chat.lm.CausalLM`; voices: name -> TTS backend; inputs: source name -> per-turn partial
            prompt streams; opts: methods, the cascade first.
    """
    rows = []
    for vname, voice in voices.items():
        first = next(iter(inputs.values()))[0]
        for o in opts:
            run_turn(lm, voice, first, o)  # warm-up
        for source, turns in inputs.items():
            group = [VoiceChatRow(source, vname, o.label) for o in opts]
            for parts in tqdm(turns, desc=f"voicechat {source}/{vname}", disable=not progress, leave=False):
                results = [run_turn(lm, voice, parts, o) for o in opts]
                for row, r in zip(group, results):
                    row.turns.append(r)
                    row.same_as_cascade.append(r.reply_ids == results[0].reply_ids)
            rows += group
    return rows


def _median(xs):
    return statistics.median(xs) if xs else float("nan")


def write_voicechat_outputs(rows: list[VoiceChatRow], out_dir: str, title: str, notes: str = "") -> str:
    """``bench-voicechat.md`` / ``.csv`` / ``.png`` (audio-latency CDF) in ``out_dir``; returns the Markdown."""
    os.makedirs(out_dir, exist_ok=True)
    header = ["input", "TTS", "method", "turns", "median audio latency ms", "p90 ms", "speed-up (median)",
              "median TTFS ms", "median NFETFS", "NFETFS = 1", "accept / partial / reject",
              "median LLM ms after input", "median TTS ms after input", "extra LLM tokens / turn",
              "extra TTS s / turn", "reply = cascade"]
    base = {(r.source, r.voice): _median([t.audio_latency_s for t in r.turns]) for r in rows if r.method == "cascade"}
    cells = []
    for r in rows:
        lat = [t.audio_latency_s for t in r.turns]
        n = len(r.turns)
        outcomes = [t.outcome for t in r.turns]
        cells.append([
            r.source, r.voice, r.method, n, f"{_median(lat) * 1000:.1f}", f"{np.percentile(lat, 90) * 1000:.1f}",
            f"{base[r.source, r.voice] / max(_median(lat), 1e-9):.2f}x",
            f"{_median([t.ttfs_s for t in r.turns]) * 1000:.1f}",
            f"{_median([t.nfe_to_first_sentence for t in r.turns]):g}",
            f"{100 * sum(t.nfe_to_first_sentence == 1 for t in r.turns) / n:.0f}%",
            "-" if r.method == "cascade" else
            f"{outcomes.count('accept')} / {outcomes.count('partial')} / {outcomes.count('reject')}",
            f"{_median([t.llm_s for t in r.turns]) * 1000:.1f}", f"{_median([t.tts_s for t in r.turns]) * 1000:.1f}",
            f"{np.mean([t.wasted_tokens for t in r.turns]):.1f}", f"{np.mean([t.wasted_tts_s for t in r.turns]):.2f}",
            f"{100 * np.mean(r.same_as_cascade):.0f}%",
        ])
    stem = os.path.join(out_dir, "bench-voicechat")
    text = write_table(stem, title, header, cells, notes)
    _plot(rows, stem + ".png", title)
    return text


def _plot(rows: list[VoiceChatRow], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(r.source, r.voice) for r in rows})
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    for ax, (source, voice) in zip(axes[0], panels):
        for r in rows:
            if (r.source, r.voice) == (source, voice):
                lat = np.sort([t.audio_latency_s * 1000 for t in r.turns])
                ax.step(lat, np.arange(1, len(lat) + 1) / len(lat), where="post", label=r.method)
        ax.set_xscale("symlog", linthresh=10)
        ax.set_xlabel("audio latency after the end of input (ms)")
        ax.set_ylabel("fraction of turns")
        ax.set_title(f"{source} input, {voice} TTS")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def cmd_bench_voicechat(args) -> int:
    from ..chat.commands import load_lm, options_from_args
    from ..chat.streaming import text_partials
    from ..chat.voices import load_voice

    torch.set_num_threads(args.threads or 1)
    lm = load_lm(args.lm, args.llm_backend, args.vllm_python)
    prompts = read_questions(args.questions)[: args.limit or None]
    inputs = {"text": [text_partials(p, args.chars_per_minute) for p in prompts]}
    notes = []
    if args.audio_limit:
        from ..pipeline import DecodeOptions, Transcriber
        from ..tts.piper import PiperVoice

        asr = Transcriber(args.partials_model, options=DecodeOptions(), device=args.device)
        spoken = prompts[: args.audio_limit]
        voice = PiperVoice(noise=0.0, noise_w=0.0)  # the same audio on every run
        inputs["spoken"] = spoken_partials(spoken, voice, asr, args.chunk_s)
        notes.append(f"- spoken input: the first {len(spoken)} questions read by the Piper voice "
                     f"en_US-joe-medium (noise 0), fed in real time; partial transcripts every {args.chunk_s:g} s by "
                     f"{args.partials_model} on rayspec's engine (greedy, re-decoding the growing audio); the LLM "
                     f"answers the final transcript.")
    voices = {name: load_voice(name) for name in args.voices.split(",")}
    opts = methods(args.top_k, options_from_args(args), args.verifiers)
    rows = run_voicechat_bench(lm, voices, inputs, opts)
    if args.llm_backend != "transformers":  # the backend's greedy replies against transformers' own
        ref = load_lm(args.lm)
        cascade = [r for r in rows if r.method == "cascade"]
        same = total = 0
        for row in cascade:
            for turn, parts in zip(row.turns, inputs[row.source]):
                ref.reset()
                want = ref.generate(ref.prompt_ids(parts[-1][1]), opts[0].max_reply_tokens)
                same, total = same + (turn.reply_ids == want), total + 1
        notes.append(f"- {args.llm_backend} backend: cascade replies equal to transformers' greedy replies in "
                     f"{same}/{total} turns.")
    lm_name = os.path.basename(os.path.normpath(args.lm))
    title = (f"voicechat: {lm_name} ({args.llm_backend}), {len(prompts)} typed turns at "
             f"{args.chars_per_minute:g} chars/min"
             + (f" + {len(inputs['spoken'])} spoken" if "spoken" in inputs else "")
             + f", TTS {args.voices}, {torch.get_num_threads()} thread(s)")
    print(write_voicechat_outputs(rows, args.output, title, "\n".join(notes) + "\n"))
    return 0
