"""``rayspec bench --suite gpu``: the engine on one device, in one command whose tables all land in one folder.

Tables written to ``--output`` (each ``.md`` + ``.csv``):

* ``bench-gpu.md``: ``ar`` and every method at its defaults (the ``methods`` suite's configurations; ``ar`` alone
  with ``--random-weights``) at each batch size (default 1, 16, 64; batches of 64 and more decode the clips 4 times
  over, 160 utterances for LJSpeech's first 40), with static-shape steps captured as CUDA graphs and without
  (``steps`` column: ``graphs``; ``static`` where a CPU runs the static steps eagerly; ``dynamic``), warm (best of
  ``--repeats`` round-robin runs after a warm-up batch), each with wall s, RTFx, target passes (NFE) per utterance,
  decode ms per target round (the decode side's wall over the rounds of target passes), speed-up against ``ar``
  with the same steps, and utterances identical to that ``ar``.
* ``bench-gpu-rule.md``: for each method of ``--rule-methods`` (default ``draft,ctc-draft``), with the static steps
  on, its row at the default row cap (the speculation rule, :mod:`rayspec.spec_decode.rule`) against the same method
  forced to speculate in every round and ``ar`` (forced off): the rule's wall over the faster of the two.
* ``bench-gpu-peers.md``: transformers on the same device, dtype, weights and features: ``generate``,
  ``generate`` with its static cache, and static cache + ``torch.compile(mode="reduce-overhead")``; a variant that
  fails is a row with its error. Beside them rayspec's ``ar`` rows; identical counts against rayspec's ``ar``.
* ``bench-gpu-passes.md``: wall ms of one decoder step per (batch bucket, query bucket), dynamic (today's ragged
  step), static and as a captured graph: what a verification pass costs against a one-token step, the measurement
  :meth:`~rayspec.runner.static_step.StaticSteps.pass_cost` gives the engine at warm-up.
* ``bench-gpu-cold.md``: the first job in a fresh process (a subprocess per row: model load, warm-up and capture,
  then the same job twice) against the second, for ``--cold-methods`` at batch 1 with graphs on and off.
* ``gpu-env.json``: device name, torch / transformers versions, date, the command.

``--random-weights`` runs whisper-base's architecture (d_model 512, 6 + 6 layers, 51,865 tokens) with random weights
and no drafters: no weights to carry, speed only, every utterance forced to ``--tokens`` tokens in every engine (EOS
banned). Passes per utterance of the methods then come from a run on the real model (a CPU run gives the same
counts: acceptance does not depend on the device).

The path imports neither soundfile, soxr, jiwer nor Ray unless it needs them (audio files of a manifest; WER where
references exist and jiwer is installed), so it runs on a bare GPU host with torch, transformers and numpy.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import replace
from typing import Optional

import numpy as np
import torch

from ..batching import BatchBudget, plan_batches
from ..compute import name_of
from ..pipeline import DecodeOptions
from ..runner.static_step import BATCH_BUCKETS, HEAD_NODES, StaticSteps, bucket, prepare_static_steps
from .tables import write_table

BIG_BATCH = 64  # from this batch size on, the clips are decoded COPIES times over (LJSpeech's 40 clips x 4 = 160)
COPIES = 4
RANDOM_CLIP_S = 6.9  # synthetic clips of --random-weights: LJSpeech's first 40 clips average 6.9 s
PASS_QUERIES = (1, 2, 4, 8, 16)


RANDOM_SIZES = {  # --random-size: whisper-base's decoder shape, or a small one for CI on a CPU
    "base": dict(d_model=512, encoder_layers=6, decoder_layers=6, encoder_attention_heads=8,
                 decoder_attention_heads=8, encoder_ffn_dim=2048, decoder_ffn_dim=2048),
    "tiny": dict(d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                 decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128),
}


def random_models(device: str, dtype: torch.dtype, seed: int = 0, size: str = "base"):
    """whisper-base's architecture with random weights as ``(target, None, None)`` (no drafters), the English-only
    prompt ``<|startoftranscript|><|notimestamps|>`` and no suppress lists; built in memory (nothing is written).
    ``size`` "tiny" keeps the vocabulary, prompt and encoder window but shrinks the layers (:data:`RANDOM_SIZES`):
    the suite and its smoke check end to end on a CPU in seconds.

    Raises:
        ValueError: an unknown ``size``.
    """
    from transformers import GenerationConfig, WhisperConfig, WhisperFeatureExtractor, WhisperForConditionalGeneration

    from ..models.stock_whisper import EOT, NO_TIMESTAMPS, SOT
    from ..models.whisper import WhisperASR

    if size not in RANDOM_SIZES:
        raise ValueError(f"random model size {size!r} is not one of {', '.join(RANDOM_SIZES)}")
    torch.manual_seed(seed)
    cfg = WhisperConfig(vocab_size=51865, num_mel_bins=80, max_source_positions=1500, max_target_positions=448,
                        pad_token_id=EOT, bos_token_id=EOT, eos_token_id=EOT, decoder_start_token_id=SOT,
                        tie_word_embeddings=True, **RANDOM_SIZES[size])
    cfg._attn_implementation = "sdpa"
    model = WhisperForConditionalGeneration(cfg).to(device=device, dtype=dtype).eval()
    gen = GenerationConfig(decoder_start_token_id=SOT, eos_token_id=EOT, pad_token_id=EOT, bos_token_id=EOT,
                           no_timestamps_token_id=NO_TIMESTAMPS, max_length=448, suppress_tokens=[],
                           begin_suppress_tokens=[], is_multilingual=False)
    model.generation_config = gen
    name = "whisper-base (random)" if size == "base" else f"whisper {size} (random)"
    target = WhisperASR(model, WhisperFeatureExtractor(feature_size=80), None, gen, name=name)
    return target, None, None


def real_models(args):
    """The target and the methods' bundled drafters (draft decoder, CTC head; Medusa heads load per run), on
    ``args.device`` in ``--compute-type``."""
    from ..models.ctc import CTCHead
    from ..models.registry import default_drafter
    from ..models.whisper import WhisperASR
    from ..options import compute_type

    dtype = compute_type(args).dtype
    target = WhisperASR.from_pretrained(args.target, args.device, dtype).pack_for_inference()
    draft = WhisperASR.from_pretrained(args.draft or default_drafter(target.name, "draft"), args.device,
                                       dtype).pack_for_inference()
    ctc = CTCHead.from_pretrained(args.ctc or default_drafter(target.name, "ctc"), args.device).to(dtype)
    return target, draft, ctc


def clips(args, sample_rate: int) -> tuple[list[np.ndarray], list[Optional[str]]]:
    """The benchmark's waveforms and references: the manifests' first ``--clips`` utterances, or with
    ``--random-weights`` and no manifest ``--clips`` seeded noise clips of :data:`RANDOM_CLIP_S` seconds."""
    if not args.manifests:
        rng = np.random.default_rng(0)
        n = int(RANDOM_CLIP_S * sample_rate)
        return [(0.1 * rng.standard_normal(n)).astype(np.float32) for _ in range(args.clips)], [None] * args.clips
    from ..audio import load_audio
    from ..manifest import read_manifest

    utts = [u for m in args.manifests for u in read_manifest(m)][: args.clips]
    return [load_audio(u.audio, sample_rate) for u in utts], [u.text for u in utts]


RULE = " +rule"
"""Suffix of a method's row run at the default ``--speculate-max-rows`` (the speculation rule decides per round);
the method's plain row speculates in every round (forced on), ``ar`` never does (forced off)."""


