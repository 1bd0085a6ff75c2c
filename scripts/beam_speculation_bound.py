"""How fast could exact speculation under beam search be on this machine? An oracle bound.

    python scripts/beam_speculation_bound.py ljspeech/lj99.jsonl --limit 40 -o bench/beam-bound

Exact speculative beam search (:mod:`rayspec.decoding.beam_speculative`) takes several beam-search steps from one
target pass only while every beam the search keeps lies on a drafted path: a kept beam off the drafts ends the round.
This script asks how many steps a pass could take with a *perfect* drafter, one that knows the target's own ranking
of every next token, and what such a pass costs here:

1. Plain beam search (whisper-base, float32, batch 1, ``--beam-size``) over the clips, recording at every step each
   kept beam's source beam and the rank of its new token among the source's candidates (0 = the target's best).
2. For a draft-tree shape per beam (a set of rank paths: ``chain m`` = the best token ``m`` deep, ``top k @1`` = the
   ``k`` best at the first position, then chains), the steps per pass an oracle drafter of that shape gives: a round
   goes on while every kept beam's rank path since the round began is in the shape.
3. The measured wall time of a pass that verifies ``n`` drafted tokens per beam (``5 x (1 + n)`` positions; the drafts
   are a suppressed token, so each pass advances one step) against a plain beam step, fastest of ``--repeats``
   round-robin rounds over the first ``--cost-clips`` clips.
4. The oracle's decoder speed-up (steps per pass / pass cost) and, with the encoder's share of plain beam search's
   wall time at batch 1, the whole transcription's bound; beside it the CTC head's drafts as shipped
   (:class:`~rayspec.decoding.beam_speculative.LookupDrafter`), measured.

Writes ``bound.md`` and ``bound.csv`` under ``-o``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from rayspec.audio import load_audio  # noqa: E402
from rayspec.bench.tables import write_table  # noqa: E402
from rayspec.decoding.beam import BeamSearch  # noqa: E402
from rayspec.decoding.beam_speculative import LookupDrafter, SpeculativeBeamSearch  # noqa: E402
from rayspec.decoding.options import BeamOptions  # noqa: E402
from rayspec.manifest import read_manifest  # noqa: E402
from rayspec.models.ctc import CTCHead  # noqa: E402
from rayspec.models.registry import default_drafter  # noqa: E402
from rayspec.models.whisper import WhisperASR  # noqa: E402
from rayspec.options import decode_options_from  # noqa: E402
from rayspec.pipeline import encode_audio  # noqa: E402

SHAPES = {  # name -> (candidates per depth, beyond the list 1; depth)
    "chain 1": ((1,), 1), "chain 2": ((1,), 2), "chain 3": ((1,), 3), "chain 4": ((1,), 4), "chain 6": ((1,), 6),
    "top 2 @1": ((2,), 1), "top 3 @1": ((3,), 1), "top 2 @1, chain 2": ((2,), 3), "top 2 @1-2": ((2, 2), 2),
    "top 2 @1, chain 6": ((2,), 7),
}


def tree(widths: tuple[int, ...], depth: int) -> set[tuple[int, ...]]:
    """The rank paths of a draft tree: ``widths[d]`` best candidates at depth ``d`` (1 beyond), ``depth`` deep."""
    paths: set[tuple[int, ...]] = set()

    def grow(p: tuple[int, ...]) -> None:
        if len(p) < depth:
            for r in range(widths[len(p)] if len(p) < len(widths) else 1):
                paths.add(p + (r,))
                grow(p + (r,))
    grow(())
    return paths


def steps_per_pass(traces: list[list[tuple[list[int], list[int]]]], paths: set, beams: int) -> float:
    """Beam-search steps per target pass for an oracle drafter of tree ``paths`` (module docstring, step 2)."""
    passes = steps = 0
    for trace in traces:
        i = 0
        while i < len(trace):
            passes += 1
            at = [()] * beams
            while i < len(trace):
                sources, ranks = trace[i]
                i += 1
                steps += 1
                new = [at[s] + (r,) for s, r in zip(sources, ranks)]
                if not all(p in paths for p in new):
                    break
                at = new
    return steps / max(passes, 1)


class Recording(BeamSearch):
    """Plain beam search that records, per step and audio, the kept beams' sources and their tokens' ranks."""

    def __init__(self, target: WhisperASR, options: BeamOptions) -> None:
        super().__init__(target, options)
        self.trace: list[tuple[list[int], list[int]]] = []
        update = self.decoder.update

        def recorded(audio, logprobs, tokens):
            sources = update(audio, logprobs, tokens)
            ranks = [list(tokens[j]).index(b.tokens[-1]) for b, j in zip(audio.beams, sources)]
            self.trace.append((sources, ranks))
            return sources
        self.decoder.update = recorded


class Rejected:
    """A drafter whose ``n`` tokens per beam are a suppressed token: every pass verifies them and advances one step."""

    def __init__(self, token: int, n: int) -> None:
        self.token, self.n = token, n

    def propose(self, audio: int, tokens, room: int) -> list[int]:
        return [self.token] * min(self.n, room)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("manifest")
    p.add_argument("--limit", type=int, default=40)
    p.add_argument("--cost-clips", type=int, default=6)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--beam-size", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("-o", "--out", required=True)
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    target = WhisperASR.from_pretrained("whisper-base", "cpu", torch.float32).pack_for_inference()
    ctc = CTCHead.from_pretrained(default_drafter(target.name, "ctc"), "cpu")
    options = decode_options_from({"method": "ctc-draft"})  # beam 1: the CTC hypothesis comes with the encoder
    beam = BeamOptions(beam_size=a.beam_size)
    utts = read_manifest(a.manifest)[: a.limit]
    encoded, encode_s = [], 0.0
    for u in utts:
        audio = load_audio(u.audio, target.sample_rate)
        t = time.perf_counter()
        encoded.append(encode_audio(target, options, [audio], [len(audio) / target.sample_rate], ctc=ctc))
        encode_s += time.perf_counter() - t

    traces, decode_s, plain_passes = [], 0.0, 0
    for e in encoded:
        search = Recording(target, beam)
        t = time.perf_counter()
        h = search.decode(e.target, e.caps)[0]
        decode_s += time.perf_counter() - t
        traces.append(search.trace)
        plain_passes += h.stats.target_forward_passes
    steps = sum(len(t) for t in traces)
    ctc_passes = sum(SpeculativeBeamSearch(target, beam, LookupDrafter(e.ctc.tokens)).decode(e.target, e.caps)[0]
                     .stats.target_forward_passes for e in encoded)

    token = target.suppress_tokens[0]
    widths = sorted({len(tree(*s)) for s in SHAPES.values()})
    cost_ms = {n: [] for n in [0, *widths]}
    few = encoded[: a.cost_clips]
    for _ in range(a.repeats + 1):  # the first round warms up
        for n in cost_ms:
            passes, t = 0, time.perf_counter()
            for e in few:
                search = BeamSearch(target, beam) if n == 0 else SpeculativeBeamSearch(target, beam, Rejected(token, n),
                                                                                       max_draft=n)
                passes += search.decode(e.target, e.caps)[0].stats.target_forward_passes
            cost_ms[n].append((time.perf_counter() - t) / passes * 1e3)
    step_ms = min(cost_ms[0][1:])
    decoder_share = decode_s / (encode_s + decode_s)

    rows = []
    for name, (w, d) in SHAPES.items():
        paths = tree(w, d)
        spp = steps_per_pass(traces, paths, a.beam_size)
        cost = min(cost_ms[len(paths)][1:]) / step_ms
        speedup = spp / cost
        rows.append({"draft tree per beam": f"{name} (oracle)", "nodes per beam": len(paths),
                     "positions per pass": a.beam_size * (1 + len(paths)), "steps per pass": f"{spp:.2f}",
                     "pass cost (plain steps)": f"{cost:.2f}", "decoder speed-up": f"{speedup:.2f}x",
                     "whole bound, batch 1": f"{1 / (1 - decoder_share + decoder_share / speedup):.2f}x"})
    rows.append({"draft tree per beam": "CTC lookup, chain <= 6 (shipped, measured)", "nodes per beam": "<= 6",
                 "positions per pass": f"<= {a.beam_size * 7}", "steps per pass": f"{steps / ctc_passes:.2f}",
                 "pass cost (plain steps)": "-", "decoder speed-up": "-", "whole bound, batch 1": "-"})
    os.makedirs(a.out, exist_ok=True)
    title = (f"exact speculative beam search, oracle bound: whisper-base, beam {a.beam_size}, float32, batch 1, "
             f"{len(utts)} clips of {os.path.basename(a.manifest)}, {a.threads} threads")
    worst = np.array([max(ranks) for trace in traces for _, ranks in trace])
    notes = [f"- the kept beams' worst rank per step: all the best of their source in {np.mean(worst == 0):.0%} of the "
             f"steps, a second-ranked candidate at worst in {np.mean(worst == 1):.0%}, lower in "
             f"{np.mean(worst >= 2):.0%}.",
             f"- {steps} beam steps ({plain_passes} plain target passes with the prompt's); a plain step "
             f"{step_ms:.1f} ms (fastest of {a.repeats} rounds over {len(few)} clips); the encoder side "
             f"{encode_s:.1f} s, plain beam search's decoder side {decode_s:.1f} s ({decoder_share:.0%} of the two).",
             "- steps per pass: with a drafter that knows the target's ranking (the oracle), each beam drafting the "
             "tree's rank paths; pass cost: a pass verifying that many drafted tokens per beam, in plain steps; "
             "decoder speed-up = steps per pass / pass cost; whole bound: the transcription's speed-up with that "
             "decoder and the same encoder, drafting free."]
    header = list(rows[0])
    write_table(os.path.join(a.out, "bound"), title, header, [[r[h] for h in header] for r in rows],
                "\n" + "\n".join(notes) + "\n")


if __name__ == "__main__":
    main()
