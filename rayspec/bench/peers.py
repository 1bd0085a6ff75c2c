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

import functools
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from importlib import resources
from typing import Optional

import numpy as np
from tqdm import tqdm

from ..files import write_atomic
from .tables import write_table

RANDOM_ENGINES = ("rayspec", "transformers", "vllm")
"""The engines of a random-weights model (a published architecture, forced token counts)."""
ENGINES = RANDOM_ENGINES + ("faster-whisper", "faster-whisper-batched", "ctranslate2")
"""Engine names; a spec may add ``:METHOD`` (rayspec) and ``@COMPUTE_TYPE`` (see :mod:`rayspec.peers.engine_worker`).
faster-whisper and ctranslate2 run on named models only (the original CTranslate2 files); vLLM runs random-weights
models and named ones (their converted transformers directory)."""


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
    texts: Optional[list] = None  # named models: the transcripts, for WER
    wer: Optional[float] = None  # percent, Whisper's normalizer
    cer_nospace: Optional[float] = None  # percent, spaces and hyphens removed

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.decode_s

    @property
    def rtfx(self) -> float:
        return self.audio_s / self.decode_s


def run_engine(engine: str, model_dir: str, audio_npz: str, batch_sizes, tokens: int, threads: int,
               vllm_python: str, vllm_eager: bool = False, ct2_dir: Optional[str] = None) -> dict:
    """Run one engine's worker process; returns its JSON report. ``vllm_eager``: vLLM without its graph compilation
    (a faster start for smoke tests; benchmarks keep vLLM's default).

    Raises:
        RuntimeError: the worker failed (its last stderr lines are in the message).
    """
    sizes = ",".join(str(b) for b in batch_sizes)
    common = ["--model", model_dir, "--audio", audio_npz, "--batch-sizes", sizes, "--tokens", str(tokens)]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false"}
    if engine == "vllm":
        worker = os.path.join(os.path.dirname(os.path.dirname(__file__)), "peers", "vllm_asr_worker.py")
        cmd = [vllm_python, worker, *common] + (["--enforce-eager"] if vllm_eager else [])
        env.update(VLLM_CPU_OMP_THREADS_BIND=f"0-{threads - 1}" if threads > 1 else "0",
                   VLLM_CPU_KVCACHE_SPACE=env.get("VLLM_CPU_KVCACHE_SPACE", "4"))  # GiB; base.en at 64 sequences needs > 2
    else:
        cmd = [sys.executable, "-m", "rayspec.peers.engine_worker", "--engine", engine, "--threads", str(threads),
               *common] + (["--ct2", ct2_dir] if ct2_dir else [])
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = "\n".join(proc.stderr.strip().splitlines()[-15:])
        raise RuntimeError(f"{engine} worker failed (exit {proc.returncode}): {' '.join(cmd)}\n{tail}")
    return json.loads(lines[-1])


def peer_ct2_folder(name: str, models_dir: str) -> str:
    """The installed model ``name`` as a CTranslate2 folder under ``models_dir``, where the suite keeps it
    (:func:`~rayspec.models.registry.ct2_folder`; joined once per model version)."""
    from ..models.registry import MODELS, ct2_folder

    return ct2_folder(name, os.path.join(models_dir, f"{name}-ct2-{MODELS[name].key[:12]}"))