def configs(args, random: bool, rule: bool = False) -> list[tuple[str, DecodeOptions]]:
    """The rows' configurations: ``ar`` (forced to ``--tokens`` with random weights) or every method's defaults,
    speculating in every round; with ``rule``, also each method of ``--rule-methods`` at the default row cap (suffix
    :data:`RULE`; real weights only).

    Raises:
        ValueError: a ``--rule-methods`` name that is no exact speculative method's row.
    """
    from .asr import method_defaults

    if random:  # cap = ceil(6.9 s x rate) = --tokens for every clip
        return [("ar", DecodeOptions("ar", vad=False, max_tokens_per_second=(args.tokens - 0.5) / RANDOM_CLIP_S))]
    rows = method_defaults(args.medusa)
    out = [(name, replace(o, speculate_max_rows=0)) for name, o in rows]
    names = [m for m in (getattr(args, "rule_methods", "") or "").split(",") if m] if rule else []
    exact = [name for name, o in rows if name != "ar" and (o.method != "ssd" or o.ssd.exact)]
    unknown = sorted(set(names) - set(exact))
    if unknown:
        raise ValueError(f"--rule-methods: {', '.join(unknown)} is no exact speculative method (choose from "
                         f"{', '.join(exact)}; a lossy rule keeps its fixed row cap)")
    return out + [(name + RULE, o) for name, o in rows if name in names]


