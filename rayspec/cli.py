"""The ``rayspec`` command line: transcribe, synthesize, score, train, serve, bench."""

from __future__ import annotations

import argparse
import json
import os
import sys
import textwrap

from .options import (  # noqa: F401 - EXIT_USAGE is part of the CLI's interface (exit statuses)
    EXIT_SOME_FAILED,
    EXIT_USAGE,
    add_decode_args,
    add_model_args,
    budget_from_args,
    build_transcriber,
    decode_option_names,
    print_summary,
    run_command,
)


EPILOG = textwrap.dedent(
    """\
    examples:
      rayspec transcribe an4/test.jsonl -o an4.parquet                          # Whisper base, greedy (AR)
      rayspec transcribe clips/ -o out.parquet --target whisper-tiny.en          # a folder, another model
      rayspec transcribe an4/test.jsonl -o an4-spec.parquet --method draft
      rayspec transcribe an4/test.jsonl -o an4-medusa.parquet --method medusa
      rayspec data manifest an4 --corpus an4 -o an4/test.jsonl                  # a manifest of CMU's AN4 test set
      rayspec score an4.parquet                                                 # WER/CER per corpus
      rayspec export out.parquet --format srt vtt -o subs/                      # subtitles (--timestamps)
      rayspec synthesize texts.txt -o tts-out --method pcg                      # speculative TTS
      rayspec chat --text "Once upon a time, there was a little dog named Max."  # voice chat (PredGen)
      rayspec train medusa --help                                               # drafters for a target
      rayspec bench --help                                                      # speculative decoding benchmark
    """
)


def cmd_transcribe(args) -> int:
    from tqdm import tqdm

    from .manifest import read_manifest
    from .methods import METHODS
    from .runs import run_corpus

    utts = read_manifest(args.input)
    transcriber = build_transcriber(args, announce=True)
    with tqdm(total=len(utts), desc="transcribe", unit="utt", disable=args.quiet) as bar:
        summary = run_corpus(utts, transcriber, args.output, budget_from_args(args, transcriber.target.config),
                             progress=bar.update,
                             continuous=not args.no_continuous and METHODS[transcriber.options.method].continuous)
    print_summary(summary, args.output)
    return EXIT_SOME_FAILED if summary.failed else 0


def cmd_synthesize(args) -> int:
    from tqdm import tqdm

    from .tts.flags import sampling_from_args
    from .tts.synthesis import Synthesizer, read_texts, run_synthesis

    items = read_texts(args.input)
    opts = sampling_from_args(args)
    # the vocoder runs on a thread of its own beside generation (Synthesizer.synthesize): leave it a core (2 cores,
    # 30 sentences at batch 16: 5.3 s with 1 torch thread, 5.6-5.7 s with 2)
    threads = args.threads or max(1, (os.cpu_count() or 2) - 1)
    synth = Synthesizer(args.tts_target, args.tts_draft, args.codec, threads=threads)
    with tqdm(total=len(items), desc="synthesize", unit="text", disable=args.quiet) as bar:
        s = run_synthesis(items, synth, args.output, opts, args.seed, args.format, args.speed, args.batch_size,
                          progress=bar.update)
    print(f"{s.done} texts synthesised ({s.skipped} already done), {s.failed} failed, {s.audio_s:.1f} s of audio "
          f"in {s.wall_s:.1f} s (RTFx {s.audio_s / max(s.wall_s, 1e-9):.2f}) -> {args.output}")
    return EXIT_SOME_FAILED if s.failed else 0


