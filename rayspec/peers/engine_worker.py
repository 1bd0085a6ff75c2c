"""rayspec's and transformers' side of the peer benchmark, run as ``python -m rayspec.peers.engine_worker``.

It loads a Whisper directory with one engine, warms it up on one batch, then greedy-decodes every waveform of
``--audio`` (a ``.npz`` of float32 16 kHz arrays ``a0, a1, ...``) at each batch size, in consecutive batches, and
prints one JSON line (the protocol of :mod:`rayspec.peers.vllm_asr_worker`):
``{"engine", "version", "startup_s", "rows": [{"batch_size", "decode_s", "tokens": [[ids]...]}], "peak_rss_mb"}``.
``decode_s`` covers log-mel features, encoder and decoder. With ``--tokens N`` every utterance generates exactly N
tokens (EOS banned), else up to ``--max-tokens``.

Engines:
    rayspec: :meth:`WhisperASR.encode` + :func:`~rayspec.decoding.ar.greedy_decode` (the verify loop without a
        proposer, as ``rayspec transcribe --method ar`` runs).
    transformers: the model's feature extractor + ``WhisperForConditionalGeneration.generate`` on the batch (what
        the ASR pipeline runs), greedy.
"""

from __future__ import annotations

import time

T_START = time.perf_counter()

import argparse  # noqa: E402
import json  # noqa: E402
import resource  # noqa: E402
import sys  # noqa: E402


def _batches(n: int, size: int) -> list[range]:
    return [range(s, min(n, s + size)) for s in range(0, n, size)]


def run_rayspec(model_dir: str, audios, batch_sizes, tokens: int, max_tokens: int) -> tuple[str, float, list]:
    import torch

    from .. import __version__
    from ..decoding.ar import greedy_decode
    from ..models.whisper import WhisperASR

    model = WhisperASR.from_pretrained(model_dir)
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
    from transformers import WhisperFeatureExtractor, WhisperForConditionalGeneration

    model = WhisperForConditionalGeneration.from_pretrained(model_dir).eval()
    fe = WhisperFeatureExtractor.from_pretrained(model_dir)
    startup = time.perf_counter() - T_START
    n = tokens or max_tokens
    limits = dict(min_new_tokens=n, max_new_tokens=n) if tokens else dict(max_new_tokens=n)
    eos = model.generation_config.eos_token_id

    def decode(idx):
        feats = fe([audios[i] for i in idx], sampling_rate=fe.sampling_rate, return_tensors="pt").input_features
        with torch.inference_mode():
            out = model.generate(feats, do_sample=False, num_beams=1, **limits)
        rows = out.tolist()
        return [r[: r.index(eos)] if eos in r and not tokens else r for r in rows]

    return transformers.__version__, startup, _timed(decode, len(audios), batch_sizes)


def _timed(decode, n: int, batch_sizes) -> list[dict]:
    decode(range(min(n, max(batch_sizes))))  # warm-up: one batch of the largest size
    rows = []
    for bs in batch_sizes:
        t0 = time.perf_counter()
        toks = [t for idx in _batches(n, bs) for t in decode(idx)]
        rows.append({"batch_size": bs, "decode_s": time.perf_counter() - t0, "tokens": toks})
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", choices=("rayspec", "transformers"), required=True)
    p.add_argument("--model", required=True, help="Whisper model directory")
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
    run = run_rayspec if args.engine == "rayspec" else run_transformers
    version, startup, rows = run(args.model, audios, [int(b) for b in args.batch_sizes.split(",")], args.tokens,
                                 args.max_tokens)
    print(json.dumps({"engine": args.engine, "version": version, "startup_s": startup, "rows": rows,
                      "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
