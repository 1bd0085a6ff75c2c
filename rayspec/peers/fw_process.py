"""One faster-whisper run over a manifest, as a user's script runs it: a whole process (``python -m
rayspec.peers.fw_process``) that imports faster-whisper, loads the model, reads and transcribes every file, and writes
the texts. :mod:`rayspec.bench.process` times it from start to exit.

Greedy (``beam_size=1``, temperature 0 only), no timestamps, no VAD filter: the same decoding as ``rayspec
transcribe``'s default. ``--batch-size N`` runs faster-whisper's ``BatchedInferencePipeline`` (it batches the
speech segments of one file).
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

    from ..extras import require
    from ..manifest import read_manifest

    fw = require("faster_whisper", "peers", "the faster-whisper peer")
    model = fw.WhisperModel(args.model, device="cpu", compute_type=args.compute_type, cpu_threads=args.threads)
    pipe = fw.BatchedInferencePipeline(model) if args.batch_size else None
    utts = read_manifest(args.manifest)
    startup = time.perf_counter() - T_START
    opts = dict(language="en" if model.model.is_multilingual else None, beam_size=1, temperature=0.0,
                without_timestamps=True, condition_on_previous_text=False)
    texts = {}
    t0 = time.perf_counter()
    for u in utts:
        if pipe is not None:
            segs, _ = pipe.transcribe(u.audio, batch_size=args.batch_size, **opts)
        else:
            segs, _ = model.transcribe(u.audio, vad_filter=False, **opts)
        texts[u.id] = "".join(s.text for s in segs).strip()
    report = {"version": fw.__version__, "startup_s": startup, "transcribe_s": time.perf_counter() - t0,
              "texts": texts}
    with open(args.out, "w") as f:
        json.dump(report, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