def _synthesize_parser(sub) -> None:
    from .tts.flags import AUDIO_FORMATS, add_synthesis_args

    p = sub.add_parser(
        "synthesize", help="text -> speech with speculative speech-token sampling (in-process; see jobs.synthesize "
                           "for Ray)",
        description="Synthesise every text of a .txt (one per line), .jsonl / .csv / .parquet (columns text[, id]) "
                    "into <output>/audio/<id>.<format> and one <output>/results.parquet (NFE, draft tokens "
                    "proposed/accepted, groups accepted, decode time per row). Sentences are batched across texts. "
                    "Re-running resumes; a bad text (empty, over 4096 characters, nothing pronounceable, not UTF-8) "
                    f"is an error row and the exit status is {EXIT_SOME_FAILED}.",
        epilog="example:\n  rayspec synthesize texts.txt -o tts-out --method pcg --format flac",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("input", help="texts file (.txt, .jsonl, .csv, .parquet)")
    p.add_argument("-o", "--output", required=True, help="output folder")
    p.add_argument("--format", choices=sorted(AUDIO_FORMATS), default="flac", help="audio file format")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    add_synthesis_args(p)
    p.set_defaults(func=cmd_synthesize)


def cmd_convert(args) -> int:
    import os
    import shutil
    import time

    from .models.ct2 import convert_ct2, is_converted_dir, is_ct2_dir
    from .models.errors import ModelLoadError
    from .models.registry import MODELS, resolve_model

    out = args.output
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out) and not is_converted_dir(out)):
        raise ModelLoadError(f"{out} exists and is not an earlier conversion: choose a new output directory")
    t0 = time.perf_counter()
    if args.source in MODELS:
        if os.path.isdir(out):
            shutil.rmtree(out)
        shutil.copytree(resolve_model(args.source), out)
    elif is_ct2_dir(args.source):
        convert_ct2(args.source, out)
    else:
        raise ModelLoadError(f"{args.source} is neither a model name ({', '.join(sorted(MODELS))}) nor a "
                             "CTranslate2 directory (model.bin + config.json)")
    print(f"{args.source} -> {out} (transformers save_pretrained directory, float32) in "
          f"{time.perf_counter() - t0:.1f} s")
    return 0


def cmd_score(args) -> int:
    from .scoring import format_table, score_results

    scores = score_results(args.results, normalized=not args.raw)
    if args.json:
        print(json.dumps(scores["all"]))
    else:
        print(format_table(scores))
    return 0


NEEDS_TARGET = {"medusa": "the frozen model the heads are for",
                "ctc": "the model whose frozen encoder the head reads",
                "draft-decoder": "the model whose encoder it reads",
                "tts-draft": "the TTS target it is distilled from"}  # train kinds -> what their --target is


