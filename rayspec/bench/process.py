"""``rayspec bench --suite peers --whole-process``: rayspec and faster-whisper timed as a user waits for them.

Each configuration is one whole process over the same manifest, timed from its start to its exit: interpreter
start, imports, model loading, audio decoding from the files and transcription (``rayspec transcribe`` as its
console command runs; faster-whisper through :mod:`rayspec.peers.fw_process`). Both run greedy with the same thread
count. Configurations alternate within a round and each keeps its fastest round. Beside the whole time: start-up
(process start to the first transcription call: the whole time minus the transcription time the process reports)
and that transcription time alone, WER, and how many texts equal rayspec float32's.

Configurations: ``ENGINE[@COMPUTE_TYPE][#MASK]``: engine ``rayspec`` (compute type as ``--compute-type``, default
auto) or ``faster-whisper`` (default int8); ``#MASK`` (e.g. ``#AVX2``: a CPU without AVX-512, bfloat16 or VNNI
products) holds every instruction-set switch of both engines' kernels to that level (:func:`isa_mask`); each at
batch 1 (file by file) or, with ``:batched``, rayspec's default batching / faster-whisper's
``BatchedInferencePipeline`` at batch 16.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Optional

from tqdm import tqdm

from ..files import write_atomic
from .tables import write_table

DEFAULT_CONFIGS = ("rayspec", "rayspec@float32", "rayspec#AVX2", "faster-whisper@int8", "faster-whisper@float32",
                   "faster-whisper@int8#AVX2", "rayspec:batched", "faster-whisper@int8:batched")
FW_BATCH = 16
BF16_FLAG_NAMES = ("amx_bf16", "avx512_bf16", "avx512f", "avx2")


@dataclass
class ProcessRun:
    """One configuration's fastest round: seconds from process start to exit (``whole_s``), of it transcribing
    (``transcribe_s``, as the process reports), the texts by utterance id, and the compute type it ran."""

    config: str
    whole_s: float
    transcribe_s: float
    texts: dict
    compute_type: str = ""
    version: str = ""

    @property
    def startup_s(self) -> float:
        return self.whole_s - self.transcribe_s


def parse_config(config: str) -> tuple[str, str, Optional[str], bool]:
    """``(engine, compute type, oneDNN ISA mask or None, batched)`` of a configuration name (module docstring).

    Raises:
        ValueError: an unknown engine.
    """
    batched = config.endswith(":batched")
    head = config.removesuffix(":batched")
    head, _, mask = head.partition("#")
    engine, _, ctype = head.partition("@")
    if engine not in ("rayspec", "faster-whisper"):
        raise ValueError(f"unknown engine in {config!r}: rayspec or faster-whisper")
    return engine, ctype or ("auto" if engine == "rayspec" else "int8"), mask or None, batched


ISA_SWITCHES = {"ONEDNN_MAX_CPU_ISA": str.upper, "FBGEMM_ENABLE_INSTRUCTIONS": str.upper,
                "ATEN_CPU_CAPABILITY": str.lower, "MKL_ENABLE_INSTRUCTIONS": str.upper, "CT2_FORCE_CPU_ISA": str.upper}
"""The environment variables that cap the instruction set of each kernel library the two engines run, and how each
spells a level: oneDNN (PyTorch's float32/bfloat16 linears and convolutions), fbgemm (PyTorch's int8 linears), ATen's
own vectorized kernels, MKL (PyTorch's and CTranslate2's float32 products) and CTranslate2's own kernels."""


def isa_mask(level: str) -> dict:
    """The environment that holds every library of :data:`ISA_SWITCHES` to the instruction set ``level`` (``AVX2``:
    as a CPU without AVX-512 / AMX, hence without native bfloat16 or VNNI products)."""
    return {name: spell(level) for name, spell in ISA_SWITCHES.items()}


