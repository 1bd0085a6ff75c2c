"""``python -m rayspec.bench.gpu_smoke``: a ~30 s check that the static-shape engine is sound on this device before a
benchmark spends its time (the first step of ``scripts/gpu_bench.sh``). Three checks, each printed, the verdict in
``smoke.json`` under ``-o``; exit status 1 with ``SMOKE CHECK FAILED: ...`` on the first failure:

1. **capture**: whisper-base's architecture with random weights (``--tiny``: a small one, for CI) gets static
   steps up to batch 2 and query 4, warmed up as a job's model is: on CUDA its step and head graphs are captured;
   a capture that fails (the steps fall back to the dynamic path) fails the check. Skipped on a CPU.
2. **replay**: for two buckets, ``(1, 1)`` and ``(2, 4)``, the same inputs run eagerly and as the captured graphs
   (step and head): the hidden states must agree within ``--atol`` (relative to their scale) and the head's argmax
   tokens must be equal. Skipped on a CPU.
3. **tokens**: ``ar`` over ``--clips`` noise clips (EOS banned, ``--tokens`` tokens each) at batch 1 and 2, with the
   static steps (graphs on CUDA; the eager static step with its head on a CPU) against the dynamic path: at least
   ``--min-identical`` of the utterances must have the same tokens (default: all in float32; half of them in
   float16 / bfloat16, whose kernels differ between a bucketed and a ragged step), and on CUDA the static run must
   have replayed graphs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np
import torch

from ..compute import dtype_of, synchronize
from ..runner.attention import decode_attention
from ..runner.static_step import StaticSteps

MAX_BATCH, MAX_QUERY = 2, 4
BUCKETS = ((1, 1), (2, 4))


class SmokeFailure(RuntimeError):
    """A check of the smoke test failed (its message says which and by how much)."""


def _ar(target, encoded, caps, batch: int) -> list[list[int]]:
    from ..decoding.ar import greedy_decode

    out = []
    for s in range(0, len(caps), batch):
        index = torch.arange(s, min(s + batch, len(caps)), device=encoded.states.device)
        out += [h.tokens for h in greedy_decode(target, encoded.select(index), caps[s:s + batch])]
    return out


def _replay(steps: StaticSteps, enc) -> dict:
    """Check 2: eager against replay on the same inputs, per bucket of :data:`BUCKETS`."""
    out = {}
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for bb, qb in BUCKETS:
            cache = steps.model.new_cache(enc.select(torch.zeros(bb, dtype=torch.long, device=enc.states.device)),
                                          16)
            inputs = steps.inputs(bb, qb)
            tokens = torch.randint(0, steps.model.vocab_size, (bb, qb), generator=gen).to(steps.device)
            inputs.fill(tokens, None, None, cache.lengths)
            with decode_attention(steps.device):  # the kernels the graphs were captured with
                eager, eager_scores = (x.clone() for x in steps.head_step(inputs))
            graph, graph_head = steps._graphs[bb, qb], steps._head_graphs[bb, qb]
            replayed = graph.replay().clone()
            _, head_scores = graph_head.replay()
            synchronize(steps.device)
            scale = float(eager.float().abs().max()) or 1.0
            diff = float((replayed.float() - eager.float()).abs().max()) / scale
            same = bool((head_scores[1] == eager_scores[1]).all())
            out[f"{bb}x{qb}"] = dict(max_rel_diff=diff, argmax_equal=same)
            del cache
    return out


def run(args) -> dict:
    """The three checks (see the module docstring); returns the report. Raises :class:`SmokeFailure`."""
    from .gpu import random_models

    device, dtype = torch.device(args.device), dtype_of(args.dtype)
    cuda = device.type == "cuda"
    t0 = time.perf_counter()
    target = random_models(args.device, dtype, size="tiny" if args.tiny else "base")[0]
    target.set_ignore_eos(True)  # before capture: the head graphs hold the suppress lists
    report = dict(device=torch.cuda.get_device_name(device) if cuda else "cpu", dtype=args.dtype,
                  model=target.name, capture="skipped (no CUDA)", replay="skipped (no CUDA)")
    rng = np.random.default_rng(0)
    audios = [(0.1 * rng.standard_normal(int(2.0 * target.sample_rate))).astype(np.float32)
              for _ in range(args.clips)]
    caps = [args.tokens] * args.clips
    with torch.inference_mode():
        encoded = target.encode(*target.features(audios))
        dynamic = {b: _ar(target, encoded, caps, b) for b in (1, 2)}
    steps = StaticSteps(target, max_batch=MAX_BATCH, max_query=MAX_QUERY).attach()
    try:
        steps.warm_up()
        st = steps.stats
        if cuda:
            report["capture"] = dict(graphs=st.graphs, seconds=round(st.capture_seconds, 3),
                                     allocated_mib=round(st.memory_bytes / 2**20, 1),
                                     reserved_mib=round(st.reserved_bytes / 2**20, 1), error=st.capture_error)
            print(f"capture: {report['capture']}")
            if st.fallback:
                raise SmokeFailure(f"CUDA-graph capture failed ({st.capture_error}); the engine would run the "
                                   f"dynamic path")
            report["replay"] = _replay(steps, encoded)
            print(f"replay vs eager: {report['replay']}")
            for key, r in report["replay"].items():
                if r["max_rel_diff"] > args.atol or not r["argmax_equal"]:
                    raise SmokeFailure(f"graph replay differs from the eager step at bucket {key}: relative "
                                       f"difference {r['max_rel_diff']:.2e} (limit {args.atol:.0e}), argmax equal "
                                       f"{r['argmax_equal']}")
        with torch.inference_mode():
            static = {b: _ar(target, encoded, caps, b) for b in (1, 2)}
        synchronize(device)
        same = {b: sum(x == y for x, y in zip(static[b], dynamic[b])) for b in (1, 2)}
        report["tokens"] = dict(clips=args.clips, tokens=args.tokens, identical_batch1=same[1],
                                identical_batch2=same[2], graph_steps=st.graph_steps, eager_steps=st.eager_steps,
                                head_steps=st.head_steps)
        print(f"ar tokens, static steps vs dynamic: {report['tokens']}")
        need = args.min_identical if args.min_identical is not None else (1.0 if dtype == torch.float32 else 0.5)
        worst = min(same.values()) / args.clips
        if worst < need:
            raise SmokeFailure(f"ar with static steps gave the dynamic path's tokens on only {min(same.values())} of "
                               f"{args.clips} clips (need {need:.0%})")
        if cuda and not st.graph_steps:
            raise SmokeFailure("ar with static steps replayed no CUDA graph")
        if not st.head_steps:
            raise SmokeFailure("ar with static steps never ran the step's head (projection and argmax on the device)")
    finally:
        steps.detach()
    report["seconds"] = round(time.perf_counter() - t0, 2)
    return report


def main(argv=None) -> int:
    """The command line (see the module docstring). Returns 0 when every check passed, 1 otherwise."""
    p = argparse.ArgumentParser(prog="python -m rayspec.bench.gpu_smoke", description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None, help="float16 on CUDA, float32 on a CPU (default)")
    p.add_argument("--clips", type=int, default=4)
    p.add_argument("--tokens", type=int, default=24, help="tokens per clip (EOS banned)")
    p.add_argument("--atol", type=float, default=1e-3, help="largest relative difference, replay vs eager")
    p.add_argument("--min-identical", type=float, default=None, help="fraction of clips whose tokens must match")
    p.add_argument("--tiny", action="store_true", help="a small random decoder instead of whisper-base's size")
    p.add_argument("-o", "--output", default=None, help="folder for smoke.json")
    args = p.parse_args(argv)
    args.dtype = args.dtype or ("float16" if torch.device(args.device).type == "cuda" else "float32")
    try:
        report, code = run(args), 0
        print(f"smoke check passed in {report['seconds']} s")
    except SmokeFailure as exc:
        report, code = dict(error=str(exc)), 1
        print(f"SMOKE CHECK FAILED: {exc}", file=sys.stderr)
    if args.output:
        os.makedirs(args.output, exist_ok=True)
        with open(os.path.join(args.output, "smoke.json"), "w") as f:
            json.dump(dict(report, passed=code == 0), f, indent=1)
    return code


if __name__ == "__main__":
    sys.exit(main())