def run_peers(model_names, audios: list[np.ndarray], batch_sizes, tokens: int, threads: int, vllm_python: str,
              models_dir: str, engines=RANDOM_ENGINES, progress: bool = True, runs_dir: Optional[str] = None,
              vllm_eager: bool = False, repeats: int = 1) -> tuple[list[PeerRow], list[str]]:
    """All rows of the suite: every engine on every model at every batch size, same waveforms (16 kHz).

    A model is a published architecture (``tiny.en``: random weights, every engine forced to ``tokens`` tokens per
    utterance) or a named installed model (``whisper-base``: real weights, decoding to EOS, rows with transcripts).

    Args:
        runs_dir: where each engine's report is kept (``<model>-<engine>-<round>.json``, written atomically); a
            re-run with the same audio and settings reuses it instead of measuring again. None: nothing kept.
        repeats: rounds over the engines (alternating); each row keeps its fastest round.

    Returns:
        ``(rows, failures)``: an engine that fails on a model is one line in ``failures``, the other rows stand.
    """
    from ..models.errors import ModelLoadError
    from ..models.registry import MODELS, resolve_model
    from ..models.stock_whisper import random_whisper

    tiktoken_path = str(resources.files("rayspec") / "data" / "gpt2.tiktoken")
    audio_s = sum(len(a) for a in audios) / 16000
    digest = hashlib.sha1(b"".join(np.ascontiguousarray(a, np.float32).tobytes() for a in audios)).hexdigest()
    rows: list[PeerRow] = []
    failures: list[str] = []
    outputs: dict[tuple, list] = {}
    with tempfile.TemporaryDirectory() as tmp:
        npz = os.path.join(tmp, "audio.npz")
        np.savez(npz, **{f"a{i}": a.astype(np.float32) for i, a in enumerate(audios)})
        jobs = [(m, e, k) for k in range(repeats) for m in model_names for e in engines]
        reports: dict[tuple, dict] = {}
        ct2_dirs: dict[str, str] = {}
        for name, engine, k in tqdm(jobs, desc="peers", disable=not progress):
            named = name in MODELS
            key = {"model": name, "engine": engine, "batch_sizes": list(batch_sizes), "tokens": 0 if named else tokens,
                   "threads": threads, "audio": digest, "vllm_eager": vllm_eager, "round": k}
            saved = os.path.join(runs_dir, f"{name}-{engine}-{k}.json") if runs_dir else None
            rep = None
            if saved and os.path.exists(saved):
                with open(saved) as f:
                    kept = json.load(f)
                rep = kept["report"] if kept.get("key") == key else None
            if rep is None:
                base = engine.partition("@")[0].partition(":")[0]
                try:
                    if not named and base not in RANDOM_ENGINES:
                        raise RuntimeError(f"{base} runs installed models only (whisper-base, whisper-tiny.en)")
                    if named:  # the CTranslate2 folder is joined and checked once per model
                        if name not in ct2_dirs:
                            ct2_dirs[name] = peer_ct2_folder(name, models_dir)
                        model, ct2 = name, ct2_dirs[name]
                    else:
                        model, ct2 = random_whisper(name, os.path.join(models_dir, name), tiktoken_path), None
                    if named and base == "vllm":  # vLLM reads the converted transformers directory
                        model = resolve_model(name)
                    rep = run_engine(engine, model, npz, batch_sizes, key["tokens"], threads, vllm_python, vllm_eager,
                                     ct2)
                except (RuntimeError, ModelLoadError) as exc:
                    failures.append(f"{name} / {engine}: {str(exc).splitlines()[-1]}")
                    continue
                if saved:
                    os.makedirs(runs_dir, exist_ok=True)
                    write_atomic(saved, json.dumps({"key": key, "report": rep}))
            best = reports.setdefault((name, engine), rep)
            for mine, r in zip(best["rows"], rep["rows"]):  # the fastest round of each batch size
                mine["decode_s"] = min(mine["decode_s"], r["decode_s"])
    for (name, engine), rep in reports.items():
        for r in rep["rows"]:
            outputs[name, engine, r["batch_size"]] = r["tokens"]
            rows.append(PeerRow(name, engine, rep["version"], r["batch_size"], len(audios),
                                sum(len(t) for t in r["tokens"]), audio_s, r["decode_s"], rep["startup_s"],
                                rep["peak_rss_mb"], 0, r.get("texts")))
    for r in rows:
        ref = outputs.get((r.model, "rayspec", batch_sizes[0]))
        mine = outputs[r.model, r.engine, r.batch_size]
        r.same_tokens = sum(a == b for a, b in zip(mine, ref)) if ref else 0
    return rows, failures