def rule_rows(rows: list[dict], goal: float = 1.03) -> list[dict]:
    """The speculation rule against forcing: for every row ``<method> +rule`` (:data:`RULE`) of ``rows``
    (:func:`rayspec_rows`' dicts), the same method forced on and ``ar`` (forced off) at the same steps and batch size.

    Returns:
        one dict per rule row: ``config`` (the method), ``steps``, ``batch``, ``ar_s``, ``forced_s``, ``rule_s`` (wall
        s), ``best`` ("ar" or "forced"), ``ratio`` (rule wall / the faster of the two) and ``ok`` (ratio <= ``goal``:
        #65's "never a slower path than ``ar`` or forcing by more than 3%").
    """
    wall = {(r["config"], r["steps"], r["batch"]): r["wall_s"] for r in rows}
    out = []
    for (config, steps, batch), rule_s in wall.items():
        if not config.endswith(RULE):
            continue
        method = config[: -len(RULE)]
        ar_s, forced_s = wall.get(("ar", steps, batch)), wall.get((method, steps, batch))
        if ar_s is None or forced_s is None:
            continue
        best = "ar" if ar_s <= forced_s else "forced"
        ratio = rule_s / min(ar_s, forced_s)
        out.append(dict(config=method, steps=steps, batch=batch, ar_s=ar_s, forced_s=forced_s, rule_s=rule_s,
                        best=best, ratio=ratio, ok=ratio <= goal))
    return out


CAPTURE_FAILED = "dynamic (capture failed)"


def _set_steps(models, on: bool, max_batch: int) -> tuple[str, dict]:
    """Attach (``on``) or detach the static steps of the target and the draft model; returns the steps' label
    (``graphs``, ``static`` on a CPU, ``dynamic``, or :data:`CAPTURE_FAILED` where capture failed and the steps fell
    back to the dynamic path) and ``{"seconds": warm-up s, "allocated": bytes, "reserved": bytes, "capture_error":
    str}`` summed over both models."""
    info = dict(seconds=0.0, allocated=0, reserved=0, capture_error="")
    label = "dynamic"
    for k, m in enumerate(models[:2]):
        if m is None:
            continue
        if m.static_steps is not None:
            m.static_steps.detach()
        if not on:
            continue
        steps = prepare_static_steps(m, "on", True, max_batch, head=k == 0)  # the draft model never verifies
        st = steps.stats
        info["seconds"] += st.warm_up_seconds
        info["allocated"] += st.memory_bytes
        info["reserved"] += st.reserved_bytes
        if st.capture_error:
            info["capture_error"] = info["capture_error"] or f"{m.name or 'model'}: {st.capture_error}"
            print(f"WARNING: CUDA-graph capture failed, {m.name or 'model'} runs the dynamic path: "
                  f"{st.capture_error}", file=sys.stderr)
        if k == 0:
            label = CAPTURE_FAILED if st.fallback else ("graphs" if steps.graphs_enabled else "static")
    return label, info


