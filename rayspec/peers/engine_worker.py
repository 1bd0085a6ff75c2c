"""rayspec's and transformers' side of the peer benchmark, run as ``python -m rayspec.peers.engine_worker``.

It loads a Whisper directory with one engine, warms it up on one batch, then greedy-decodes every waveform of
``--audio`` (a ``.npz`` of float32 16 kHz arrays ``a0, a1, ...``) at each batch size, in consecutive batches, and
prints one JSON line (the protocol of :mod:`rayspec.peers.vllm_asr_worker`):
``{"engine", "version", "startup_s", "rows": [{"batch_size", "decode_s", "tokens": [[ids]...]}], "peak_rss_mb"}``.
``decode_s`` covers log-mel features, encoder and decoder. With ``--tokens N`` every utterance generates exactly N
tokens (EOS banned), else up to ``--max-tokens``.

Engines (``--engine NAME[:METHOD][@COMPUTE_TYPE]``):
    rayspec: :meth:`WhisperASR.encode` + :func:`~rayspec.decoding.ar.greedy_decode` (the verify loop without a
        proposer, as ``rayspec transcribe --method ar`` runs); on a named model (``--model whisper-base``) a
        :class:`~rayspec.pipeline.Transcriber` with ``METHOD`` (default ar, its bundled drafter) and
        ``@bfloat16`` for a bfloat16 encoder.
    transformers: the model's feature extractor + ``WhisperForConditionalGeneration.generate`` on the batch (what
        the ASR pipeline runs), greedy.
    faster-whisper (named models, ``--ct2 DIR``): ``WhisperModel.transcribe`` file by file (greedy, no timestamps,
        no VAD, no conditioning on earlier text), compute type ``@float32`` (default) or ``@int8``;
        faster-whisper-batched: its ``BatchedInferencePipeline`` (VAD segments of one file batched together).
    ctranslate2 (named models, ``--ct2 DIR``): ``models.Whisper.generate`` on batches across files (log-mel from
        transformers' feature extractor), ``@float32`` or ``@int8``.
Named-model rows carry ``texts`` (for WER) beside ``tokens``.
"""

from __future__ import annotations

import time

T_START = time.perf_counter()

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import resource  # noqa: E402
import sys  # noqa: E402


def _batches(n: int, size: int) -> list[range]:
    return [range(s, min(n, s + size)) for s in range(0, n, size)]


def run_rayspec(model_dir: str, audios, batch_sizes, tokens: int, max_tokens: int) -> tuple[str, float, list]:
    import torch

    from .. import __version__
    from ..decoding.ar import greedy_decode
    from ..models.whisper import WhisperASR

    model = WhisperASR.from_pretrained(model_dir).pack_for_inference()
    model.set_ignore_eos(bool(tokens))
    startup = time.perf_counter() - T_START
    cap = tokens or max_tokens

    @torch.inference_mode()
    def decode(idx):
        feats, lengths = model.features([audios[i] for i in idx])
        return [h.tokens for h in greedy_decode(model, model.encode(feats, lengths), [cap] * len(idx))]

    return __version__, startup, _timed(decode, len(audios), batch_sizes)


def run_transformers(model_dir: str, audios, batch_sizes, tokens: int, max_tokens: int) -> tuple[str, float, list]:
    import torch
    import transformers
    from transformers import AutoTokenizer, WhisperFeatureExtractor, WhisperForConditionalGeneration

    model = WhisperForConditionalGeneration.from_pretrained(model_dir).eval()
    fe = WhisperFeatureExtractor.from_pretrained(model_dir)
    tok = AutoTokenizer.from_pretrained(model_dir)
    startup = time.perf_counter() - T_START
    n = tokens or max_tokens
    limits = dict(min_new_tokens=n, max_new_tokens=n) if tokens else dict(max_new_tokens=n)
    if getattr(model.generation_config, "is_multilingual", False):
        limits.update(language="en", task="transcribe")  # as every other engine (no per-clip language detection)
    eos = model.generation_config.eos_token_id

    def decode(idx):
        feats = fe([audios[i] for i in idx], sampling_rate=fe.sampling_rate, return_tensors="pt").input_features
        with torch.inference_mode():
            out = model.generate(feats, do_sample=False, num_beams=1, **limits)
        rows = [r[: r.index(eos)] if eos in r and not tokens else r for r in out.tolist()]
        return [(r, tok.decode(r, skip_special_tokens=True)) for r in rows]

    return transformers.__version__, startup, _timed(decode, len(audios), batch_sizes)