def command(config: str, manifest: str, out: str, threads: int, ct2_dir: str) -> tuple[list[str], dict]:
    """The command line and environment of one configuration's process."""
    engine, ctype, mask, batched = parse_config(config)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false"}
    env.pop("RAYSPEC_COMPUTE_TYPE", None)
    for name in ISA_SWITCHES:
        env.pop(name, None)
    if mask:
        env.update(isa_mask(mask))
    if engine == "rayspec":
        cmd = [sys.executable, "-m", "rayspec.cli", "transcribe", manifest, "-o", out, "-q", "--threads",
               str(threads), "--compute-type", ctype] + ([] if batched else ["--max-batch", "1"])
    else:
        cmd = [sys.executable, "-m", "rayspec.peers.fw_process", "--model", ct2_dir, "--manifest", manifest,
               "--out", out, "--compute-type", ctype, "--threads", str(threads)] + (
                   ["--batch-size", str(FW_BATCH)] if batched else [])
    return cmd, env


def _slug(config: str) -> str:
    """A configuration's name as a file name."""
    return re.sub(r"[^\w.-]", "_", config)


def run_once(config: str, manifest: str, work: str, threads: int, ct2_dir: str) -> ProcessRun:
    """Run one configuration's process and read its output.

    Raises:
        RuntimeError: the process failed (its last stderr lines in the message).
    """
    engine = parse_config(config)[0]
    out = os.path.join(work, _slug(config) + (".parquet" if engine == "rayspec" else ".json"))
    if os.path.exists(out):
        os.remove(out)
    cmd, env = command(config, manifest, out, threads, ct2_dir)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    whole = time.perf_counter() - t0
    if proc.returncode != 0:
        tail = "\n".join(proc.stderr.strip().splitlines()[-8:])
        raise RuntimeError(f"{config} failed (exit {proc.returncode}): {' '.join(cmd)}\n{tail}")
    if engine == "rayspec":
        import pyarrow.parquet as pq

        from .. import __version__

        table = pq.read_table(out, columns=["id", "text", "compute_type"]).to_pylist()
        seconds = re.search(r"of audio in ([\d.]+) s", proc.stdout)
        return ProcessRun(config, whole, float(seconds.group(1)) if seconds else whole,
                          {r["id"]: r["text"] for r in table}, table[0]["compute_type"] if table else "",
                          __version__)
    with open(out) as f:
        rep = json.load(f)
    return ProcessRun(config, whole, rep["transcribe_s"], rep["texts"], parse_config(config)[1], rep["version"])


def compile_package() -> None:
    """Byte-compile rayspec's modules where its processes import them from (their ``__pycache__``), before any is
    timed: each engine then runs as installed. pip compiles an installed wheel's modules (faster-whisper's, PyTorch's),
    and a source tree's are compiled by its first run, unless ``PYTHONDONTWRITEBYTECODE`` is set; where it is, every
    rayspec process would compile its ~60 modules again (~0.2 s here). Files that cannot be written are skipped."""
    import compileall

    compileall.compile_dir(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), quiet=2)


def run_processes(configs, manifest: str, out_dir: str, threads: int, ct2_dir: str, repeats: int = 2,
                  progress: bool = True) -> tuple[dict, list[str]]:
    """Every configuration ``repeats`` times, alternating; returns ``({config: fastest ProcessRun}, failures)``.
    Each finished run is kept in ``out_dir/process-runs`` (written atomically), so an interrupted benchmark resumes
    where it stopped."""
    compile_package()
    runs_dir = os.path.join(out_dir, "process-runs")
    work = os.path.join(runs_dir, "outputs")
    os.makedirs(work, exist_ok=True)
    best: dict[str, ProcessRun] = {}
    failures = []
    jobs = [(k, c) for k in range(repeats) for c in configs]
    for k, config in tqdm(jobs, desc="whole processes", disable=not progress):
        kept = os.path.join(runs_dir, _slug(config) + f"-{k}.json")
        key = {"config": config, "manifest": os.path.abspath(manifest), "threads": threads}
        run = None
        if os.path.exists(kept):
            with open(kept) as f:
                saved = json.load(f)
            if saved["key"] == key:
                run = ProcessRun(**saved["run"])
        if run is None:
            try:
                run = run_once(config, manifest, work, threads, ct2_dir)
            except RuntimeError as exc:
                failures.append(str(exc).splitlines()[0])
                continue
            write_atomic(kept, json.dumps({"key": key, "run": vars(run)}))
        if config not in best or run.whole_s < best[config].whole_s:
            best[config] = run
    return best, failures


