"""``rayspec chat`` (one voice-chat turn, PredGen against the plain cascade) and ``rayspec convert-llama2c``."""

from __future__ import annotations

import argparse
import json
import os

import numpy as np

from .lm_models import DEFAULT_LM, lm_names

DEFAULT_VLLM_PYTHON = ".venv-vllm/bin/python"


def add_predgen_args(p, tts: bool = True) -> None:
    """LM, TTS and PredGen flags shared by ``rayspec chat`` and ``rayspec bench --suite voicechat``."""
    from .predgen import PredGenOptions

    d = PredGenOptions()
    p.add_argument("--lm", default=DEFAULT_LM,
                   help=f"chat LLM: a name ({', '.join(lm_names())}; default {DEFAULT_LM}), a local causal-LM "
                        f"directory (Llama family) or a .gguf file")
    p.add_argument("--llm-backend", choices=["transformers", "vllm"], default="transformers",
                   help="transformers (in-process, default) or vLLM (its own environment: scripts/setup-vllm.sh)")
    p.add_argument("--vllm-python", default=os.environ.get("RAYSPEC_VLLM_PYTHON", DEFAULT_VLLM_PYTHON),
                   help=f"the vLLM environment's interpreter (default $RAYSPEC_VLLM_PYTHON or {DEFAULT_VLLM_PYTHON})")
    if tts:
        p.add_argument("--tts", choices=["piper", "rayspec", "espeak"], default="piper",
                       help="speech backend: the Piper voice en_US-joe-medium (default), rayspec's speculative TTS, "
                            "or espeak-ng (needs rayspec[espeak], GPL)")
    p.add_argument("--verifier", choices=["greedy", "topk"], default=d.verifier,
                   help="greedy: lossless (reply = the cascade's); topk: accept tokens in the top --top-k (lossy)")
    p.add_argument("--top-k", type=int, default=d.top_k, help=f"k of the topk verifier (default {d.top_k})")
    p.add_argument("--candidate-tokens", type=int, default=d.candidate_tokens,
                   help=f"candidate reply length per partial prompt, at least the first sentence (default "
                        f"{d.candidate_tokens})")
    p.add_argument("--max-reply-tokens", type=int, default=d.max_reply_tokens,
                   help=f"reply length cap (default {d.max_reply_tokens})")
    p.add_argument("--max-wasted-tokens", type=int, default=d.max_wasted_tokens,
                   help=f"stop speculating in a turn once this many speculative tokens were rejected (default "
                        f"{d.max_wasted_tokens})")
    p.add_argument("--draft-tokens", type=int, default=d.draft_tokens,
                   help=f"PredGen: draft tokens per LLM pass from the turn's earlier candidates (lossless; 0: one "
                        f"token per pass; default {d.draft_tokens})")
    p.add_argument("--chars-per-minute", type=float, default=600.0,
                   help="typing/speaking rate of --text input, as partial prompts (default 600, the paper's)")


def options_from_args(args, speculate: bool = True, verifier: str | None = None):
    """:class:`~rayspec.chat.predgen.PredGenOptions` from parsed ``rayspec chat`` arguments (``speculate=False``: the
    plain cascade)."""
    from .predgen import PredGenOptions

    return PredGenOptions(speculate=speculate, verifier=verifier or args.verifier, top_k=args.top_k,
                          candidate_tokens=args.candidate_tokens, max_reply_tokens=args.max_reply_tokens,
                          max_wasted_tokens=args.max_wasted_tokens, draft_tokens=args.draft_tokens)