def run_named_rayspec(name: str, method: str, compute_type: str, audios, batch_sizes) -> tuple[str, float, list]:
    import torch

    from .. import __version__
    from ..methods import DecodeOptions
    from ..pipeline import Transcriber

    t = Transcriber(name, options=DecodeOptions(method or "ar"),
                    encoder_dtype=getattr(torch, compute_type) if compute_type else None)
    startup = time.perf_counter() - T_START

    def decode(idx):
        hyps, _ = t.decode([audios[i] for i in idx], [len(audios[i]) / 16000 for i in idx])
        return [(h.tokens, t.target.tokenizer.decode(h.tokens, skip_special_tokens=True)) for h in hyps]

    return __version__, startup, _timed(decode, len(audios), batch_sizes)


def faster_whisper_greedy(ct2_dir: str, compute_type: str, threads: int, batched: bool):
    """faster-whisper loaded as the peer benchmarks run it: ``(version, transcribe)``, ``transcribe(audio,
    batch_size)`` -> the segments of one file (a path or a 16 kHz array): greedy, temperature 0 only, no timestamps,
    no conditioning on earlier text; ``WhisperModel.transcribe`` without VAD, or with ``batched`` its
    ``BatchedInferencePipeline`` at ``batch_size``."""
    from ..extras import require

    faster_whisper = require("faster_whisper", "peers", "the faster-whisper peer")
    model = faster_whisper.WhisperModel(ct2_dir, device="cpu", compute_type=compute_type or "float32",
                                        cpu_threads=threads)
    pipe = faster_whisper.BatchedInferencePipeline(model) if batched else None
    opts = dict(language="en" if model.model.is_multilingual else None, beam_size=1, temperature=0.0,
                without_timestamps=True, condition_on_previous_text=False)

    def transcribe(audio, batch_size: int) -> list:
        if pipe is not None:
            return list(pipe.transcribe(audio, batch_size=batch_size, **opts)[0])
        return list(model.transcribe(audio, vad_filter=False, **opts)[0])

    return faster_whisper.__version__, transcribe


def run_faster_whisper(ct2_dir: str, batched: bool, compute_type: str, audios, batch_sizes,
                       threads: int) -> tuple[str, float, list]:
    version, transcribe = faster_whisper_greedy(ct2_dir, compute_type, threads, batched)
    startup = time.perf_counter() - T_START

    def decode(idx, bs):
        out = []
        for i in idx:
            segs = transcribe(audios[i], bs)
            out.append(([t for s in segs for t in s.tokens], "".join(s.text for s in segs)))
        return out

    return version, startup, _timed(decode, len(audios), batch_sizes, per_file=True)


def run_ctranslate2(ct2_dir: str, hf_dir: str, compute_type: str, audios, batch_sizes,
                    threads: int) -> tuple[str, float, list]:
    from transformers import AutoTokenizer, GenerationConfig, WhisperFeatureExtractor

    from ..extras import require

    ctranslate2 = require("ctranslate2", "peers", "the CTranslate2 peer")
    model = ctranslate2.models.Whisper(ct2_dir, device="cpu", compute_type=compute_type or "float32",
                                       intra_threads=threads)
    fe = WhisperFeatureExtractor.from_pretrained(hf_dir)
    tok = AutoTokenizer.from_pretrained(hf_dir)
    gen = GenerationConfig.from_pretrained(hf_dir)
    prompt = tok.convert_tokens_to_ids(["<|startoftranscript|>", "<|en|>", "<|transcribe|>", "<|notimestamps|>"]
                                       if gen.is_multilingual else ["<|startoftranscript|>", "<|notimestamps|>"])
    startup = time.perf_counter() - T_START

    def decode(idx):
        feats = fe([audios[i] for i in idx], sampling_rate=16000, return_tensors="np").input_features
        res = model.generate(ctranslate2.StorageView.from_array(feats), [prompt] * len(idx), beam_size=1,
                             max_length=448, suppress_blank=True)
        return [(r.sequences_ids[0], tok.decode(r.sequences_ids[0], skip_special_tokens=True)) for r in res]

    return ctranslate2.__version__, startup, _timed(decode, len(audios), batch_sizes)