def _rounds(hyps, batches) -> int:
    """Rounds of target passes: per batch, its longest row's passes (every live row takes part in a round)."""
    return sum(max(hyps[i].stats.target_forward_passes for i in b) for b in batches)


def rayspec_rows(models, audios, refs, cfgs, batch_sizes, repeats: int, steps_on: bool, max_batch: int):
    """Warm rows of every configuration at every batch size with the static steps on or off (see the module
    docstring). Returns a list of dicts (one per row) and the steps' ``(label, info)`` (:func:`_set_steps`)."""
    from .asr import run_bench

    label, info = _set_steps(models, steps_on, max_batch)
    out = []
    for bs in batch_sizes:
        copies = COPIES if bs >= BIG_BATCH else 1
        a, r = audios * copies, refs * copies
        durations = [len(x) / models[0].sample_rate for x in a]
        batches = plan_batches(list(range(len(a))), durations, BatchBudget(tokens=10**9, max_rows=bs))
        hyps_of = {}
        rows = run_bench(models, a, r if all(r) else None, cfgs, (bs,), progress=False, repeats=repeats,
                         keep=hyps_of)
        for row in rows:
            rounds = _rounds(hyps_of[row.config], batches)
            out.append(dict(engine="rayspec", config=row.config, steps=label, batch=bs, utts=row.utterances,
                            wall_s=row.wall_s, rtfx=row.rtfx, nfe=row.nfe_per_utt, speedup=row.speedup,
                            round_ms=1e3 * row.decode_s / max(1, rounds), identical=row.identical_to_ar,
                            encode_s=row.encode_s, decode_s=row.decode_s,
                            wer=None if row.wer is None else 100 * row.wer,
                            tokens=[h.tokens for h in hyps_of[row.config]]))
    return out, (label, info)


# ---------------------------------------------------------------------------------------------- transformers peers
HF_VARIANTS = ("generate", "generate static cache", "generate static cache + compile")


def _hf_generate(target, audios, caps, variant: str, forced: bool):
    """transformers' ``generate`` over one batch (features by the target's extractor, as rayspec's rows): token
    lists, prompt and EOS stripped."""
    from transformers import GenerationMixin

    feats, _ = target.features(audios)
    prompt = torch.tensor([target.prompt_ids], device=target.device).expand(len(audios), -1)
    n = max(caps)
    limits = dict(min_new_tokens=n, max_new_tokens=n) if forced else dict(max_new_tokens=n + 1)
    extra = {"cache_implementation": "static"} if "static" in variant else {}
    out = GenerationMixin.generate(target.model, input_features=feats.to(target.model.dtype), decoder_input_ids=prompt,
                                   do_sample=False, num_beams=1, suppress_tokens=target.suppress_tokens or None,
                                   begin_suppress_tokens=target.begin_suppress_tokens or None,
                                   eos_token_id=target.eos_token_id, pad_token_id=target.eos_token_id, **limits,
                                   **extra)
    rows = []
    for ids, cap in zip(out[:, prompt.shape[1]:].tolist(), caps):
        ids = ids[: ids.index(target.eos_token_id)] if target.eos_token_id in ids and not forced else ids
        rows.append(ids[:cap])
    return rows


