"""``rayspec bench --suite peers``: rayspec's engine against vLLM and transformers on the same Whisper weights.

Each engine runs in its own process (vLLM in its own environment, ``scripts/setup-vllm.sh``) on the same waveforms,
with the same thread count, on the published ``*.en`` architectures with random weights
(:mod:`rayspec.models.stock_whisper`). Every engine is forced to the same number of output tokens per utterance
(EOS banned: vLLM's ``ignore_eos``, transformers' ``min_new_tokens``, rayspec's
:meth:`~rayspec.models.whisper.WhisperASR.set_ignore_eos`), so accuracy does not matter and the work is equal; the
tokens themselves are compared with rayspec's (all three run greedy in float32, so they should agree). Timed: log-mel
features + encoder + decoder over all utterances after a warm-up batch; start-up (process start to model ready) and
peak resident memory of the engine's process are reported beside.

Engine workers: :mod:`rayspec.peers.engine_worker` (rayspec, transformers) and :mod:`rayspec.peers.vllm_asr_worker`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from importlib import resources

import numpy as np
from tqdm import tqdm

from .bench import write_table

ENGINES = ("rayspec", "transformers", "vllm")


@dataclass
class PeerRow:
    model: str
    engine: str
    version: str
    batch_size: int
    utterances: int
    tokens: int  # generated tokens over all utterances
    audio_s: float
    decode_s: float
    startup_s: float
    peak_rss_mb: float
    same_tokens: int  # utterances whose tokens equal rayspec's

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.decode_s

    @property
    def rtfx(self) -> float:
        return self.audio_s / self.decode_s


def run_engine(engine: str, model_dir: str, audio_npz: str, batch_sizes, tokens: int, threads: int,
               vllm_python: str) -> dict:
    """Run one engine's worker process; returns its JSON report.

    Raises:
        RuntimeError: the worker failed (its last stderr lines are in the message).
    """
    sizes = ",".join(str(b) for b in batch_sizes)
    common = ["--model", model_dir, "--audio", audio_npz, "--batch-sizes", sizes, "--tokens", str(tokens)]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false"}
    if engine == "vllm":
        worker = os.path.join(os.path.dirname(__file__), "peers", "vllm_asr_worker.py")
        cmd = [vllm_python, worker, *common]
        env.update(VLLM_CPU_OMP_THREADS_BIND=f"0-{threads - 1}" if threads > 1 else "0",
                   VLLM_CPU_KVCACHE_SPACE=env.get("VLLM_CPU_KVCACHE_SPACE", "2"))
    else:
        cmd = [sys.executable, "-m", "rayspec.peers.engine_worker", "--engine", engine, "--threads", str(threads),
               *common]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = "\n".join(proc.stderr.strip().splitlines()[-15:])
        raise RuntimeError(f"{engine} worker failed (exit {proc.returncode}): {' '.join(cmd)}\n{tail}")
    return json.loads(lines[-1])


def run_peers(model_names, audios: list[np.ndarray], batch_sizes, tokens: int, threads: int, vllm_python: str,
              models_dir: str, engines=ENGINES, progress: bool = True) -> list[PeerRow]:
    """All rows of the suite: every engine on every model at every batch size, same waveforms (16 kHz)."""
    from .models.stock_whisper import random_whisper

    tiktoken_path = str(resources.files("rayspec") / "data" / "gpt2.tiktoken")
    audio_s = sum(len(a) for a in audios) / 16000
    rows: list[PeerRow] = []
    outputs: dict[tuple, list] = {}
    with tempfile.TemporaryDirectory() as tmp:
        npz = os.path.join(tmp, "audio.npz")
        np.savez(npz, **{f"a{i}": a.astype(np.float32) for i, a in enumerate(audios)})
        jobs = [(m, e) for m in model_names for e in engines]
        for name, engine in tqdm(jobs, desc="peers", disable=not progress):
            model_dir = random_whisper(name, os.path.join(models_dir, name), tiktoken_path)
            rep = run_engine(engine, model_dir, npz, batch_sizes, tokens, threads, vllm_python)
            for r in rep["rows"]:
                outputs[name, engine, r["batch_size"]] = r["tokens"]
                rows.append(PeerRow(name, engine, rep["version"], r["batch_size"], len(audios),
                                    sum(len(t) for t in r["tokens"]), audio_s, r["decode_s"], rep["startup_s"],
                                    rep["peak_rss_mb"], 0))
    for r in rows:
        ref = outputs.get((r.model, "rayspec", batch_sizes[0]))
        mine = outputs[r.model, r.engine, r.batch_size]
        r.same_tokens = sum(a == b for a, b in zip(mine, ref)) if ref else 0
    return rows


def write_peer_outputs(rows: list[PeerRow], out_dir: str, title: str, notes: str = "") -> str:
    """``bench-peers.md`` / ``.csv`` / ``.png`` (tokens/s against batch size, one line per engine and model)."""
    os.makedirs(out_dir, exist_ok=True)
    header = ["model", "engine", "batch", "utterances", "tokens/utt", "decode s", "tokens/s", "RTFx",
              "rayspec / engine", "start-up s", "peak RSS MB", "tokens = rayspec"]
    cells = []
    for r in rows:
        ours = next((x for x in rows if x.model == r.model and x.engine == "rayspec" and x.batch_size == r.batch_size),
                    None)
        cells.append([r.model, f"{r.engine} {r.version}", r.batch_size, r.utterances, f"{r.tokens / r.utterances:g}",
                      f"{r.decode_s:.2f}", f"{r.tokens_per_s:.1f}", f"{r.rtfx:.1f}",
                      f"{ours.tokens_per_s / r.tokens_per_s:.2f}x" if ours else "-", f"{r.startup_s:.1f}",
                      f"{r.peak_rss_mb:.0f}", f"{r.same_tokens}/{r.utterances}"])
    stem = os.path.join(out_dir, "bench-peers")
    text = write_table(stem, title, header, cells, notes)
    _plot(rows, stem + ".png", title)
    return text


def _plot(rows: list[PeerRow], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r.model for r in rows))
    fig, axes = plt.subplots(1, len(models), figsize=(4.5 * len(models), 3.8), squeeze=False)
    for ax, model in zip(axes[0], models):
        for engine in dict.fromkeys(r.engine for r in rows):
            pts = sorted((r.batch_size, r.tokens_per_s) for r in rows if r.model == model and r.engine == engine)
            if pts:
                ax.plot(*zip(*pts), marker="o", label=engine)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch size")
        ax.set_ylabel("generated tokens / s")
        ax.set_title(model, fontsize=9)
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def cmd_bench_peers(args) -> int:
    """The ``peers`` suite of ``rayspec bench``."""
    import platform

    from .audio import load_audio
    from .manifest import read_manifest

    if args.manifests:
        utts = [u for m in args.manifests for u in read_manifest(m)]
    else:
        folder = resources.files("rayspec") / "samples" / "an4"
        utts = read_manifest(str(folder))
    utts = utts[: args.limit or 64]
    audios = [load_audio(u.audio, 16000) for u in tqdm(utts, desc="audio")]
    engines = [e for e in args.engines.split(",") if e]
    unknown = set(engines) - set(ENGINES)
    if unknown:
        raise ValueError(f"unknown engine(s) {', '.join(sorted(unknown))}; choose from {', '.join(ENGINES)}")
    if "vllm" in engines and not os.path.exists(args.vllm_python):
        raise FileNotFoundError(f"no vLLM interpreter at {args.vllm_python}: run scripts/setup-vllm.sh first, or "
                                f"pass --engines rayspec,transformers")
    threads = args.threads or 1
    rows = run_peers(args.peer_models.split(","), audios, tuple(args.batch_sizes), args.tokens, threads,
                     args.vllm_python, args.models_dir, engines)
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")),
               platform.processor()) if os.path.exists("/proc/cpuinfo") else platform.processor()
    title = (f"peers: {len(audios)} utterances ({sum(len(a) for a in audios) / 16000:.0f} s audio), "
             f"{args.tokens} tokens each, float32, {threads} thread(s), {cpu}")
    notes = ("\n- Random weights in the published configurations; every engine generates exactly the same number of "
             "tokens per utterance (EOS banned). Timed: features + encoder + decoder after a warm-up batch. "
             "rayspec / engine: rayspec's tokens/s over the engine's at the same batch size. "
             "tokens = rayspec: utterances whose tokens equal rayspec's at batch " f"{args.batch_sizes[0]}.\n")
    print(write_peer_outputs(rows, args.output, title, notes))
    return 0