def write_peer_outputs(rows: list[PeerRow], out_dir: str, title: str, notes: str = "") -> str:
    """``bench-peers.md`` / ``.csv`` / ``.png`` (tokens/s against batch size, one line per engine and model)."""
    os.makedirs(out_dir, exist_ok=True)
    header = ["model", "engine", "batch", "utterances", "tokens/utt", "decode s", "tokens/s", "RTFx",
              "rayspec / engine", "start-up s", "peak RSS MB", "tokens = rayspec", "WER %", "space-free CER %"]
    cells = []
    for r in rows:
        ours = next((x for x in rows if x.model == r.model and x.engine == "rayspec" and x.batch_size == r.batch_size),
                    None)
        cells.append([r.model, f"{r.engine} {r.version}", r.batch_size, r.utterances, f"{r.tokens / r.utterances:.1f}",
                      f"{r.decode_s:.2f}", f"{r.tokens_per_s:.1f}", f"{r.rtfx:.1f}",
                      f"{ours.rtfx / r.rtfx:.2f}x" if ours else "-", f"{r.startup_s:.1f}",
                      f"{r.peak_rss_mb:.0f}", f"{r.same_tokens}/{r.utterances}",
                      "-" if r.wer is None else f"{r.wer:.1f}",
                      "-" if r.cer_nospace is None else f"{r.cer_nospace:.1f}"])
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


def run_serve_load(model_dir: str, paths: list[str], durations: list[float], concurrencies, threads: int,
                   vllm_python: Optional[str], max_tokens_per_second: float, log_dir: str,
                   rayspec_engines=("rayspec",), rayspec_target: Optional[str] = None) -> tuple[list, list[str]]:
    """Part 3: ``rayspec serve`` once per entry of ``rayspec_engines`` (``rayspec[:METHOD][@COMPUTE_TYPE]``) and
    (with ``vllm_python``) vLLM's OpenAI server on ``model_dir``, each loaded with the files at every concurrency in
    turn, each on a port of its own (so a server left on a shared port cannot pass another's health check); returns
    ``(results, failures)``: :class:`~rayspec.peers.serve_load.LoadResult` s, and a line per server that did not
    start. ``rayspec_target``: what rayspec serves instead of
    ``model_dir`` (an installed model's name, whose bundled drafters the methods find)."""
    from ..decoding.common import token_cap
    from ..peers.serve_load import rayspec_server, run_load, vllm_server

    files = []
    for p in paths:
        with open(p, "rb") as f:
            files.append((os.path.basename(p), f.read()))
    # rayspec's own cap: decoder positions - the 4-token task prompt (random_whisper(task_prompt=True)) - EOS
    limit = 448 - 4 - 1
    caps = [token_cap(d, max_tokens_per_second, limit) for d in durations]
    os.makedirs(log_dir, exist_ok=True)
    servers = [functools.partial(rayspec_server, rayspec_target or model_dir, 8765 + k, threads,
                                 max_tokens_per_second, os.path.join(log_dir, f"{engine.replace(':', '-')}-serve.log"),
                                 max(concurrencies), engine) for k, engine in enumerate(rayspec_engines)]
    if vllm_python:
        servers.append(lambda: vllm_server(vllm_python, model_dir, 8765 + len(rayspec_engines), threads,
                                           os.path.join(log_dir, "vllm-serve.log"), max(concurrencies)))
    results, failures = [], []
    for start in servers:
        server = start()
        try:
            try:
                server.wait_ready("/health")
            except RuntimeError as e:  # one server that does not start is one line, the others still run
                failures.append(str(e))
                continue
            fields = ((lambda i: {"max_completion_tokens": caps[i], "temperature": 0, "language": "en"})
                      if server.name == "vllm" else None)
            for c in tqdm(concurrencies, desc=f"{server.name} serve"):
                results.append(run_load(server, files, c, fields))
        finally:
            server.stop()
    return results, failures


def write_serve_outputs(results: list, out_dir: str, title: str, notes: str = "") -> str:
    """``bench-peers-serve.md`` / ``.csv``: requests/s and latency percentiles per server and concurrency."""
    header = ["server", "concurrency", "requests", "errors", "requests/s", "p50 latency ms", "p95 latency ms",
              "p50 / vllm p50", "text = rayspec"]
    cells = []
    for r in results:
        at = {x.server: x for x in results if x.concurrency == r.concurrency}
        ours, vllm = at.get("rayspec"), at.get("vllm")
        same = sum(a is not None and b is not None and a.strip() == b.strip()
                   for a, b in zip(r.texts, ours.texts)) if ours else 0
        cells.append([r.server, r.concurrency, r.requests, r.errors, f"{r.requests_per_s:.2f}",
                      f"{1000 * r.percentile(50):.0f}", f"{1000 * r.percentile(95):.0f}",
                      f"{r.percentile(50) / vllm.percentile(50):.2f}x" if vllm else "-", f"{same}/{r.requests}"])
    return write_table(os.path.join(out_dir, "bench-peers-serve"), title, header, cells, notes)