def transformers_rows(target, audios, cfg: DecodeOptions, batch_sizes, repeats: int, forced: bool,
                      variants=HF_VARIANTS) -> list[dict]:
    """Rows of each of ``variants`` (:data:`HF_VARIANTS`) at each batch size (best of ``repeats`` after a warm-up
    batch); a variant that raises is one row with its error (the later batch sizes of a variant that failed are
    skipped)."""
    import transformers

    from ..decoding.common import token_cap

    transformers.logging.set_verbosity_error()  # not one warning per generate call
    limit = target.max_target_positions - len(target.prompt_ids) - 1
    out = []
    forward = target.model.forward
    for variant in variants:
        error = None
        if variant.endswith("compile"):
            target.model.forward = torch.compile(forward, mode="reduce-overhead")
        try:
            for bs in batch_sizes:
                if error:
                    break
                a = audios * (COPIES if bs >= BIG_BATCH else 1)
                caps = [token_cap(len(x) / target.sample_rate, cfg.max_tokens_per_second, limit) for x in a]
                groups = [list(range(s, min(len(a), s + bs))) for s in range(0, len(a), bs)]
                try:
                    with torch.inference_mode():
                        _hf_generate(target, [a[i] for i in groups[0]], [caps[i] for i in groups[0]], variant, forced)
                        best, tokens = float("inf"), []
                        for _ in range(repeats):
                            _sync(target.device)
                            t0 = time.perf_counter()
                            tokens = [t for g in groups for t in _hf_generate(target, [a[i] for i in g],
                                                                              [caps[i] for i in g], variant, forced)]
                            _sync(target.device)
                            best = min(best, time.perf_counter() - t0)
                except Exception as exc:  # noqa: BLE001 - a failing variant is a row of the table
                    error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
                    out.append(dict(engine="transformers", config=variant, steps="-", batch=bs, utts=len(a),
                                    error=error))
                    break
                audio_s = sum(len(x) for x in a) / target.sample_rate
                out.append(dict(engine="transformers", config=variant, steps="-", batch=bs, utts=len(a),
                                wall_s=best, rtfx=audio_s / best, tokens=tokens))
        finally:
            target.model.forward = forward
    return out


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


# ---------------------------------------------------------------------------------------------- pass costs
def pass_rows(target, audio, batch_sizes, max_batch: int) -> list[dict]:
    """Wall ms of one decoder step per (batch bucket, query), every column synchronised on CUDA and named by what it
    includes: the dynamic step without and with the output projection (one token per row), the static step run
    eagerly and as a CUDA graph without the projection, and the static step with its head (projection, suppress
    lists, greedy argmax and verdicts) as a graph (eagerly on a CPU), in buckets of at most ``HEAD_NODES`` nodes."""
    from .asr import decoder_pass_ms

    if target.static_steps is not None:
        target.static_steps.detach()
    sizes = sorted({bucket(min(b, max_batch), BATCH_BUCKETS) for b in batch_sizes})
    with torch.inference_mode():
        enc = target.encode(*target.features([audio]))
    dynamic = {b: decoder_pass_ms(target, enc, b, passes=50, project=False) for b in sizes}
    dynamic_head = {b: decoder_pass_ms(target, enc, b, passes=50) for b in sizes}
    costs, heads, failed = {}, {}, ""
    for graphs in ((False, True) if target.device.type == "cuda" else (False,)):
        steps = StaticSteps(target, max_batch=max(sizes), max_query=max(PASS_QUERIES), graphs=graphs).attach()
        try:
            steps.warm_up(repeats=10)
            if steps.stats.fallback:  # capture failed: no graph columns (warm_up warned)
                failed = steps.stats.capture_error
                continue
            name = "graph" if graphs else "static"
            costs[name], heads[name] = dict(steps.stats.cost_ms), dict(steps.stats.head_cost_ms)
        finally:
            steps.detach()
    rows = []
    for b in sizes:
        for q in PASS_QUERIES:
            rows.append(dict(batch=b, query=q, dynamic_ms=dynamic[b] if q == 1 else None,
                             dynamic_head_ms=dynamic_head[b] if q == 1 else None,
                             static_ms=costs["static"].get((b, q)), graph_ms=costs.get("graph", {}).get((b, q)),
                             head_ms=heads.get("graph", heads.get("static", {})).get((b, q)),
                             capture_error=failed))
    return rows


