"""``rayspec bench``'s arguments and its dispatch to the suites (each suite's module is imported only when run)."""

from __future__ import annotations

import argparse
import os

from .process import DEFAULT_CONFIGS
import tempfile

from ..decoding.options import MEL_PADDINGS
from ..options import add_model_args


def cmd_bench(args) -> int:
    """``rayspec bench``: run the chosen suite."""
    if args.suite == "tts":
        from .tts import cmd_bench_tts

        return cmd_bench_tts(args)
    if args.suite == "voicechat":
        from .voicechat import cmd_bench_voicechat

        return cmd_bench_voicechat(args)
    if args.suite == "peers":
        from .peers import cmd_bench_peers

        return cmd_bench_peers(args)
    if args.suite == "gpu":
        from .gpu import cmd_bench_gpu

        return cmd_bench_gpu(args)
    if args.suite == "timestamps":
        from .timestamps import cmd_bench_timestamps

        return cmd_bench_timestamps(args)
    if args.suite == "decoding":
        from .decoding import cmd_bench_decoding

        return cmd_bench_decoding(args)
    if args.suite == "whisper":
        from .whisper import cmd_bench_whisper

        return cmd_bench_whisper(args)
    from .asr import cmd_bench_asr

    return cmd_bench_asr(args)


def _positive(text: str) -> int:
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {n}")
    return n


