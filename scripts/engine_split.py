"""Where an offline run's time goes, rayspec against CTranslate2 and vLLM on the same weights: log-mel, encoder,
decoder.

A profile for the peers table's goals: every engine runs one 30 s encoder window per clip, so the encoder's time sets
how far ahead any decoder can put an engine. Each engine runs the same clips in batches of each size, timing the
three stages apart (rayspec: ``WhisperASR.features`` / ``encode`` / ``greedy_decode``, whose decoder time includes
the cross-attention keys/values; CTranslate2: transformers' ``WhisperFeatureExtractor``, ``Whisper.encode`` and
``Whisper.generate`` on the encoded windows, greedy as in the peers suite; vLLM: see :func:`_vllm`), after a warm-up
batch, each engine in a fresh process with the same number of threads, rounds alternating between the engines; the
faster round of each (engine, batch size) is kept.

    python scripts/engine_split.py ../shared/data/ljspeech/clips.jsonl --limit 40 --threads 2 --rounds 2 \\
        -o bench/peers-packed
"""

from __future__ import annotations

import argparse
import os
import time

ENGINES = ("rayspec", "ctranslate2", "ctranslate2@int8", "vllm")


def _rayspec(model: str):
    """A runner: a batch of waveforms -> ``(features s, encoder s, decoder s)`` and the tokens generated, on
    rayspec's engine (float32)."""
    import torch

    from rayspec.decoding.ar import greedy_decode
    from rayspec.models.registry import resolve_model
    from rayspec.models.whisper import WhisperASR

    m = WhisperASR.from_pretrained(resolve_model(model)).pack_for_inference()

    @torch.inference_mode()
    def run(part):
        t0 = time.perf_counter()
        feats, lengths = m.features(part)
        t1 = time.perf_counter()
        enc = m.encode(feats, lengths)
        t2 = time.perf_counter()
        hyps = greedy_decode(m, enc, [200] * len(part))
        return (t1 - t0, t2 - t1, time.perf_counter() - t2), [len(h.tokens) for h in hyps]

    return run


def _ctranslate2(model: str, compute_type: str, threads: int):
    """The same runner on CTranslate2 (the model's CTranslate2 folder, in ``compute_type``)."""
    import tempfile

    import ctranslate2
    from transformers import AutoTokenizer, GenerationConfig, WhisperFeatureExtractor

    from rayspec.bench.peers import peer_ct2_folder
    from rayspec.models.registry import resolve_model

    hf = resolve_model(model)
    ct2 = peer_ct2_folder(model, os.path.join(tempfile.gettempdir(), "rayspec-peers"))
    w = ctranslate2.models.Whisper(ct2, device="cpu", compute_type=compute_type, intra_threads=threads)
    fe = WhisperFeatureExtractor.from_pretrained(hf)
    tok = AutoTokenizer.from_pretrained(hf)
    prompt = tok.convert_tokens_to_ids(["<|startoftranscript|>", "<|en|>", "<|transcribe|>", "<|notimestamps|>"]
                                       if GenerationConfig.from_pretrained(hf).is_multilingual
                                       else ["<|startoftranscript|>", "<|notimestamps|>"])

    def run(part):
        t0 = time.perf_counter()
        feats = ctranslate2.StorageView.from_array(fe(part, sampling_rate=16000, return_tensors="np").input_features)
        t1 = time.perf_counter()
        enc = w.encode(feats)
        t2 = time.perf_counter()
        res = w.generate(enc, [prompt] * len(part), beam_size=1, max_length=448, suppress_blank=True)
        return (t1 - t0, t2 - t1, time.perf_counter() - t2), [len(r.sequences_ids[0]) for r in res]

    return run


def _vllm(model: str, args, audios) -> dict:
    """vLLM (its own environment, :func:`rayspec.bench.peers.run_engine`), whose ``generate`` does not time its
    stages apart: a run that stops after one token (log-mel, encoder and the prompt's pass) stands for its log-mel +
    encoder, the rest of a run to EOS for its decoder."""
    import tempfile

    import numpy as np

    from rayspec.bench.peers import run_engine
    from rayspec.models.registry import resolve_model

    with tempfile.TemporaryDirectory() as tmp:
        npz = os.path.join(tmp, "audio.npz")
        np.savez(npz, **{f"a{i}": a for i, a in enumerate(audios)})
        runs = [run_engine("vllm", resolve_model(model), npz, args.batch_sizes, n, args.threads, args.vllm_python)
                for n in (1, 0)]
    out = {}
    for first, full in zip(*(r["rows"] for r in runs)):
        tokens = [len(t) for t in full["tokens"]]
        out[full["batch_size"]] = ((0.0, first["decode_s"], full["decode_s"] - first["decode_s"]), tokens)
    return out