# ---------------------------------------------------------------------------------------------- cold start
def cold_child(args) -> int:
    """``--cold-run METHOD:BATCH:STEPS`` (a subprocess of the suite): load, warm up, then the same job twice; prints
    one JSON line ``{"load_s", "first_s", "second_s", "capture_s"}``."""
    method, bs, steps = args.cold_run.split(":")
    t0 = time.perf_counter()
    random = args.random_weights
    models = random_models(args.device, _dtype(args), size=args.random_size) if random else real_models(args)
    if random:
        models[0].set_ignore_eos(True)
    audios, _ = clips(args, models[0].sample_rate)
    cfg = dict(configs(args, random))[method]
    _, info = _set_steps(models, steps == "on", int(bs))
    capture_s = info["seconds"]
    if models[0].device.type == "cuda":  # the engine's load-time warm-up (rayspec.pipeline.Transcriber.warm_up)
        from ..pipeline import decode_batch

        noise = 0.01 * np.random.default_rng(1).standard_normal(16000).astype(np.float32)
        decode_batch(models[0], replace(cfg, vad=False), [noise], [1.0], *models[1:])
    _sync(models[0].device)
    load_s = time.perf_counter() - t0
    from .asr import _run

    durations = [len(x) / models[0].sample_rate for x in audios]
    batches = plan_batches(list(range(len(audios))), durations, BatchBudget(tokens=10**9, max_rows=int(bs)))
    walls = []
    for _ in range(2):
        t1 = time.perf_counter()
        _run(method, cfg, models, audios, durations, batches, {})
        _sync(models[0].device)
        walls.append(time.perf_counter() - t1)
    print(json.dumps(dict(load_s=load_s, first_s=walls[0], second_s=walls[1], capture_s=capture_s)))
    return 0


def cold_rows(args, methods: list[str]) -> list[dict]:
    """One fresh process per (method, steps on/off) at batch 1 (see :func:`cold_child`)."""
    rows = []
    for method in methods:
        for steps in ("on", "off"):
            argv = [a for a in sys.argv[1:]]
            cmd = [sys.executable, "-m", "rayspec.cli", *argv, "--cold-run", f"{method}:1:{steps}"]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
            row = dict(config=method, steps="graphs/static" if steps == "on" else "dynamic", batch=1)
            if proc.returncode or not lines:
                row["error"] = (proc.stderr.strip().splitlines() or ["no output"])[-1][:200]
            else:
                row.update(json.loads(lines[-1]))
            rows.append(row)
    return rows


# ---------------------------------------------------------------------------------------------- tables
def _f(x, fmt="{:.2f}"):
    return "-" if x is None else fmt.format(x)


