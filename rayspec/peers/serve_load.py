"""Online endpoints under load: ``rayspec serve`` against vLLM's OpenAI server, same model, same audio.

Both servers run as child processes on 127.0.0.1 (rayspec's through its CLI, which starts a local Ray; vLLM's
``vllm.entrypoints.openai.api_server`` in its own environment) and answer OpenAI ``POST /v1/audio/transcriptions``.
A client keeps ``concurrency`` requests in flight until every file was sent once (after a warm-up) and records
per-request latency (upload to answer), errors and requests/s.

Equal work with random weights (which seldom emit EOS): rayspec caps each utterance at
``token_cap(duration, max_tokens_per_second)`` tokens; each vLLM request carries the same number as
``max_completion_tokens``. Greedy on both sides, so the transcripts are compared too.
"""

from __future__ import annotations

import asyncio
import os
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Optional


@dataclass
class LoadResult:
    """One server at one concurrency. latencies_s: per successful request; texts: per file (None on error)."""

    server: str
    concurrency: int
    requests: int
    wall_s: float
    latencies_s: list = field(default_factory=list)
    errors: int = 0
    texts: list = field(default_factory=list)

    @property
    def requests_per_s(self) -> float:
        return self.requests / self.wall_s

    def percentile(self, q: float) -> float:
        if not self.latencies_s:
            return float("nan")
        return statistics.quantiles(self.latencies_s, n=100, method="inclusive")[int(q) - 1] if len(
            self.latencies_s) > 1 else self.latencies_s[0]


class Server:
    """A server child process, stopped with SIGINT (rayspec: Serve and its local Ray shut down) then SIGKILL."""

    def __init__(self, name: str, cmd: list[str], env: dict, url: str, log_path: str) -> None:
        self.name, self.url = name, url
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(cmd, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def wait_ready(self, health: str, timeout_s: float = 600.0) -> float:
        """Seconds until ``GET health`` answers 200.

        Raises:
            RuntimeError: the process exited or did not get ready in time (see its log).
        """
        import requests

        t0 = time.perf_counter()
        while time.perf_counter() - t0 < timeout_s:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} server exited with status {self.proc.returncode} "
                                   f"(log: {self._log.name})")
            try:
                if requests.get(self.url + health, timeout=2).status_code == 200:
                    return time.perf_counter() - t0
            except requests.RequestException:
                pass
            time.sleep(1.0)
        raise RuntimeError(f"{self.name} server not ready after {timeout_s:.0f} s (log: {self._log.name})")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log.close()


def rayspec_server(model_dir: str, port: int, threads: int, max_tokens_per_second: float, log_path: str,
                   max_batch_size: int = 16, engine: str = "rayspec") -> Server:
    """``rayspec serve`` on 127.0.0.1 (VAD off so that every file is decoded) as the peers suite names it:
    ``engine`` is ``rayspec[:METHOD][@COMPUTE_TYPE]`` (method ar by default; a compute type is the encoder's,
    ``--encoder-dtype``), and the server carries that name."""
    name, _, compute_type = engine.partition("@")
    method = name.partition(":")[2] or "ar"
    cmd = [sys.executable, "-m", "rayspec.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--target", model_dir, "--threads", str(threads), "--replica-cpus", str(threads), "--no-vad",
           "--max-tokens-per-second", str(max_tokens_per_second), "--max-batch-size", str(max_batch_size),
           "--method", method] + (["--encoder-dtype", compute_type] if compute_type else [])
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled",
           "RAY_USAGE_STATS_ENABLED": "0", "OMP_NUM_THREADS": str(threads)}
    return Server(engine, cmd, env, f"http://127.0.0.1:{port}", log_path)


def vllm_server(python: str, model_dir: str, port: int, threads: int, log_path: str, max_num_seqs: int = 16) -> Server:
    """vLLM's OpenAI server on 127.0.0.1, float32, engine threads bound to the first ``threads`` cores."""
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir, "--host", "127.0.0.1",
           "--port", str(port), "--dtype", "float32", "--max-model-len", "448", "--max-num-seqs", str(max_num_seqs),
           "--max-num-batched-tokens", str(1500 * max_num_seqs + 448), "--seed", "0"]
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}" if threads > 1 else "0",
           "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "4"), "OMP_NUM_THREADS": str(threads)}
    return Server("vllm", cmd, env, f"http://127.0.0.1:{port}", log_path)


async def _load(url: str, files: list[tuple[str, bytes]], concurrency: int,
                fields: Callable[[int], dict]) -> tuple[float, list, list, int]:
    import aiohttp

    latencies, texts, errors = [], [None] * len(files), 0
    todo = iter(range(len(files)))

    async def worker(session):
        nonlocal errors
        for i in todo:
            form = aiohttp.FormData()
            name, data = files[i]
            form.add_field("file", data, filename=name)
            for k, v in fields(i).items():
                form.add_field(k, str(v))
            t0 = time.perf_counter()
            try:
                async with session.post(url + "/v1/audio/transcriptions", data=form) as resp:
                    body = await resp.json(content_type=None)
                    if resp.status == 200:
                        latencies.append(time.perf_counter() - t0)
                        texts[i] = body.get("text", "")
                    else:
                        errors += 1
            except aiohttp.ClientError:
                errors += 1

    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(session) for _ in range(concurrency)))
        return time.perf_counter() - t0, latencies, texts, errors


def run_load(server: Server, files: list[tuple[str, bytes]], concurrency: int,
             fields: Optional[Callable[[int], dict]] = None, warmup: int = 2) -> LoadResult:
    """Send every file once with ``concurrency`` requests in flight (after ``warmup`` sequential requests).

    Args:
        files: ``(name, encoded audio bytes)``; fields: extra form fields of request ``i`` (e.g. vLLM's
            ``max_completion_tokens``).
    """
    fields = fields or (lambda i: {})
    asyncio.run(_load(server.url, files[:warmup], 1, fields))
    wall, lat, texts, errors = asyncio.run(_load(server.url, files, concurrency, fields))
    return LoadResult(server.name, concurrency, len(files), wall, lat, errors, texts)
