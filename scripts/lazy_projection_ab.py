"""A/B of greedy verification with the lazy output projection (``score_greedy_lazily``) against the full one.

Decodes the first ``--limit`` clips of a manifest with each method, the encoder run once outside the timing, in
batches of ``--batch-size``; per method two rounds alternate full / lazy in the same process, the faster run of each
counts. Prints one line per method: decode seconds of each run, the ratio, and how many transcripts are identical.

    python scripts/lazy_projection_ab.py ../shared/data/ljspeech/clips.jsonl --limit 40 --batch-size 16
"""

from __future__ import annotations

import argparse
import time


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("manifest")
    p.add_argument("--limit", type=int, default=40)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--methods", default="medusa,draft,ar")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()

    import torch

    import rayspec.spec_decode.loop as loop
    from rayspec.audio import load_audio
    from rayspec.manifest import read_manifest
    from rayspec.methods import DecodeOptions
    from rayspec.pipeline import Transcriber, decode_encoded, encode_audio, local_proposers, needs_draft
    from rayspec.pipeline import speculation_options

    torch.set_num_threads(args.threads)
    utts = read_manifest(args.manifest)[: args.limit]
    audios = [load_audio(u.audio, 16000) for u in utts]
    bs = args.batch_size
    lazy_from = loop.LAZY_MIN_NODES
    for method in args.methods.split(","):
        tr = Transcriber("whisper-base", options=DecodeOptions(method=method, vad=False))
        batches = [audios[i:i + bs] for i in range(0, len(audios), bs)]
        encoded = [encode_audio(tr.target, tr.options, b, [len(a) / 16000 for a in b], tr.draft, tr.ctc)
                   for b in batches]
        walls: dict = {False: [], True: []}
        tokens: dict = {}
        for _ in range(2):
            for lazy in (False, True):
                loop.LAZY_MIN_NODES = lazy_from if lazy else 1 << 30
                t0, out = time.perf_counter(), []
                for enc in encoded:
                    proposers = (local_proposers(tr.draft, enc, speculation_options(tr.options))
                                 if needs_draft(tr.options) else None)
                    out += [h.tokens for h in decode_encoded(tr.target, tr.options, enc, proposers)]
                walls[lazy].append(time.perf_counter() - t0)
                tokens[lazy] = out
        same = sum(a == b for a, b in zip(tokens[False], tokens[True]))
        print(method, "full", [f"{x:.2f}" for x in walls[False]], "lazy", [f"{x:.2f}" for x in walls[True]],
              f"{min(walls[False]) / min(walls[True]):.2f}x", "identical", same, "/", len(utts), flush=True)


if __name__ == "__main__":
    main()