def _batched(run, audios, batch: int) -> tuple[list, list[int]]:
    run(audios[:batch])  # warm-up
    stages, tokens = [0.0, 0.0, 0.0], []
    for s in range(0, len(audios), batch):
        times, toks = run(audios[s : s + batch])
        stages = [a + b for a, b in zip(stages, times)]
        tokens += toks
    return stages, tokens


def _measure(engine: str, args) -> dict:
    """One engine over every batch size, in a process of its own."""
    import torch

    from rayspec.audio import load_audio
    from rayspec.manifest import read_manifest

    torch.set_num_threads(args.threads)
    audios = [load_audio(u.audio, 16000) for u in read_manifest(args.manifest)[: args.limit]]
    name, _, ctype = engine.partition("@")
    if name == "vllm":
        return _vllm(args.model, args, audios)
    run = _rayspec(args.model) if name == "rayspec" else _ctranslate2(args.model, ctype or "float32", args.threads)
    return {b: _batched(run, audios, b) for b in args.batch_sizes}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("manifest")
    p.add_argument("--limit", type=int, default=40)
    p.add_argument("--model", default="whisper-base")
    p.add_argument("--engines", default="rayspec,ctranslate2", help=f"comma-separated, of {', '.join(ENGINES)}")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--vllm-python", default=None, help="the vLLM environment's interpreter (default: rayspec chat's)")
    p.add_argument("-o", "--output", required=True, help="folder for engine-split.md / .csv")
    args = p.parse_args()
    engines = args.engines.split(",")
    if args.vllm_python is None:
        from rayspec.chat.commands import DEFAULT_VLLM_PYTHON

        args.vllm_python = DEFAULT_VLLM_PYTHON
    if set(engines) - set(ENGINES):
        p.error(f"unknown engine(s) {', '.join(sorted(set(engines) - set(ENGINES)))}; choose from {', '.join(ENGINES)}")

    import multiprocessing

    from rayspec.bench.tables import write_table

    best: dict = {}
    with multiprocessing.get_context("spawn").Pool(1, maxtasksperchild=1) as pool:  # a fresh process per run
        for _ in range(args.rounds):
            for engine in engines:
                for b, (stages, tokens) in pool.apply(_measure, (engine, args)).items():
                    if (engine, b) not in best or sum(stages) < sum(best[engine, b][0]):
                        best[engine, b] = (stages, tokens)
    cells = []
    for b in args.batch_sizes:
        ours = best["rayspec", b][0] if ("rayspec", b) in best else None
        for engine in engines:
            (feat, enc, dec), tokens = best[engine, b]
            total = feat + enc + dec
            cells.append([engine, b, len(tokens), f"{sum(tokens) / len(tokens):.1f}", f"{feat:.2f}", f"{enc:.2f}",
                          f"{1000 * enc / len(tokens):.0f}", f"{dec:.2f}", f"{total:.2f}", f"{100 * enc / total:.0f}%",
                          f"{total / sum(ours):.2f}x" if ours else "-",
                          f"{total / (ours[0] + ours[1]):.2f}x" if ours else "-"])
    header = ["engine", "batch", "clips", "tokens/clip", "log-mel s", "encoder s", "encoder ms/window", "decoder s",
              "total s", "encoder share", "total / rayspec total", "total / rayspec log-mel + encoder"]
    os.makedirs(args.output, exist_ok=True)
    title = (f"where the time goes: {args.model}, {args.limit} clips of {os.path.basename(args.manifest)}, "
             f"{args.threads} threads, fastest of {args.rounds} alternating rounds")
    notes = ("\n- total / rayspec total: the engine's time over rayspec's at the same batch size (rayspec's speed-up "
             "over it). total / rayspec log-mel + encoder: the most rayspec could lead the engine by with a free "
             "decoder, its float32 encoder unchanged. vLLM times "
             "no stages apart: its encoder column is a run that stops after one token (log-mel, encoder and the "
             "prompt's pass), its decoder column the rest of a run to EOS.\n")
    print(write_table(os.path.join(args.output, "engine-split"), title, header, cells, notes))


if __name__ == "__main__":
    main()
