"""One faster-whisper run over a manifest, as a user's script runs it: a whole process (``python -m
rayspec.peers.fw_process``) that imports faster-whisper, loads the model, reads and transcribes every file, and writes
the texts. :mod:`rayspec.bench.process` times it from start to exit.

Decoding as :func:`~rayspec.peers.engine_worker.faster_whisper_greedy` sets it (greedy, no timestamps, no VAD
filter: ``rayspec transcribe``'s default decoding). ``--batch-size N`` runs faster-whisper's
``BatchedInferencePipeline`` (it batches the speech segments of one file).
"""

from __future__ import annotations

import argparse
import json
import time

T_START = time.perf_counter()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m rayspec.peers.fw_process", description=__doc__)
    p.add_argument("--model", required=True, help="CTranslate2 model directory")
    p.add_argument("--manifest", required=True, help="JSON Lines manifest (its audio paths)")
    p.add_argument("--out", required=True, help="JSON report: texts, start-up and transcription seconds")
    p.add_argument("--compute-type", default="int8")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=0, help="BatchedInferencePipeline batch size (0: off)")
    args = p.parse_args(argv)

    from ..manifest import read_manifest
    from .engine_worker import faster_whisper_greedy

    version, transcribe = faster_whisper_greedy(args.model, args.compute_type, args.threads, args.batch_size > 0)
    utts = read_manifest(args.manifest)
    startup = time.perf_counter() - T_START
    texts = {}
    t0 = time.perf_counter()
    for u in utts:
        texts[u.id] = "".join(s.text for s in transcribe(u.audio, args.batch_size)).strip()
    report = {"version": version, "startup_s": startup, "transcribe_s": time.perf_counter() - t0,
              "texts": texts}
    with open(args.out, "w") as f:
        json.dump(report, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