def cmd_export(args) -> int:
    from .export import ExportError, export_results

    try:
        summary = export_results(args.results, args.output, args.format, args.word_level)
    except ExportError as exc:
        print(f"rayspec export: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    for line in summary.skipped[:20]:
        print(f"  skipped {line}", file=sys.stderr)
    print(f"{len(summary.files)} files written ({', '.join(args.format)}), {len(summary.skipped)} error rows "
          f"skipped -> {args.output}")
    return 0


def _export_parser(sub) -> None:
    from .export import FORMATS

    p = sub.add_parser(
        "export", help="results -> subtitles / transcripts, one file per audio id (srt, vtt, tsv, json)",
        description="Write <output>/<id>.<format> for every successful row of a results file: srt and vtt "
                    "subtitles (pysubs2) from the segments column (or one cue per word with --word-level), "
                    "openai/whisper's tsv (start, end in ms, text), or json (text, language, segments, words). "
                    "Results transcribed without timestamps give one cue over the whole file (as rayspec serve); "
                    "--word-level needs --timestamps word.",
        epilog="example:\n  rayspec transcribe clips/ -o out.parquet --timestamps word\n"
               "  rayspec export out.parquet --format srt vtt -o subs/",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("results", help="results .parquet file (or shard folder)")
    p.add_argument("--format", nargs="+", choices=FORMATS, default=["srt"], help="one or more formats (default srt)")
    p.add_argument("-o", "--output", required=True, help="output folder")
    p.add_argument("--word-level", action="store_true",
                   help="srt/vtt/tsv: one cue per word (from the words column) instead of one per segment")
    p.set_defaults(func=cmd_export)


def cmd_train(args) -> int:
    from .train.recipe import DRAFT_ARCH, TARGET_ARCH, Architecture, TrainOptions, train

    if args.kind != "tts-data" and not args.work_dir:
        print(f"rayspec train: error: {args.kind} needs --work-dir (checkpoints, caches, logs)", file=sys.stderr)
        return EXIT_USAGE
    if args.kind in NEEDS_TARGET and not args.target:
        print(f"rayspec train: error: {args.kind} needs --target ({NEEDS_TARGET[args.kind]})", file=sys.stderr)
        return EXIT_USAGE
    if args.epochs is None:
        args.epochs = 20 if args.kind == "ctc" else 60
    if args.lr is None:
        args.lr = 1e-3 if args.kind == "ctc" else 1.5e-3

    if args.kind == "medusa":
        from .train.medusa import train_medusa

        summary = train_medusa(args.target, args.manifests, args.output, args.work_dir, args.medusa_heads,
                               args.epochs, seed=args.seed, threads=args.threads,
                               max_utterances=args.max_utterances, block=args.medusa_block, device=args.device)
        print(json.dumps({"dev_top1": summary["dev_top1"]}))
        return 0

    if args.kind == "ctc":
        import torch

        from .train.ctc_head import train_ctc_head

        summary = train_ctc_head(args.target, args.manifests, args.output, args.work_dir,
                                 layers=2 if args.encoder_layers is None else args.encoder_layers,
                                 width=args.d_model or 256, heads=args.heads or 4, ffn=args.ffn or 1024,
                                 tokens=args.ctc_tokens,
                                 epochs=args.epochs, lr=args.lr,
                                 batch_positions=args.batch_frames // 2, seed=args.seed, threads=args.threads,
                                 max_utterances=args.max_utterances, max_steps=args.max_steps,
                                 encoder_dtype=getattr(torch, args.encoder_dtype) if args.encoder_dtype else None,
                                 device=args.device)
        print(json.dumps(summary["dev_per_epoch"][-1] if summary["dev_per_epoch"] else {}))
        return 0

    if args.kind == "draft-decoder":
        from .train.draft_decoder import train_draft_decoder

        summary = train_draft_decoder(args.target, args.manifests, args.output, args.work_dir,
                                      args.decoder_layers or 2, args.epochs, args.lr,
                                      batch_positions=args.batch_frames // 2, seed=args.seed, threads=args.threads,
                                      max_utterances=args.max_utterances, device=args.device,
                                      max_steps=args.max_steps)
        print(json.dumps({"dev_top1": summary["dev_top1"]}))
        return 0

    if args.kind.startswith("tts-"):
        return _train_tts(args)

    base = DRAFT_ARCH if args.kind == "draft" else TARGET_ARCH
    arch = Architecture(
        d_model=args.d_model or base.d_model, encoder_layers=args.encoder_layers or base.encoder_layers,
        decoder_layers=args.decoder_layers or base.decoder_layers, heads=args.heads or base.heads,
        ffn=args.ffn or base.ffn, frame_stack=args.frame_stack or base.frame_stack,
        position_scale=base.position_scale if args.position_scale is None else args.position_scale,
    )
    opt = TrainOptions(epochs=args.epochs, batch_frames=args.batch_frames, lr=args.lr, seed=args.seed,
                       threads=args.threads, ctc_weight=args.ctc_weight, eval_every=args.eval_every,
                       warmup_steps=args.warmup_steps, dropout=args.dropout,
                       **({} if args.regularize_after is None else {"regularize_after": args.regularize_after}))
    summary = train(args.kind, args.manifests, args.output, args.work_dir, opt, arch, teacher_dir=args.target,
                    ctc_out=args.ctc_output, max_steps=args.max_steps, max_utterances=args.max_utterances,
                    init_dir=args.init, init_ctc=args.init_ctc)
    print(json.dumps(summary["final_dev"]))
    return 0


def _train_tts(args) -> int:
    from .train.tts import TTSTrainOptions, train_tts_draft, train_tts_target
    from .tts.synthesis import default_codec_dir

    if args.kind == "tts-data":
        return _tts_data(args)

    opt = TTSTrainOptions(epochs=args.epochs, batch_frames=args.batch_frames, lr=args.lr, seed=args.seed,
                          threads=args.threads, dropout=args.dropout, warmup_steps=args.warmup_steps,
                          eval_every=args.eval_steps)
    codec = args.codec or default_codec_dir()
    if args.kind == "tts-target":
        arch = {k: v for k, v in (("d_model", args.d_model), ("encoder_layers", args.encoder_layers),
                                  ("decoder_layers", args.decoder_layers), ("heads", args.heads),
                                  ("ffn", args.ffn)) if v}
        summary = train_tts_target(args.manifests, args.output, args.work_dir, codec, opt, arch,
                                   max_utterances=args.max_utterances, init_dir=args.init)
    else:
        arch = {"d_model": args.d_model} if args.d_model else {}
        summary = train_tts_draft(args.target, args.manifests, args.output, args.work_dir, codec, opt, arch,
                                  max_utterances=args.max_utterances)
    print(json.dumps(summary))
    return 0


def _tts_data(args) -> int:
    import random

    from .train.tts_data import prepare_piper
    from .tts.synthesis import default_codec_dir, read_texts

    items = [(it.id, it.text) for m in args.manifests for it in read_texts(m) if not it.error and it.text.strip()]
    random.Random(args.seed).shuffle(items)
    items = items[:args.sentences]
    examples, failed = prepare_piper(items, args.output, args.codec or default_codec_dir(), args.voice,
                                     workers=args.workers, noise_w=args.noise_w)
    frames = sum(len(e.codes) for e in examples)
    print(json.dumps({"sentences": len(examples), "hours": round(frames / 50 / 3600, 3), "failed": len(failed),
                      "output": args.output}))
    return 0


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` (an IP address or a name) serves this machine only: ``localhost`` or a loopback
    address (127.0.0.0/8, ::1). Other names count as reachable from the network."""
    import ipaddress

    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return host.lower() == "localhost"


def cmd_serve(args) -> int:
    """Ray lives outside the library: the Serve application and its driver loop are in ``actors/serve_app.py``."""
    import os

    if not args.api_key and not is_loopback(args.host) and not args.allow_unauthenticated:
        print(f"rayspec serve: error: --host {args.host} is reachable from the network: set an API key (--api-key "
              f"or RAYSPEC_API_KEY), or pass --allow-unauthenticated to serve anyone who reaches it", file=sys.stderr)
        return EXIT_USAGE
    for key, value in (("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0"), ("RAY_AUTH_MODE", "disabled"),
                       ("RAY_USAGE_STATS_ENABLED", "0")):
        os.environ.setdefault(key, value)
    from actors.serve_app import serve_forever

    decoding = {k: getattr(args, k) for k in decode_option_names()}
    return serve_forever({**decoding, "target": args.target, "draft": args.draft, "compute_type": args.compute_type,
                          "encoder_dtype": args.encoder_dtype, "max_batch_size": args.max_batch_size,
                          "num_replicas": args.replicas,
                          "num_cpus": args.replica_cpus, "num_gpus": args.replica_gpus, "threads": args.threads,
                          "device": args.device, "max_queued": args.max_queued, "body_timeout_s": args.body_timeout,
                          "tts": args.tts, "tts_target": args.tts_target, "tts_draft": args.tts_draft,
                          "tts_method": args.tts_method, "tts_theta": args.tts_theta, "tts_cpus": args.tts_cpus,
                          "chat": args.chat, "chat_lm": args.chat_lm, "chat_tts": args.chat_tts,
                          "chat_cpus": args.chat_cpus, "chat_llm_backend": args.chat_llm_backend,
                          "chat_vllm_python": args.chat_vllm_python, "api_key": args.api_key,
                          "allowed_origins": args.allowed_origins},
                         args.host, args.port, args.request_timeout, args.address)


def _serve_parser(sub) -> None:
    p = sub.add_parser(
        "serve", help="OpenAI-compatible transcription endpoint on Ray Serve",
        description="POST /v1/audio/transcriptions (multipart file, model, "
                    "response_format=json|text|srt|vtt|verbose_json, timestamp_granularities[]=segment|word with "
                    "--timestamps), "
                    "GET /v1/models and GET /health. Requests share target passes: continuous batching (a request "
                    "joins the running decode as a slot frees), every method. "
                    "Long audio is segmented. Errors are JSON {\"error\": {message, type, code}}: 400 bad input, "
                    "404 unknown model, 408 slow upload, 413 over 25 MB (checked before reading the body), "
                    "415 undecodable audio, 503 + Retry-After when --max-queued requests wait. With an API key, "
                    "every route but /health and the chat page needs Authorization: Bearer <key> (401 otherwise); "
                    "a --host other than loopback needs a key or --allow-unauthenticated.",
        epilog="example:\n  rayspec serve --method draft &\n  curl -F file=@clip.flac "
               "http://127.0.0.1:8000/v1/audio/transcriptions",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1); another than loopback needs --api-key or "
                        "--allow-unauthenticated")
    p.add_argument("--port", type=int, default=8000)
    a = p.add_argument_group("access")
    a.add_argument("--api-key", default=os.environ.get("RAYSPEC_API_KEY") or None,
                   help="bearer token every request but GET /health must send (Authorization: Bearer <key>); "
                        "default: the RAYSPEC_API_KEY environment variable, which keeps it out of the process list")
    a.add_argument("--allow-unauthenticated", action="store_true",
                   help="serve a non-loopback --host without an API key (anyone who reaches the port)")
    a.add_argument("--allowed-origins", default="",
                   help="comma-separated browser origins allowed cross-origin (CORS), e.g. https://app.example; "
                        "default none")
    p.add_argument("--address", help="Ray address (default: RAY_ADDRESS, else a local Ray on 127.0.0.1)")
    p.add_argument("--max-batch-size", type=int, default=16,
                   help="rows decoded together per replica: the continuous batch's slots; default 16")
    p.add_argument("--replicas", type=int, default=1)
    p.add_argument("--replica-cpus", type=float, default=1.0)
    p.add_argument("--replica-gpus", type=float, default=0.0)
    p.add_argument("--max-queued", type=int, default=256,
                   help="requests admitted per replica (decoding or waiting); 503 beyond (default 256)")
    p.add_argument("--body-timeout", type=float, default=30.0,
                   help="seconds an upload may take to arrive; 408 after (default 30)")
    t = p.add_argument_group("speech synthesis (POST /v1/audio/speech, GET /v1/audio/voices)")
    t.add_argument("--tts", action="store_true", help="also serve speech synthesis (a separate Serve deployment)")
    t.add_argument("--tts-target", help="TTS target directory (default: the bundled zoo tts-target)")
    t.add_argument("--tts-draft", help="TTS draft directory (default: the bundled zoo tts-draft)")
    t.add_argument("--tts-method", choices=["target", "sd", "ssd", "pcg"], default="pcg", help="sampling method")
    t.add_argument("--tts-theta", type=float, default=None, help="pcg group threshold (default: the zoo's)")
    t.add_argument("--tts-cpus", type=float, default=1.0, help="CPUs of the synthesis replica")
    c = p.add_argument_group("voice chat (WebSocket /v1/realtime: streamed text or audio in, reply text and audio out, "
                             "with input-time speculation; see actors/voicechat_app.py for the events)")
    c.add_argument("--chat", action="store_true", help="also serve voice chat (LLM and TTS deployments)")
    c.add_argument("--chat-lm", help="chat LLM: smollm2-135m-instruct (default), stories260K, a local causal-LM "
                                     "directory or a .gguf file")
    c.add_argument("--chat-tts", choices=["piper", "rayspec", "espeak"], default="piper",
                   help="reply voice: piper (en_US-joe-medium, default), rayspec's speculative TTS, or espeak "
                        "(needs rayspec[espeak], GPL)")
    c.add_argument("--chat-cpus", type=float, default=0.5, help="CPUs of each voice-chat replica (default 0.5)")
    c.add_argument("--chat-llm-backend", choices=["transformers", "vllm"], default="transformers",
                   help="LLM engine of the chat deployment (vllm: its own environment, scripts/setup-vllm.sh)")
    c.add_argument("--chat-vllm-python", help="the vLLM environment's interpreter (default .venv-vllm/bin/python)")
    p.add_argument("--request-timeout", type=float, default=300.0,
                   help="seconds a request may take end to end (Serve's request_timeout_s; default 300)")
    add_model_args(p)
    add_decode_args(p)
    p.set_defaults(func=cmd_serve)


def _train_parser(sub) -> None:
    p = sub.add_parser(
        "train", help="train drafters for a target (medusa, draft-decoder), small from-scratch models, TTS models",
        description="Train a Whisper-architecture model with rayspec's recipe: joint CTC-attention loss, "
                    "SpecAugment, speed perturbation 0.9/1.0/1.1, AdamW + warmup/cosine, averaging of the last "
                    "checkpoints. Resumes from --work-dir after an interruption; logs loss and dev WER per epoch "
                    "to <work-dir>/log.jsonl.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=textwrap.dedent("""\
            kinds:
              target  encoder-decoder + CTC head trained jointly (--ctc-output writes the head)
              draft   a small model with the same tokenizer, distilled from --target's greedy transcripts
              ctc     a CTC head over the frozen encoder of --target (SSD's drafter), labelled by the target's own
                      greedy transcripts; its vocabulary: characters + the target's --ctc-tokens most frequent
                      tokens (its hypothesis is re-tokenized for verification):
                      --encoder-layers (its Transformer layers, default 2; 0 = linear), --d-model (width, 256),
                      --heads (4), --ffn (1024), --ctc-tokens (4000), --epochs (20), --lr (1e-3),
                      --batch-frames (2 per encoder position), --encoder-dtype bfloat16 (a 3x faster teacher pass
                      on AVX-512 BF16)
              medusa  Medusa heads over the frozen decoder of --target, on its own greedy transcripts
                      (--medusa-heads, --medusa-block: a cross-attention block under the heads, the default
                      heads' form)
              draft-decoder  a shallow decoder (WhisperForCausalLM, --decoder-layers, default 2) over the frozen
                      encoder of --target, distilled from its output distributions (distil-whisper's assistant),
                      sharing the target's embedding (not shipped); reads --epochs, --lr, --batch-frames (2 per
                      encoder position: a 30 s window is 3,000), --device, --seed, --threads (dropout 0.1, 200
                      warm-up steps, KL weight 0.8: the recipe's own)
              tts-data    teacher speech for the TTS kinds: a Piper voice (--voice) reads --sentences sentences
                      of the given text files (.txt, .jsonl, .csv, LJSpeech's id|text metadata) into -o: phones,
                      exact phone durations and Lyra codes, in resumable shards (needs the train extra: onnx)
              tts-target  the speech-token TTS target (phones + durations -> Lyra codes), on tts-data directories
                      or on recordings (manifests; forced-aligned)
              tts-draft   the TTS draft, distilled from --target (a TTS target directory)

            TTS kinds use --epochs, --batch-frames (20 ms codec frames, e.g. 6000), --lr (1e-3), --dropout (0.15)
            and cache Lyra codes + forced alignments of recordings in --work-dir.

            example (Medusa heads for the frozen whisper-base):
              rayspec train medusa an4/train.jsonl --target whisper-base \\
                  -o runs/medusa-base --work-dir runs/medusa-base-work
            example (a TTS target taught by the Piper voice):
              rayspec train tts-data LJSpeech-1.1/metadata.csv --sentences 3000 -o runs/tts/data
              rayspec train tts-target runs/tts/data -o runs/tts/target --work-dir runs/tts/work --epochs 3
            """),
    )
    p.add_argument("kind", choices=["target", "draft", "draft-decoder", "ctc", "medusa", "tts-data", "tts-target",
                                     "tts-draft"])
    p.add_argument("manifests", nargs="+", help="training manifests (JSONL/CSV/Parquet with id, audio, text); "
                                                "tts-data: text files; tts-target/draft: also tts-data directories")
    p.add_argument("-o", "--output", required=True, help="model directory to write (tts-data: the data directory)")
    p.add_argument("--work-dir", help="checkpoints, feature cache and logs (resumable; all kinds but tts-data)")
    p.add_argument("--target", help="teacher for draft distillation / frozen encoder for ctc / frozen model for medusa")
    p.add_argument("--ctc-output", help="target only: also write the jointly trained CTC head here")
    p.add_argument("--epochs", type=int, default=None, help="passes over the data (default 60; ctc 20)")
    p.add_argument("--batch-frames", type=int, default=12000, help="padded log-mel frames per batch")
    p.add_argument("--lr", type=float, default=None, help="peak learning rate (default 1.5e-3; ctc 1e-3)")
    p.add_argument("--warmup-steps", type=int, default=300)
    p.add_argument("--ctc-weight", type=float, default=0.4)
    p.add_argument("--dropout", type=float, default=0.15, help="residual dropout (attention/activation: 2/3 of it)")
    p.add_argument("--eval-every", type=int, default=5, help="epochs between dev WER evaluations")
    p.add_argument("--eval-steps", type=int, default=0,
                   help="tts kinds: steps between dev evaluations and checkpoints inside an epoch (0: per epoch)")
    p.add_argument("--regularize-after", type=int, default=None,
                   help="steps without SpecAugment, dropout and weight decay before they switch on (leaves CTC's "
                        "blank plateau sooner; default: the recipe's, see TrainOptions)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--init", help="warm start: initialise a target/draft (or tts-target) from this model directory")
    p.add_argument("--init-ctc", help="warm start: initialise the CTC head from this directory")
    p.add_argument("--codec", help="tts kinds: Lyra v2 codec directory (default: the bundled one)")
    p.add_argument("--medusa-heads", type=int, default=4, help="medusa: number of heads K (default 4)")
    p.add_argument("--medusa-block", action="store_true",
                   help="medusa: Medusa-Block (Whisper-Medusa): the heads read a block that attends to the audio "
                        "through the target's last-layer cross-attention keys/values, started from that layer")
    for name in ("d-model", "encoder-layers", "decoder-layers", "heads", "ffn", "frame-stack"):
        p.add_argument(f"--{name}", type=int, default=None, help="architecture override")
    p.add_argument("--position-scale", type=float, default=None,
                   help="initial encoder position embeddings = Whisper's sinusoids x this (default 0.1)")
    p.add_argument("--device", default="cpu",
                   help="medusa, ctc, draft-decoder: cpu or cuda (the teacher pass batches 64 utterances on a GPU, 16 "
                        "on a CPU)")
    p.add_argument("--ctc-tokens", type=int, default=4000,
                   help="ctc: the target's most frequent text tokens in the head's vocabulary besides the characters")
    p.add_argument("--encoder-dtype", choices=["bfloat16", "float32"], default=None,
                   help="ctc: the frozen encoder's dtype in the teacher pass (default: the target's, float32)")
    p.add_argument("--voice", default="en_US-joe-medium", help="tts-data: Piper voice (packaged name or .onnx path)")
    p.add_argument("--sentences", type=int, default=None,
                   help="tts-data: read this many sentences, a seeded random sample (default: all); a re-run with a "
                        "larger number and the same --seed keeps the shards made and adds the rest")
    p.add_argument("--noise-w", type=float, default=0.0,
                   help="tts-data: the voice's duration noise (0: durations a function of the text)")
    p.add_argument("--workers", type=int, default=2, help="tts-data: processes (one voice each)")
    p.add_argument("--max-steps", type=int, default=None, help="stop after this many steps (smoke runs)")
    p.add_argument("--max-utterances", type=int, default=None, help="use only the first N utterances (smoke runs)")
    p.set_defaults(func=cmd_train)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rayspec",
        description="Batch speech recognition and synthesis with batched speculative decoding. Models are "
                    "installed names (whisper-base, whisper-tiny.en) or local directories (transformers or "
                    "CTranslate2 Whisper checkpoints); nothing is downloaded.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=EPILOG,
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser(
        "transcribe", help="transcribe a manifest or folder of audio to Parquet (in-process; see jobs.transcribe "
                           "for Ray)",
        description="Transcribe every utterance of a manifest (JSONL/CSV/Parquet with id, audio[, text]) or a "
                    "folder of audio files into one Parquet file. Utterances are sorted by length and batched under "
                    "a token budget. Re-running with the same output resumes: finished ids are skipped. A bad file "
                    f"becomes a row with 'error' set; the exit status is then {EXIT_SOME_FAILED}.",
    )
    p.add_argument("input", help="manifest file (JSONL/CSV/Parquet; a Parquet 'audio' column may hold the files' "
                                  "bytes), folder of audio or of Parquet shards, or one audio file")
    p.add_argument("-o", "--output", required=True, help="results .parquet file")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    add_model_args(p)
    add_decode_args(p)
    p.set_defaults(func=cmd_transcribe)

    p = sub.add_parser("score", help="WER/CER of a results file per corpus",
                       description="WER and CER after Whisper's English normalizer, per corpus and overall, with "
                                   "RTFx and target passes (NFE) per utterance.")
    p.add_argument("results", help="results .parquet file (or shard folder)")
    p.add_argument("--json", action="store_true", help="print one JSON object (wer, cer, n, errors, ...) instead")
    p.add_argument("--raw", action="store_true",
                   help="fold only case and white space, no normalizer: spelled-out numbers stay words (how "
                        "ESPnet scores AN4: \"TWO EIGHTY NINE\" is three words, not \"289\")")
    p.set_defaults(func=cmd_score)

    p = sub.add_parser("convert", help="CTranslate2 (faster-whisper) Whisper -> transformers directory",
                       description="Write a CTranslate2 / faster-whisper Whisper directory (or an installed model "
                                   "name) as a transformers save_pretrained directory: float32 safetensors, config, "
                                   "tokenizer, feature extractor, generation config (prompt ids, suppress tokens, "
                                   "alignment heads, language ids). rayspec converts on load by itself (cached); "
                                   "this is for other tools (transformers' generate, vLLM).",
                       epilog="example:\n  rayspec convert ~/faster-whisper-base whisper-base-hf\n"
                              "  rayspec convert whisper-tiny.en whisper-tiny.en-hf",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("source", help="CTranslate2 model directory, or an installed model name (whisper-base, ...)")
    p.add_argument("output", help="output directory: new, empty, or an earlier conversion (replaced)")
    p.set_defaults(func=cmd_convert)

    _export_parser(sub)
    _synthesize_parser(sub)
    _train_parser(sub)
    _serve_parser(sub)
    from .bench.cli import add_bench_parser
    from .chat.commands import add_chat_parsers
    from .corpora import add_data_parser

    add_chat_parsers(sub)
    add_data_parser(sub)

    add_bench_parser(sub)
    return parser


FAST_EXIT = (cmd_transcribe,)
"""Commands whose process ends without the interpreter's teardown once the command has returned (see :func:`main`):
those whose files are all written and closed by then."""


def _exit_when_done(status: list) -> None:
    """At exit, after every other exit handler: flush stdout and stderr and end the process with ``status[0]``
    without the interpreter's teardown (nothing to do when ``status`` is empty: an ordinary exit)."""
    if status:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(status[0])


def main(argv=None) -> int:
    """Run the command line ``argv`` (default: the process's arguments); returns the exit status.

    Run as the process's own command line (``argv`` None: the ``rayspec`` script, ``python -m rayspec.cli``), a
    :data:`FAST_EXIT` command that returns ends the process without the interpreter's teardown: the exit handlers
    run (non-daemon threads joined, ``atexit`` functions), then stdout and stderr are flushed and ``os._exit`` ends
    it. Tearing down PyTorch's modules takes ~0.45 s here (2-core Xeon: ``python -c "import torch"`` 2.08 s against
    1.57 s ending with ``os._exit``, median of 6), a tenth of a one-clip ``rayspec transcribe``.
    """
    status: list = []
    if argv is None:
        import atexit

        atexit.register(_exit_when_done, status)  # registered first, so it runs after every other exit handler
    # no "Loading weights" bars where transformers loads a model (rayspec shows its own progress); set before any
    # import of transformers, whose import alone costs 1-2 s that a default run does not pay
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    args = build_parser().parse_args(argv)
    code = run_command(args.func, args)
    if args.func in FAST_EXIT:
        status.append(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