def write_tables(out_dir: str, title: str, rows: list[dict], peers: list[dict], passes: list[dict],
                 cold: list[dict], capture: dict) -> str:
    """Write the suite's tables (see the module docstring); returns the main table's Markdown."""
    os.makedirs(out_dir, exist_ok=True)
    cells = [[r["config"], r["steps"], r["batch"], r["utts"], _f(r["wall_s"], "{:.3f}"), _f(r["rtfx"], "{:.1f}"),
              _f(r["nfe"]), _f(r["round_ms"]), f"{r['speedup']:.2f}x", f"{r['identical']}/{r['utts']}",
              _f(r["wer"])] for r in rows]
    notes = "\n" + "".join(f"- steps {k}: warm-up (slots, capture, bucket timing) {v['seconds']:.2f} s, holds "
                           f"{v['allocated'] / 2**20:.0f} MiB allocated, {v['reserved'] / 2**20:.0f} MiB reserved "
                           f"by the allocator (the graph pool included)\n"
                           for k, v in capture.items() if k != "dynamic")
    notes += "".join(f"- **CUDA-graph capture failed**, rows `{CAPTURE_FAILED}` ran the dynamic path: "
                     f"{v['capture_error']}\n" for v in capture.values() if v.get("capture_error"))
    notes += ("- wall: best of the round-robin repeats after a warm-up batch (warm); decode ms/round: the decode "
              "side's wall over the rounds of target passes; identical: utterances whose tokens equal ar's with "
              "the same steps.\n")
    main = write_table(os.path.join(out_dir, "bench-gpu"), title,
                       ["config", "steps", "batch", "utts", "wall s", "RTFx", "NFE/utt", "decode ms/round",
                        "speed-up vs ar", "identical to ar", "WER %"], cells, notes)
    write_table(os.path.join(out_dir, "bench-gpu-rule"), title + ": the speculation rule against forcing",
                ["method", "steps", "batch", "ar (forced off) s", "forced on s", "rule s", "faster forced",
                 "rule / faster", "within 3%"],
                [[r["config"], r["steps"], r["batch"], _f(r["ar_s"], "{:.3f}"), _f(r["forced_s"], "{:.3f}"),
                  _f(r["rule_s"], "{:.3f}"), r["best"], f"{r['ratio']:.2f}x", "yes" if r["ok"] else "NO"]
                 for r in rule_rows(rows)],
                "\n- rule: the method at the default `--speculate-max-rows` (the speculation rule prices each round "
                "from warm-up and measured costs and speculates where it pays); forced on: every round speculates "
                "(`--speculate-max-rows all`); forced off: `ar`. Same steps, batch and run; wall = best of the "
                "repeats.\n")
    ar = {(r["steps"], r["batch"]): r["tokens"] for r in rows if r["config"] == "ar"}
    peer_cells = []
    for r in peers + [r for r in rows if r["config"] == "ar"]:
        ref = ar.get(("dynamic", r["batch"])) or next(iter(ar.values()), None)
        same = ("-" if "tokens" not in r or ref is None
                else f"{sum(a == b for a, b in zip(r['tokens'], ref))}/{r['utts']}")
        label = r["config"] if r["engine"] == "transformers" else f"rayspec ar ({r['steps']})"
        peer_cells.append([r["engine"], label, r["batch"], r["utts"], _f(r.get("wall_s"), "{:.3f}"),
                           _f(r.get("rtfx"), "{:.1f}"), same, r.get("error", "")])
    write_table(os.path.join(out_dir, "bench-gpu-peers"), title + ": transformers on the same device",
                ["engine", "variant", "batch", "utts", "wall s", "RTFx", "identical to rayspec ar (dynamic)",
                 "error"], peer_cells)
    failed = next((p["capture_error"] for p in passes if p.get("capture_error")), "")
    write_table(os.path.join(out_dir, "bench-gpu-passes"), title + ": one decoder step, wall ms",
                ["batch", "query", "dynamic, no projection", "dynamic + projection", "static eager, no projection",
                 "graph, no projection", "graph + head (projection, rules, argmax)"],
                [[p["batch"], p["query"], _f(p["dynamic_ms"]), _f(p.get("dynamic_head_ms")), _f(p["static_ms"]),
                  _f(p["graph_ms"]), _f(p.get("head_ms"))] for p in passes],
                "\n- every column: wall ms of one step, synchronised on CUDA before and after. dynamic: the ragged "
                "step, one token per row (encoder states of one clip; mean of 50 passes, best of 3 runs), without and "
                "with the output projection to the vocabulary; static eager: the bucketed step run eagerly; graph: "
                "replayed as a CUDA graph; graph + head: the step with the output projection, suppress lists, greedy "
                "argmax and verdicts inside the graph (eager on a CPU; buckets of at most "
                f"{HEAD_NODES} nodes); static and graph columns: median of 10 after capture.\n"
                + (f"- **CUDA-graph capture failed** ({failed}): no graph columns.\n" if failed else ""))
    write_table(os.path.join(out_dir, "bench-gpu-cold"), title + ": first job in a fresh process",
                ["config", "steps", "batch", "load + warm-up s", "of it static steps s", "first job s", "second job s",
                 "first / second", "error"],
                [[c["config"], c["steps"], c["batch"], _f(c.get("load_s")), _f(c.get("capture_s")),
                  _f(c.get("first_s"), "{:.3f}"), _f(c.get("second_s"), "{:.3f}"),
                  _f(c["first_s"] / c["second_s"] if c.get("second_s") else None), c.get("error", "")]
                 for c in cold])
    return main