def cpu_description() -> str:
    """The CPU's model name and its flags that decide the compute type (``/proc/cpuinfo``)."""
    from ..compute import cpu_flags

    name = ""
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            name = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "")
    flags = cpu_flags()
    return f"{name or 'CPU'} (flags: {', '.join(f for f in BF16_FLAG_NAMES if f in flags) or 'none of ' + '/'.join(BF16_FLAG_NAMES)})"


def write_process_outputs(best: dict, refs: dict, audio_s: float, out_dir: str, title: str, notes: str = "") -> str:
    """``bench-peers-process.md`` / ``.csv`` / ``.png``: one row per configuration, ratios against faster-whisper
    int8 at the same batching and rayspec float32 (each under the same instruction-set mask where one ran with it)."""
    from ..metrics import error_rates

    ids = sorted(refs)

    def peer(name: str, mask: Optional[str], batched: bool) -> Optional[ProcessRun]:
        # the run of ``name`` under the same instruction-set mask, else the unmasked one
        tail = ":batched" if batched else ""
        return best.get(f"{name}#{mask}{tail}", best.get(name + tail)) if mask else best.get(name + tail)

    header = ["config", "engine", "compute type", "batch", "whole s", "start-up s", "transcribe s", "RTFx (whole)",
              "faster-whisper int8 / this (whole)", "this / rayspec float32 (whole)", "WER %",
              "texts = rayspec float32"]
    cells = []
    for config, run in best.items():
        engine, _, mask, batched = parse_config(config)
        fw = peer("faster-whisper@int8", mask, batched)
        ref = peer("rayspec@float32", mask, False)
        rates = error_rates([refs[i] for i in ids], [run.texts.get(i, "") for i in ids])
        same = f"{sum(run.texts.get(i) == ref.texts.get(i) for i in ids)}/{len(ids)}" if ref else "-"
        ctype = run.compute_type + (f" (ISA held to {mask})" if mask else "")
        cells.append([config, f"{engine} {run.version}", ctype, f"default ({FW_BATCH})" if batched else 1,
                      f"{run.whole_s:.1f}", f"{run.startup_s:.1f}", f"{run.transcribe_s:.1f}",
                      f"{audio_s / run.whole_s:.1f}", f"{fw.whole_s / run.whole_s:.2f}x" if fw else "-",
                      f"{run.whole_s / ref.whole_s:.2f}x" if ref else "-", f"{100 * rates.wer:.2f}",
                      same])
    os.makedirs(out_dir, exist_ok=True)
    stem = os.path.join(out_dir, "bench-peers-process")
    text = write_table(stem, title, header, cells, notes)
    _plot(best, stem + ".png", title)
    return text


def _plot(best: dict, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(best)
    start = [best[n].startup_s for n in names]
    work = [best[n].transcribe_s for n in names]
    fig, ax = plt.subplots(figsize=(8, 0.5 * len(names) + 1.5))
    ax.barh(names, start, label="start-up (imports, model load)")
    ax.barh(names, work, left=start, label="transcription (audio decoding included)")
    ax.invert_yaxis()
    ax.set_xlabel("seconds, whole process (lower is better)")
    ax.legend(fontsize=8)
    ax.set_title(title if len(title) < 90 else title[:87] + "...", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