def add_bench_parser(sub) -> None:
    p = sub.add_parser(
        "bench", help="benchmark decoders against AR side by side (table + plot)",
        description="Decode the same audio with AR and the chosen suite's configurations, side by side in one run; "
                    "writes bench-<suite>.md/.csv/.png. NFE = target forward passes, which do not depend on "
                    "machine noise; wall-clock ratios are measured in the same run. Suites: spec (draft-model "
                    "speculation ablation, plus transformers' assisted generation at batch 1), ssd (CTC gating / "
                    "verification / fallback over a tau grid, WER-vs-RTFx Pareto plot), ssd-gate (AR and SSD at "
                    "its defaults for each --tau-ctc: the gate's speed-up against WER), medusa (heads, tree shapes, "
                    "acceptance rules, beside AR and the draft method), methods (every method at its defaults with "
                    "its bundled drafter, each run's time split into the encoder side and the decoder side, and "
                    "the share of the most a free decoder could gain that each method reaches; spec, ssd, ssd-gate, "
                    "medusa and methods run in float32 unless --compute-type is given), tts (speculative "
                    "speech synthesis: "
                    "target-only, sd, ssd beta sweep, pcg theta sweep; intelligibility by pocketsphinx, MCD, "
                    "acceptance, speed-up; floors of real and Lyra-resynthesised speech; offline acceptance), "
                    "voicechat (PredGen greedy / top-k against the plain cascade on MT-Bench first turns: typed, "
                    "streamed at 600 characters per minute, and spoken, read by the Piper voice and transcribed by "
                    "Whisper as they stream in; TTFS, LLM passes to first sentence, audio latency CDF, wasted work), peers (rayspec's "
                    "engine against vLLM and transformers on the published Whisper architectures, same audio, "
                    "same threads, same tokens per utterance; needs scripts/setup-vllm.sh for the vLLM rows), "
                    "whisper (real Whisper on rayspec's engine: WER, space-free CER, RTFx, and token identity "
                    "against transformers' generate and CTranslate2 on the same features), gpu (the engine on one "
                    "device: ar and every method at --batch-sizes with static steps / CUDA graphs on and off, cold "
                    "and warm, per-pass costs, transformers' generate, static cache and compile as peers; "
                    "scripts/gpu_bench.sh runs it in one call), "
                    "timestamps (word start/end errors against the true word times of speech read by the Piper "
                    "voice, beside faster-whisper on the same weights; batch-1 speed of each method with and without "
                    "timestamps; long-form WER and end-of-file drift, sequential vs VAD vs faster-whisper's sequential), "
                    "decoding (greedy, beam 5 and beam 5 + temperature fallback against openai/whisper and "
                    "faster-whisper on the same weights, audio and threads: WER, RTFx, tokens identical to "
                    "openai/whisper's, texts identical to faster-whisper's, the speculative methods' speed-up over "
                    "beam 5; then fallback on noisy speech built from the manifest, --clips of them, --sections "
                    "main,noisy; float32 unless --compute-type is given).",
    )
    p.add_argument("manifests", nargs="*", help="manifests (with references for WER) or folders of audio")
    p.add_argument("--suite", choices=["spec", "ssd", "ssd-gate", "medusa", "methods", "tts", "voicechat", "peers", "whisper", "gpu",
                                            "timestamps", "decoding"],
                   default="spec")
    p.add_argument("-o", "--output", default="bench", help="output folder (default: bench)")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
    p.add_argument("--limit", type=int, default=0, help="use only the first N utterances (peers: default 64)")
    p.add_argument("--max-draft", type=int, default=0, help="spec: override max draft length of adaptive configs")
    p.add_argument("--no-hf", action="store_true", help="spec: skip transformers' assisted generation")
    p.add_argument("--repeats", type=_positive, default=1,
                   help="spec/ssd/medusa/methods/peers/tts: timed runs per configuration, taken round-robin over the "
                        "configurations, the fastest reported (default 1)")
    p.add_argument("--tau-ctc", type=float, nargs="+", default=[0.3, 0.7, 1.5, 3.0],
                   help="ssd, ssd-gate: gate thresholds")
    p.add_argument("--methods", default="",
                   help="methods: only these rows, comma-separated (ar always; rows: ar, draft, medusa, ctc-draft, "
                        "'ssd (lossy)', 'ssd exact'); default all")
    p.add_argument("--tau-slm", type=float, nargs="+", default=[0.01, 0.1, 0.2], help="ssd: verification thresholds")
    p.add_argument("--ctc", help="ssd/methods: CTC head directory; default: the one bundled for the target, if any")
    p.add_argument("--medusa", help="medusa/methods: heads directory; default: the ones bundled for the target, if any")
    r = p.add_argument_group("whisper suite (manifests with references)")
    r.add_argument("--whisper-targets", default="whisper-base,whisper-tiny.en",
                   help="targets, comma-separated, each optionally with @<encoder dtype> (e.g. whisper-base@bfloat16) "
                        "and :short=<seconds> (a short encoder window, --short-window; e.g. whisper-base:short=10); "
                        "default whisper-base,whisper-tiny.en")
    r.add_argument("--limits", type=int, nargs="*", default=[],
                   help="first N utterances of each manifest (one value for all, or one per manifest; 0 = all)")
    r.add_argument("--identity-limits", type=int, nargs="*", default=[130],
                   help="first N utterances of each manifest decoded also by transformers and CTranslate2 (one "
                        "value for all, or one per manifest; default 130)")
    t = p.add_argument_group("tts suite (manifests: LJSpeech-style rows with text and audio)")
    t.add_argument("--tts-target", help="TTS target directory (default: the bundled zoo tts-target)")
    t.add_argument("--tts-draft", help="TTS draft directory (default: the bundled zoo tts-draft)")
    t.add_argument("--codec", help="Lyra v2 codec directory (default: the bundled one)")
    t.add_argument("--tts-ids", default="dev",
                   help="'dev' (the zoo's 30 held-out LJSpeech clips, default), 'all', or comma-separated ids")
    t.add_argument("--betas", type=float, nargs="+", default=[0.1, 0.3, 0.5], help="ssd betas")
    t.add_argument("--thetas", type=float, nargs="+", default=[0.98, 0.95, 0.9], help="pcg thetas")
    t.add_argument("--speed", type=float, default=None,
                   help="the student's speaking rate (default: rayspec synthesize's; the teacher's stays 1)")
    t.add_argument("--groups", choices=["codec", "target"], default="codec", help="pcg group vectors")
    t.add_argument("--temperature", type=float, help="sampling temperature (default: rayspec synthesize's)")
    t.add_argument("--lookahead", type=int, default=None,
                   help="draft tokens per round for every method (default: each method's, as rayspec synthesize)")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--no-asr", action="store_true", help="skip the rayspec-ASR (--target) WER column")
    t.add_argument("--teacher-voice", default="en_US-joe-medium",
                   help="Piper voice whose audio of the same sentences is a floor and whose token sequences the "
                        "offline acceptance uses ('none': the real recordings')")
    v = p.add_argument_group("voicechat suite")
    v.add_argument("--questions", help="turns: a JSONL file with MT-Bench's fields (the first of `turns`) or a text "
                                       "file, one turn per line (default: the bundled 80 MT-Bench questions)")
    v.add_argument("--voices", default="piper", help="TTS backends, comma-separated: piper, rayspec, espeak "
                                                     "(default piper)")
    v.add_argument("--audio-limit", type=int, default=20,
                   help="spoken turns: the first N questions read aloud by the Piper voice (default 20; 0: none)")
    v.add_argument("--partials-model", default="whisper-tiny.en",
                   help="spoken turns: the ASR model of the partial and final transcripts (default whisper-tiny.en)")
    v.add_argument("--verifiers", default="greedy,topk",
                   help="PredGen verifiers run beside the cascade, comma-separated (default greedy,topk)")
    v.add_argument("--chunk-s", type=float, default=0.5, help="spoken turns: seconds between partial transcripts")
    w = p.add_argument_group("peers suite (manifests: optional, default the bundled AN4 clips; --threads: per "
                             "engine, default 1)")
    w.add_argument("--peer-models", default="tiny.en,base.en,small.en",
                   help="published Whisper configurations with random weights and forced token counts (default "
                        "tiny.en,base.en,small.en), or installed models with their real weights, decoded to EOS "
                        "and scored (whisper-base,whisper-tiny.en)")
    w.add_argument("--engines", default="rayspec,transformers,vllm",
                   help="engines, comma-separated, each NAME[:METHOD][@COMPUTE_TYPE]: rayspec (rayspec:draft, "
                        "rayspec@bfloat16 = bf16 encoder), transformers, vllm, and on "
                        "installed models faster-whisper, faster-whisper-batched, ctranslate2 (@int8 or "
                        "@float32); default rayspec,transformers,vllm")
    w.add_argument("--tokens", type=int, default=32, help="tokens generated per utterance by every engine (default 32)")
    w.add_argument("--models-dir", default=os.path.join(tempfile.gettempdir(), "rayspec-peers"),
                   help="where the random checkpoints are written once (default: $TMPDIR/rayspec-peers)")
    w.add_argument("--serve-concurrency", type=int, nargs="*", default=[],
                   help="also load rayspec serve (once per rayspec engine of --engines: rayspec:draft serves "
                        "--method draft, rayspec@bfloat16 --encoder-dtype bfloat16) and vLLM's OpenAI server (first "
                        "--peer-models model) with this many requests in flight, e.g. 1 8 32 (default: off)")
    w.add_argument("--whole-process", nargs="?", const=",".join(DEFAULT_CONFIGS), metavar="CONFIGS",
                   help="time whole processes instead (start to exit: imports, model load, audio decoding, "
                        "transcription) on the installed whisper-base, each configuration of CONFIGS (default "
                        f"{','.join(DEFAULT_CONFIGS)}; see rayspec.bench.process) --repeats times, alternating; "
                        "--threads per process (default 2)")
    w.add_argument("--serve-tokens-per-second", type=float, default=8.0,
                   help="serve load: token cap per second of audio on both servers (default 8)")
    g = p.add_argument_group("gpu suite (manifests: optional with --random-weights; --tokens, --repeats, --no-hf)")
    g.add_argument("--random-weights", action="store_true",
                   help="whisper-base's architecture with random weights, no drafters: speed only, every utterance "
                        "forced to --tokens tokens (seeded noise clips unless a manifest is given)")
    g.add_argument("--random-size", choices=("base", "tiny"), default="base",
                   help="with --random-weights: whisper-base's layers (default) or a tiny decoder (CI on a CPU)")
    g.add_argument("--clips", type=int, default=40, help="the first N clips of the manifests (default 40)")
    g.add_argument("--cold-methods", default="ar,ctc-draft",
                   help="methods timed as the first job of a fresh process, comma-separated (default ar,ctc-draft; "
                        "'' skips; --random-weights: ar only)")
    g.add_argument("--rule-methods", default="draft,ctc-draft",
                   help="exact methods also run at the default --speculate-max-rows (the speculation rule) beside "
                        "forced on (every round speculates) and ar, with the static steps on: bench-gpu-rule.md "
                        "(comma-separated; default draft,ctc-draft; '' skips; real weights only)")
    g.add_argument("--cold-run", default="", help=argparse.SUPPRESS)  # METHOD:BATCH:on|off, the suite's subprocess
    dg = p.add_argument_group("decoding suite (--sections main,noisy; --repeats: timed runs round-robin, the fastest "
                              "counts)")
    dg.add_argument("--rows", default="",
                    help="main rows to run, by engine and mode, comma-separated, e.g. 'rayspec beam 5,faster-whisper "
                         "beam 5' (every batch size of each; default all rows): a speed comparison with round-robin "
                         "--repeats in less time")
    dg.add_argument("--mel-padding", choices=MEL_PADDINGS, default="silence",
                    help="rayspec's log-mel window after a shorter clip (rayspec transcribe --mel-padding), for its "
                         "rows and the features openai/whisper's decode rows read (default silence)")
    ts = p.add_argument_group("timestamps suite (manifest: LJSpeech's clips.jsonl; --limit: speed clips, default 40; "
                              "--threads: default 2; --models-dir: faster-whisper's CTranslate2 copy)")
    ts.add_argument("--sections", default="words,speed,long", help="parts to run, comma-separated (default all)")
    ts.add_argument("--texts", help="held-out sentences (LJSpeech id|raw|normalized; default: "
                                    "metadata_text_only.csv beside the manifest)")
    ts.add_argument("--data-dir", default=os.path.join("runs", "timestamps-data"),
                    help="where the Piper set and the long recordings are built once (default runs/timestamps-data)")
    ts.add_argument("--piper-sentences", type=_positive, default=30, help="Piper set size (default 30)")
    ts.add_argument("--long-files", type=_positive, default=2, help="long recordings (default 2)")
    ts.add_argument("--long-seconds", type=float, default=300.0, help="length of each long recording (default 300)")
    ts.add_argument("--ts-methods", default="ar,draft,ctc-draft",
                    help="methods of the speed part, comma-separated (default ar,draft,ctc-draft)")
    from ..chat.commands import add_predgen_args

    add_predgen_args(v, tts=False)
    add_model_args(p)
    p.set_defaults(func=cmd_bench)