def cmd_whole_process(args, utts) -> int:
    """``--whole-process``: :mod:`rayspec.bench.process` over ``utts`` (written to a manifest of their files)."""
    from .process import FW_BATCH, cpu_description, run_processes, write_process_outputs

    manifest = os.path.join(args.output, "process-runs", "manifest.jsonl")
    os.makedirs(os.path.dirname(manifest), exist_ok=True)
    write_atomic(manifest, "".join(json.dumps({"id": u.id, "audio": u.audio, "text": u.text or "",
                                               "duration_s": u.duration_s}) + "\n" for u in utts))
    threads = args.threads or 2
    configs = [c for c in args.whole_process.split(",") if c]
    best, failures = run_processes(configs, manifest, args.output, threads,
                                   peer_ct2_folder("whisper-base", args.models_dir), args.repeats)
    audio_s = sum(u.duration_s or 0.0 for u in utts)
    title = (f"whole processes: whisper-base, {len(utts)} utterances ({audio_s:.0f} s audio), greedy, {threads} "
             f"threads, fastest of {args.repeats} alternating round(s), {cpu_description()}, "
             f"{time.strftime('%Y-%m-%d')}")
    notes = ("\n- Whole: process start to exit (interpreter, imports, model load, audio decoding from the files, "
             "transcription, writing the output), as a user waits for `rayspec transcribe` or a faster-whisper "
             "script. Start-up: whole minus the transcription time the process reports. Batch 1: file by file "
             f"(`--max-batch 1`; faster-whisper's WhisperModel.transcribe); default: rayspec's default batching, "
             f"faster-whisper's BatchedInferencePipeline at batch {FW_BATCH}. rayspec's compute type auto and method "
             "auto (ctc-draft for whisper-base: the CTC head drafts, the target verifies; ar's transcripts) are "
             "what `rayspec transcribe` runs with no flags; #AVX2 runs a configuration with every kernel library "
             "of both engines held to AVX2 (ONEDNN_MAX_CPU_ISA=AVX2, FBGEMM_ENABLE_INSTRUCTIONS=AVX2, "
             "ATEN_CPU_CAPABILITY=avx2, MKL_ENABLE_INSTRUCTIONS=AVX2, CT2_FORCE_CPU_ISA=AVX2: a CPU without "
             "AVX-512, hence without bfloat16 or VNNI products, where auto picks int8), its ratios taken against "
             "the #AVX2 runs of the others where there are some. WER after Whisper's English normalizer. "
             "faster-whisper int8 / this: above 1 this configuration is faster. rayspec's modules are "
             "byte-compiled before the rounds, as an installed package's are.\n")
    notes += "".join(f"- FAILED {line}\n" for line in failures)
    print(write_process_outputs(best, {u.id: u.text or "" for u in utts}, audio_s, args.output, title, notes))
    return 0