def _timed(decode, n: int, batch_sizes, per_file: bool = False) -> list[dict]:
    """A warm-up, then every batch size timed over all ``n`` waveforms. ``decode(indices)`` gets consecutive batches;
    with ``per_file`` (an engine that batches within a file) ``decode(indices, batch_size)`` gets them all. It
    returns token lists, or ``(tokens, text)`` pairs."""
    call = decode if per_file else (lambda idx, bs: decode(idx))
    call(range(1) if per_file else range(min(n, max(batch_sizes))), max(batch_sizes))  # warm-up
    rows = []
    for bs in batch_sizes:
        t0 = time.perf_counter()
        out = [t for idx in ([range(n)] if per_file else _batches(n, bs)) for t in call(idx, bs)]
        row = {"batch_size": bs, "decode_s": time.perf_counter() - t0}
        if out and isinstance(out[0], tuple):
            row["tokens"], row["texts"] = [o[0] for o in out], [o[1] for o in out]
        else:
            row["tokens"] = out
        rows.append(row)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", required=True, help="NAME[:METHOD][@COMPUTE_TYPE], see above")
    p.add_argument("--model", required=True, help="Whisper model directory, or a model name (real weights)")
    p.add_argument("--ct2", help="the named model's CTranslate2 folder (faster-whisper, ctranslate2)")
    p.add_argument("--audio", required=True, help=".npz of float32 16 kHz waveforms a0, a1, ...")
    p.add_argument("--batch-sizes", default="1,16")
    p.add_argument("--tokens", type=int, default=0, help="exact tokens per utterance (0: stop at EOS)")
    p.add_argument("--max-tokens", type=int, default=200)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    import numpy as np
    import torch

    torch.set_num_threads(args.threads)
    with np.load(args.audio) as z:
        audios = [z[f"a{i}"] for i in range(len(z.files))]
    from ..models.registry import resolve_model

    sizes = [int(b) for b in args.batch_sizes.split(",")]
    name, _, ctype = args.engine.partition("@")
    name, _, method = name.partition(":")
    if name == "rayspec" and (method or ctype) and os.path.isdir(args.model):
        p.error("rayspec:METHOD and rayspec@COMPUTE_TYPE run on installed models (a name), not random weights")
    if name == "rayspec" and not os.path.isdir(args.model):
        version, startup, rows = run_named_rayspec(args.model, method, ctype, audios, sizes)
    elif name in ("rayspec", "transformers"):
        run = run_rayspec if name == "rayspec" else run_transformers
        version, startup, rows = run(resolve_model(args.model), audios, sizes, args.tokens, args.max_tokens)
    elif name in ("faster-whisper", "faster-whisper-batched"):
        batched = name.endswith("batched")  # file by file: batch 1; the batched pipeline: the sizes above 1
        sizes = [b for b in sizes if b > 1] or sizes if batched else [1]
        version, startup, rows = run_faster_whisper(args.ct2, batched, ctype, audios, sizes, args.threads)
    elif name == "ctranslate2":
        version, startup, rows = run_ctranslate2(args.ct2, resolve_model(args.model), ctype, audios, sizes,
                                                 args.threads)
    else:
        p.error(f"unknown engine {args.engine!r}")
    print(json.dumps({"engine": args.engine, "version": version, "startup_s": startup, "rows": rows,
                      "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