def _dtype(args) -> torch.dtype:
    from ..options import compute_type

    return compute_type(args).dtype


def cmd_bench_gpu(args) -> int:
    """``rayspec bench --suite gpu``."""
    if args.cold_run:
        return cold_child(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    random = args.random_weights
    if not random and not args.manifests:
        raise ValueError("--suite gpu needs a manifest (the real model's clips) or --random-weights")
    models = random_models(args.device, _dtype(args), size=args.random_size) if random else real_models(args)
    target = models[0]
    if random:
        target.set_ignore_eos(True)
    audios, refs = clips(args, target.sample_rate)
    cfgs = configs(args, random)
    batch_sizes = tuple(args.batch_sizes)
    max_batch = max(batch_sizes)
    os.makedirs(args.output, exist_ok=True)
    device = torch.cuda.get_device_name(target.device) if target.device.type == "cuda" else "cpu"
    import transformers

    env = dict(device=device, torch=torch.__version__, transformers=transformers.__version__,
               date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), command=" ".join(["rayspec", *sys.argv[1:]]),
               dtype=name_of(_dtype(args)), threads=torch.get_num_threads(), random_weights=random)
    with open(os.path.join(args.output, "gpu-env.json"), "w") as f:
        json.dump(env, f, indent=1)
    audio_s = sum(len(a) for a in audios) / target.sample_rate
    title = (f"gpu: {target.name}, {name_of(_dtype(args))}, {device}, {len(audios)} clips ({audio_s:.0f} s; batches >= "
             f"{BIG_BATCH} x{COPIES}), wall = best of {args.repeats}")
    rows, capture, peers, passes, cold = [], {}, [], [], []

    def write() -> str:
        env["capture_error"] = next((v["capture_error"] for v in capture.values() if v.get("capture_error")), "")
        env["fallback"] = "dynamic" if env["capture_error"] else ""
        env["steps"] = {k: {n: v[n] for n in ("seconds", "allocated", "reserved")} for k, v in capture.items()}
        with open(os.path.join(args.output, "gpu-env.json"), "w") as f:
            json.dump(env, f, indent=1)
        return write_tables(args.output, title, rows, peers, passes, cold, capture)

    # Stages by importance, the tables rewritten after each, so a run cut short (a device call's time limit) keeps
    # what it measured: warm rows, cold rows, transformers, pass costs, transformers + torch.compile last.
    for on in (True, False):  # graphs (or static) first, then dynamic: the same models, round-robin inside each
        stage = configs(args, random, rule=True) if on else cfgs  # the rule's rows with the steps on only (time)
        got, (label, info) = rayspec_rows(models, audios, refs, stage, batch_sizes, args.repeats, on, max_batch)
        rows += got
        capture[label] = info
        write()
    _set_steps(models, False, max_batch)
    methods = [m for m in args.cold_methods.split(",") if m and m in dict(cfgs)]
    cold += cold_rows(args, methods) if methods else []
    write()
    hf = (lambda variants: transformers_rows(target, audios, cfgs[0][1], batch_sizes, args.repeats, random,
                                             variants))
    peers += [] if args.no_hf else hf(HF_VARIANTS[:2])
    write()
    passes += pass_rows(target, audios[0], batch_sizes, max_batch)
    write()
    peers += [] if args.no_hf else hf(HF_VARIANTS[2:])
    print(write())
    return 0