def cmd_bench_peers(args) -> int:
    """The ``peers`` suite of ``rayspec bench``."""
    import platform

    from ..audio import load_audio
    from ..manifest import read_manifest
    from ..metrics import error_rates
    from ..models.registry import MODELS, resolve_model

    if args.manifests:
        utts = [u for m in args.manifests for u in read_manifest(m)]
    else:
        folder = resources.files("rayspec") / "samples" / "an4"
        utts = read_manifest(str(folder))
    utts = utts[: args.limit or 64]
    if args.whole_process:
        return cmd_whole_process(args, utts)
    audios = [load_audio(u.audio, 16000) for u in tqdm(utts, desc="audio")]
    engines = [e for e in args.engines.split(",") if e]
    unknown = {e for e in engines if e.partition("@")[0].partition(":")[0] not in ENGINES}
    if unknown:
        raise ValueError(f"unknown engine(s) {', '.join(sorted(unknown))}; choose from {', '.join(ENGINES)}")
    if "vllm" in engines and not os.path.exists(args.vllm_python):
        raise FileNotFoundError(f"no vLLM interpreter at {args.vllm_python}: run scripts/setup-vllm.sh first, or "
                                f"pass --engines rayspec,transformers")
    threads = args.threads or 1
    models = args.peer_models.split(",")
    rows, failures = run_peers(models, audios, tuple(args.batch_sizes), args.tokens, threads,
                               args.vllm_python, args.models_dir, engines,
                               runs_dir=os.path.join(args.output, "peers-runs"), repeats=args.repeats)
    refs = [u.text or "" for u in utts]
    for r in rows:
        if r.texts is not None and any(refs):
            rates = error_rates(refs, r.texts)
            r.wer, r.cer_nospace = 100 * rates.wer, 100 * rates.cer_nospace
    cpu = platform.processor()
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    audio = f"{len(audios)} utterances ({sum(len(a) for a in audios) / 16000:.0f} s audio)"
    if all(m in MODELS for m in models):
        title = (f"peers: real weights, {audio}, greedy to EOS, {threads} thread(s), {args.repeats} alternating "
                 f"round(s), {cpu}")
        notes = ("\n- The installed weights: rayspec and transformers on the converted float32 model, "
                 "faster-whisper and CTranslate2 on the original CTranslate2 files (float16 weights computed in the "
                 "compute type named). Timed: features + encoder + decoder over all utterances after a warm-up, "
                 "the fastest of the rounds; engines alternate within a round. rayspec / engine: rayspec ar "
                 "float32's RTFx over the engine's at the same batch size. faster-whisper: file by file (batch 1); "
                 "faster-whisper-batched: its BatchedInferencePipeline, which batches the VAD segments of one file. "
                 "tokens = rayspec: utterances whose tokens equal rayspec ar's at batch "
                 f"{args.batch_sizes[0]}. WER after Whisper's English normalizer.\n")
    else:
        title = f"peers: {audio}, {args.tokens} tokens each, float32, {threads} thread(s), {cpu}"
        notes = ("\n- Random weights in the published configurations; every engine generates exactly the same number "
                 "of tokens per utterance (EOS banned). Timed: features + encoder + decoder after a warm-up batch. "
                 "rayspec / engine: rayspec's RTFx over the engine's at the same batch size. "
                 "tokens = rayspec: utterances whose tokens equal rayspec's at batch " f"{args.batch_sizes[0]}.\n")
    notes += "".join(f"- FAILED {line}\n" for line in failures)
    print(write_peer_outputs(rows, args.output, title, notes))
    if args.serve_concurrency:
        from ..models.stock_whisper import random_whisper

        name = args.peer_models.split(",")[0]
        if name in MODELS:  # the converted float32 folder, served by both
            model_dir, kind = resolve_model(name), "real weights"
        else:
            model_dir = random_whisper(name, os.path.join(args.models_dir, name + "-task-prompt"),
                                       str(resources.files("rayspec") / "data" / "gpt2.tiktoken"), task_prompt=True)
            kind = "random weights, multilingual decoder prompt"
        served = ["rayspec"] + [e for e in engines if e.partition("@")[0].partition(":")[0] == "rayspec"
                                and e != "rayspec" and name in MODELS]  # methods and compute types: real weights
        results, failed = run_serve_load(model_dir, [u.audio for u in utts], [len(a) / 16000 for a in audios],
                                 args.serve_concurrency, threads, args.vllm_python if "vllm" in engines else None,
                                 args.serve_tokens_per_second, os.path.join(args.output, "logs"), served,
                                 name if name in MODELS else None)
        title = (f"peers, online: {name} ({kind}) behind rayspec serve (Ray Serve; rayspec = method ar, "
                 f"rayspec:METHOD another method, @COMPUTE_TYPE the encoder's) and vLLM's OpenAI server, "
                 f"{len(utts)} requests per concurrency, float32, {threads} thread(s), {cpu}")
        notes = ("\n- Latency: upload to answer, per request, at a constant number of requests in flight. Every "
                 f"utterance is capped at ceil({args.serve_tokens_per_second:g} x duration s) tokens (at least 16) "
                 "on both servers (vLLM: max_completion_tokens); "
                 + ("real weights stop at EOS, mostly well before. " if name in MODELS else
                    "random weights seldom stop earlier. ") +
                 "p50 / vllm p50: the server's median latency over vLLM's at the same concurrency. "
                 "text = rayspec: answers equal to rayspec's at the same concurrency (ignoring the leading space "
                 "vLLM keeps).\n") + "".join(f"- FAILED {line}\n" for line in failed)
        print(write_serve_outputs(results, args.output, title, notes))
    return 0