def load_lm(name: str | None, backend: str = "transformers", vllm_python: str = DEFAULT_VLLM_PYTHON):
    """The chat LLM engine for an ``--lm`` value (:func:`~rayspec.chat.lm_models.resolve_lm`; None: the default):
    ``transformers`` in-process or ``vllm`` in its own environment, both from the same directory.

    Raises:
        ValueError: an unknown backend; ModelLoadError / OSError: see the engines.
    """
    from .lm import CausalLM, VLLMCausalLM
    from .lm_models import resolve_lm

    if backend not in ("transformers", "vllm"):
        raise ValueError(f"unknown LLM backend {backend!r} (transformers or vllm)")
    path = resolve_lm(name)
    return CausalLM.from_pretrained(path) if backend == "transformers" else VLLMCausalLM(path, vllm_python)


def cmd_chat(args) -> int:
    if args.server:
        from .client import chat_over_websocket

        return chat_over_websocket(args)
    import soundfile as sf
    import torch

    from ..tts.phones import split_sentences
    from .predgen import run_turn
    from .streaming import audio_partials, text_partials
    from .voices import load_voice

    if args.threads:
        torch.set_num_threads(args.threads)
    lm, voice = load_lm(args.lm, args.llm_backend, args.vllm_python), load_voice(args.tts)
    if args.audio:
        from ..audio import load_audio
        from ..options import build_transcriber

        asr = build_transcriber(args)
        audio = load_audio(args.audio, asr.sample_rate)
        partials = audio_partials(asr, audio, asr.sample_rate, args.chunk_s)
        asr_final_s = partials[-1][0] - audio.size / asr.sample_rate
        if not partials[-1][1]:
            raise ValueError(f"no speech recognised in {args.audio}")
    else:
        partials, asr_final_s = text_partials(args.text, args.chars_per_minute), None
    for speculate in (False, True):  # warm-up (first passes, voice start-up), not measured
        run_turn(lm, voice, text_partials("Hello there."), options_from_args(args, speculate=speculate))
    base = run_turn(lm, voice, partials, options_from_args(args, speculate=False))
    turn = run_turn(lm, voice, partials, options_from_args(args))
    rows = [("cascade", base), (options_from_args(args).label, turn)]
    if args.json:
        print(json.dumps({"input": partials[-1][1], "reply": turn.reply, "same_as_cascade": turn.reply_ids ==
                          base.reply_ids, "asr_final_s": asr_final_s, **{name: _breakdown(r) for name, r in rows}}))
    else:
        print(f"user:  {partials[-1][1]}" + ("" if asr_final_s is None else f"   (ASR, {len(partials)} partials; "
                                                                          f"final decode {asr_final_s * 1000:.0f} ms)"))
        print(f"reply: {turn.reply}")
        print(f"\n{'':15s} {'audio latency':>14s} {'TTFS':>9s} {'LLM':>9s} {'TTS':>9s} {'NFE to 1st':>10s} "
              f"{'outcome':>8s} {'wasted tok':>10s}")
        for name, r in rows:
            print(f"{name:15s} {r.audio_latency_s * 1000:11.1f} ms {r.ttfs_s * 1000:6.1f} ms {r.llm_s * 1000:6.1f} ms "
                  f"{r.tts_s * 1000:6.1f} ms {r.nfe_to_first_sentence:10d} {r.outcome:>8s} {r.wasted_tokens:10d}")
        same = "identical to" if turn.reply_ids == base.reply_ids else "differs from"
        speedup = base.audio_latency_s / max(turn.audio_latency_s, 1e-9)
        print(f"\nreply {same} the cascade's; audio latency speed-up {speedup:.2f}x (times from the end of the "
              f"input)")
    if args.output:
        rest = [voice.synthesize(s) for s in split_sentences(turn.reply[len(turn.first_sentence):]) if s.strip()]
        pause = np.zeros(int(0.2 * voice.sample_rate), np.float32)
        parts = [turn.first_audio] + rest
        audio_out = np.concatenate([x for a in parts for x in (a, pause)][:-1])
        os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
        sf.write(args.output, audio_out, voice.sample_rate)
        if not args.json:
            print(f"audio: {args.output} ({audio_out.size / voice.sample_rate:.1f} s)")
    return 0


def _breakdown(r) -> dict:
    return {"audio_latency_s": r.audio_latency_s, "ttfs_s": r.ttfs_s, "llm_s": r.llm_s, "tts_s": r.tts_s,
            "nfe_to_first_sentence": r.nfe_to_first_sentence, "outcome": r.outcome,
            "accepted_tokens": r.accepted_tokens, "wasted_tokens": r.wasted_tokens, "wasted_tts_s": r.wasted_tts_s,
            "partials_used": r.partials_used, "partials_skipped": r.partials_skipped,
            "first_sentence": r.first_sentence}


def cmd_convert(args) -> int:
    from .llama2c import convert

    out = convert(args.checkpoint, args.tokenizer, args.output, args.pad_head_dim)
    print(f"wrote {out} (load with transformers' AutoModelForCausalLM.from_pretrained)")
    return 0


def add_chat_parsers(sub) -> None:
    from ..options import add_decode_args, add_model_args

    p = sub.add_parser(
        "chat", help="one voice-chat turn: ASR -> LLM -> TTS with input-time speculation (PredGen)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Reply to a typed or spoken turn with a causal LM and speak the reply, speculating while the "
                    "input arrives (PredGen): candidate replies are generated from partial input, verified in one "
                    "LLM pass as the input grows, and their first sentence is synthesised ahead. The plain cascade "
                    "runs on the same input for comparison; the latency breakdown of both is printed.",
        epilog="examples:\n  rayspec chat --text \"What is the capital of France?\" -o reply.wav\n"
               "  rayspec chat --audio question.wav          # partials by --target (whisper-tiny.en)\n"
               "  rayspec chat --text \"Tell me a joke.\" --verifier topk --top-k 3 --llm-backend vllm\n"
               "  rayspec serve --chat &                      # then open http://127.0.0.1:8000/\n"
               "  rayspec chat --server ws://127.0.0.1:8000/v1/realtime --text \"Tell me a joke.\"\n",
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--text", help="the user's turn as text (streamed at --chars-per-minute)")
    src.add_argument("--audio", help="the user's turn as an audio file (transcribed as it streams in)")
    p.add_argument("--chunk-s", type=float, default=0.5, help="--audio: seconds between partial transcripts")
    p.add_argument("--server", help="talk to a voice-chat endpoint instead of running in-process, e.g. "
                                    "ws://127.0.0.1:8000/v1/realtime (rayspec serve --chat); input is streamed in "
                                    "real time")
    p.add_argument("--api-key", default=os.environ.get("RAYSPEC_API_KEY") or None,
                   help="--server: the endpoint's API key (rayspec serve --api-key; default: RAYSPEC_API_KEY)")
    p.add_argument("-o", "--output", help="write the spoken reply here (.wav/.flac)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    add_predgen_args(p)
    add_model_args(p, target="whisper-tiny.en")  # spoken turns: partial and final transcripts by the small model
    add_decode_args(p)
    p.set_defaults(func=cmd_chat)

    p = sub.add_parser("convert-llama2c", help="convert a llama2.c checkpoint to a transformers Llama directory",
                       description="Convert a llama2.c .bin checkpoint and its tokenizer .bin into a "
                                   "LlamaForCausalLM directory (safetensors + tokenizer.json) with the same greedy "
                                   "output. --pad-head-dim widens attention heads with identical outputs (vLLM's CPU "
                                   "attention needs head sizes of 32, 64, ...).")
    p.add_argument("checkpoint", help="llama2.c model .bin (e.g. stories260K.bin)")
    p.add_argument("tokenizer", help="llama2.c tokenizer .bin (e.g. tok512.bin)")
    p.add_argument("-o", "--output", required=True, help="output directory")
    p.add_argument("--pad-head-dim", type=int, help="widen heads to this size (a multiple of the head size)")
    p.set_defaults(func=cmd_convert)
