"""``rayspec bench --suite spec|medusa|ssd``: decoders against AR, measured side by side in one run.

Suites:

* ``spec`` (SpecASR Table II ablation): AR greedy, fixed draft lengths, then adaptive drafting, recycling and the
  token tree added in turn, and (batch 1 only) transformers' assisted generation with the same draft.
* ``medusa`` (Whisper-Medusa): AR, the draft method, Medusa with 1-4 heads in use, three tree shapes and typical
  acceptance.
* ``ssd`` (SSD paper Figures 3-4): full AR, then CTC gating + verification + AR fallback over a grid of tau_CTC and
  tau_SLM, each single stage as an ablation (gate only + AR; verification only), the exact mode, and the CTC
  hypothesis as the draft of every round (``ctc-draft``).
* ``ssd-gate``: AR, then SSD at its defaults with each ``--tau-ctc``: the gate's trade-off (hypotheses accepted
  with no decoder pass, speed-up, WER).
* ``methods``: every method at its defaults with its bundled drafter, as ``rayspec transcribe`` runs it (the default
  row cap included), with each run's time split into the drafting side (features, encoders, CTC head) and the
  target side, and how much of the most a free decoder could gain each method reaches (the encoder bound).

Speculative configurations speculate at every batch size (``--speculate-max-rows all``), so a table shows what
batched verification costs and saves; the configurations marked ``+row cap`` run at the default instead (the speculation rule,
:mod:`rayspec.spec_decode.rule`: speculation only in rounds where it pays), as ``rayspec transcribe`` does.

Every configuration decodes the same preloaded audio with the same models through
:func:`rayspec.pipeline.decode_batch` (features, encoders and decoding timed; audio decoding excluded), after one
warm-up batch. Output in the folder: ``bench-<suite>.md`` (Markdown table), ``.csv`` and ``.png``.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, replace
from typing import Optional

import numpy as np
import torch
from tqdm import tqdm

from ..batching import BatchBudget, plan_batches
from ..decoding.common import DEFAULT_MAX_TOKENS_PER_SECOND, Hypothesis, token_cap
from ..decoding.medusa_proposer import SPARSE_TREE
from ..decoding.options import MedusaOptions, SSDOptions, SpeculationOptions
from ..metrics import error_rates
from ..compute import resolve, synchronize
from ..pipeline import DecodeOptions, decode_batch, encode_audio, stream_decode
from .tables import write_table

CONTINUOUS = " +continuous"
"""In a configuration's name: run with continuous batching (rows refilled from the next batch; batch sizes > 1)."""
ROW_CAP = " +row cap"
"""Suffix of a configuration run at the default ``--speculate-max-rows`` (the speculation rule; batch sizes > 1)."""
SSD_CTC = "ssd c=0.7 l=0.05 + ctc fallback"
"""The ssd suite's row of SSD with the CTC fallback (``--fallback ctc --tau-slm 0.05``)."""


def _draft(speculation: Optional[SpeculationOptions] = None) -> DecodeOptions:
    return DecodeOptions("draft", speculation=speculation, speculate_max_rows=0)


def _row_cap(configs: list[tuple[str, DecodeOptions]], names: tuple[str, ...]) -> list[tuple[str, DecodeOptions]]:
    """The configurations ``names`` again, at the default ``--speculate-max-rows`` (suffix :data:`ROW_CAP`)."""
    return [(name + ROW_CAP, replace(o, speculate_max_rows=None)) for name, o in configs if name in names]


FULL_VOCABULARY = dict(vocabulary=False)  # the rows before "+vocabulary": drafts read out over all 51,865 tokens
SPEC_ABLATION = [
    ("ar", DecodeOptions("ar")),
    ("fixed-4", _draft(SpeculationOptions(4, 0.0, recycle=False, **FULL_VOCABULARY))),
    ("fixed-8", _draft(SpeculationOptions(8, 0.0, recycle=False, **FULL_VOCABULARY))),
    ("fixed-16", _draft(SpeculationOptions(16, 0.0, recycle=False, **FULL_VOCABULARY))),
    ("+adaptive", _draft(SpeculationOptions(recycle=False, **FULL_VOCABULARY))),
    ("+recycle", _draft(SpeculationOptions(**FULL_VOCABULARY))),
    ("+vocabulary (default)", _draft()),
    ("+tree", _draft(SpeculationOptions(tree=True))),
    ("ar" + CONTINUOUS, DecodeOptions("ar")),
    ("+recycle" + CONTINUOUS, _draft(SpeculationOptions(**FULL_VOCABULARY))),
    ("+vocabulary (default)" + CONTINUOUS, _draft()),
    ("+tree" + CONTINUOUS, _draft(SpeculationOptions(tree=True))),
]
SPEC_ABLATION += _row_cap(SPEC_ABLATION, ("+vocabulary (default)", "+vocabulary (default)" + CONTINUOUS))


CHAIN_TREE = ((0,), (0, 0), (0, 0, 0), (0, 0, 0, 0))
WIDE_TREE = ((0,), (1,), (2,), (3,), (0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (2, 0), (0, 0, 0), (0, 0, 1), (0, 1, 0),
             (1, 0, 0), (0, 0, 0, 0), (0, 0, 0, 1))


def medusa_ablation(heads: Optional[str] = None, with_draft: bool = True) -> list[tuple[str, DecodeOptions]]:
    """AR, draft speculation (``with_draft``), Medusa by heads in use (the sparse tree cut to that depth; 1 head is
    the CPU default), by tree shape (a chain of top-1 candidates, a wide tree) and with typical acceptance; then
    continuous batching and the default row cap (:data:`ROW_CAP`) for AR, the draft method and default Medusa."""
    m = lambda **k: DecodeOptions("medusa", medusa=MedusaOptions(heads=heads, **k), speculate_max_rows=0)  # noqa: E731
    default = "medusa 1 head (default)"
    out = [("ar", DecodeOptions("ar"))] + ([("draft (default)", _draft())] if with_draft else [])
    out += [(default, m())]
    out += [(f"medusa {k} heads", m(tree=tuple(p for p in SPARSE_TREE if len(p) <= k))) for k in (2, 3)]
    out += [("medusa 4 heads (sparse tree)", m(tree=SPARSE_TREE)), ("medusa chain tree", m(tree=CHAIN_TREE)),
            ("medusa wide tree", m(tree=WIDE_TREE)), ("medusa typical", m(acceptance="typical"))]
    base = ("ar", "draft (default)", default)
    out += [(name + CONTINUOUS, o) for name, o in list(out) if name in base]
    return out + _row_cap(out, base[1:] + tuple(name + CONTINUOUS for name in base[1:]))


def ssd_grid(tau_ctc=(0.3, 0.7, 1.5, 3.0), tau_slm=(0.01, 0.1, 0.2)) -> list[tuple[str, DecodeOptions]]:
    """AR, the (tau_CTC, tau_SLM) grid in the paper's relaxed mode (AR fallback, unlike the CLI's default), the
    single-stage ablations, the CTC fallback, exact mode, and continuous batching for AR, the CTC fallback, the exact
    modes and ctc-draft (batch sizes > 1)."""
    ssd = lambda **k: DecodeOptions("ssd", ssd=SSDOptions(**{"fallback": "ar", **k}),  # noqa: E731
                                    speculate_max_rows=0)
    out = [("ar", DecodeOptions("ar"))]
    out += [(f"ssd c={c} l={s}", ssd(tau_ctc=c, tau_slm=s, exact=False)) for c in tau_ctc for s in tau_slm]
    out += [(f"gate only c={c} + AR", ssd(tau_ctc=c, verify=False)) for c in tau_ctc]
    out += [(f"verify only l={s}", ssd(tau_ctc=0.0, tau_slm=s, exact=False)) for s in tau_slm]
    out += [(SSD_CTC, ssd(tau_ctc=0.7, tau_slm=0.05, exact=False, fallback="ctc")),
            ("ssd exact (c=0)", ssd(tau_ctc=0.0, exact=True)), ("ssd exact + draft fallback",
            ssd(tau_ctc=0.0, exact=True, fallback="draft")),
            ("ctc-draft (exact)", DecodeOptions("ctc-draft", speculate_max_rows=0))]
    # Section 3.2 across the corpus (rows that fail verification pooled into one fallback stream), for the CTC
    # fallback and the exact modes, beside AR and ctc-draft with the same continuous batching.
    out += [(name + CONTINUOUS, o) for name, o in list(out) if name in (
        "ar", SSD_CTC, "ssd exact (c=0)", "ssd exact + draft fallback", "ctc-draft (exact)")]
    return out + _row_cap(out, (SSD_CTC, "ssd exact + draft fallback", "ctc-draft (exact)",
                                SSD_CTC + CONTINUOUS, "ssd exact + draft fallback" + CONTINUOUS,
                                "ctc-draft (exact)" + CONTINUOUS))


def method_defaults(heads: Optional[str] = None, names: Optional[list[str]] = None) -> list[tuple[str, DecodeOptions]]:
    """The ``methods`` suite: each method with its defaults (Medusa with the heads in ``heads``, default the
    target's bundled ones); ssd's defaults are lossy, ``ssd exact`` is ``--exact --tau-ctc 0``.

    Args:
        names: only these rows (``ar`` always comes first); None: all.

    Raises:
        ValueError: a name that is no row of the suite.
    """
    rows = [("ar", DecodeOptions("ar")), ("draft", DecodeOptions("draft")),
            ("medusa", DecodeOptions("medusa", medusa=MedusaOptions(heads=heads))),
            ("ctc-draft", DecodeOptions("ctc-draft")), ("ssd (lossy)", DecodeOptions("ssd")),
            ("ssd exact", DecodeOptions("ssd", ssd=SSDOptions(tau_ctc=0.0, exact=True)))]
    if names is None:
        return rows
    unknown = set(names) - {name for name, _ in rows}
    if unknown:
        raise ValueError(f"unknown methods rows {sorted(unknown)}; choose from {', '.join(n for n, _ in rows)}")
    return [r for r in rows if r[0] == "ar" or r[0] in names]


def ssd_gate(tau_ctc) -> list[tuple[str, DecodeOptions]]:
    """The ``ssd-gate`` suite: AR, then SSD at its defaults with each gate threshold ``tau_ctc`` (nats; the trade-off
    of hypotheses accepted with no decoder pass against WER)."""
    return [("ar", DecodeOptions("ar"))] + [(f"ssd c={c}", DecodeOptions("ssd", ssd=SSDOptions(tau_ctc=c)))
                                            for c in tau_ctc]


@dataclass
class BenchRow:
    config: str
    batch_size: int
    utterances: int
    audio_s: float
    wall_s: float
    nfe_per_utt: float
    draft_passes_per_utt: float
    mean_accepted_length: float
    acceptance_rate: float
    identical_to_ar: int
    wer: Optional[float] = None
    routes: Optional[dict] = None
    rtfx: float = 0.0
    speedup: float = 0.0
    nfe_reduction: float = 0.0
    encode_s: float = 0.0  # of the run counted: the drafting side (features, encoders, CTC head)
    decode_s: float = 0.0  # the target side (decoding, draft passes included); none for hf-assisted


def _hf_assisted(target, draft, audio, cap) -> Hypothesis:
    """transformers' assisted generation (batch 1 only) with our draft; counts target passes via a forward hook."""
    from transformers import GenerationMixin
    from transformers.modeling_outputs import BaseModelOutput

    feats, lengths = target.features([audio])
    enc = target.encode(feats, lengths)
    dfeats = feats
    calls = {"n": 0}
    hook = target.model.register_forward_hook(lambda *_: calls.__setitem__("n", calls["n"] + 1))
    encoder = original = None
    if draft.has_encoder:
        # The draft's transformers encoder insists on a 30 s window; at batch 1 our adapter's encoder is the same
        # computation on the unpadded input, so the assistant's encoder is routed through it. (A decoder-only draft
        # reads the target's encoder outputs, as transformers does for distil-whisper's assistant decoders.)
        dfeats, dlengths = draft.features([audio])
        encoder = draft.model.model.encoder
        original = encoder.forward
        encoder.forward = lambda input_features, *a, **k: BaseModelOutput(
            last_hidden_state=draft.encode(input_features, dlengths).states)
    try:
        out = GenerationMixin.generate(
            target.model, input_features=dfeats, encoder_outputs=BaseModelOutput(last_hidden_state=enc.states),
            decoder_input_ids=torch.tensor([target.prompt_ids], device=target.device), assistant_model=draft.model,
            max_new_tokens=cap + 1, do_sample=False, suppress_tokens=target.suppress_tokens,
            begin_suppress_tokens=target.begin_suppress_tokens, eos_token_id=target.eos_token_id,
            pad_token_id=target.eos_token_id,
        )
    finally:
        if encoder is not None:
            encoder.forward = original
        hook.remove()
    ids = out[0, len(target.prompt_ids):].tolist()
    finished = target.eos_token_id in ids
    ids = ids[: ids.index(target.eos_token_id)] if finished else ids[:cap]
    h = Hypothesis(ids, finished, "hf-assisted")
    h.stats.target_forward_passes = calls["n"]
    return h


def _run(name, options, models, audios, durations, batches, timings: dict) -> list[Hypothesis]:
    """Decode ``batches`` (lists of indices into ``audios``) with configuration ``name``; adds the drafting side's
    and the target side's seconds to ``timings`` (``"encode"``, ``"decode"``)."""
    target, draft, ctc = models
    out: dict[int, Hypothesis] = {}
    if CONTINUOUS in name:  # the same batches, longest first, as one continuous batch (run_corpus's order)
        order = batches[::-1]

        spent = [0.0]  # seconds in encode_audio, which the stream calls as it needs rows

        def encoded():
            for k, b in enumerate(order):
                t0 = time.perf_counter()
                e = encode_audio(target, options, [audios[i] for i in b], [durations[i] for i in b], draft, ctc)
                synchronize(target.device)  # the encoder's GPU work is the encode side's
                spent[0] += time.perf_counter() - t0
                yield k, e

        t0 = time.perf_counter()
        for (k, r), h in stream_decode(target, options, encoded(), max(len(b) for b in batches), draft):
            out[order[k][r]] = h
        synchronize(target.device)
        timings["encode"] = timings.get("encode", 0.0) + spent[0]
        timings["decode"] = timings.get("decode", 0.0) + time.perf_counter() - t0 - spent[0]
        return [out[i] for i in range(len(audios)) if i in out]
    for batch in batches:
        a = [audios[i] for i in batch]
        if name == "hf-assisted":
            limit = target.max_target_positions - len(target.prompt_ids) - 1
            hyps = [_hf_assisted(target, draft, a[0], token_cap(durations[batch[0]], DEFAULT_MAX_TOKENS_PER_SECOND,
                                                                 limit))]
        else:
            hyps = decode_batch(target, options, a, [durations[i] for i in batch], draft, ctc, timings)
        out.update(zip(batch, hyps))
    return [out[i] for i in range(len(audios)) if i in out]  # all of them, except in a warm-up


def run_bench(models, audios, references, configs, batch_sizes=(1, 16), hf_assisted=False, progress=True,
              repeats: int = 1, keep: Optional[dict] = None):
    """Run ``configs`` (name, :class:`~rayspec.decoding.options.DecodeOptions`; the first must be AR) at each batch size.

    Args:
        models: ``(target, draft or None, ctc head or None)``.
        audios: float32 waveforms at the target's sample rate; references: their transcripts (or None).
        repeats: timed runs per configuration after the warm-ups, taken round-robin over the configurations; the
            fastest of each counts (as ``timeit`` does: slower runs measure the machine's interference, not the
            decoder).
        keep: if given, filled with each configuration's hypotheses (by name; of the last batch size).

    Returns:
        :class:`BenchRow` s; speed-ups and NFE reductions are relative to the AR row of the same batch size.
    """
    target = models[0]
    durations = [len(a) / target.sample_rate for a in audios]
    rows: list[BenchRow] = []
    for bs in batch_sizes:
        batches = plan_batches(list(range(len(audios))), durations, BatchBudget(tokens=10**9, max_rows=bs))
        todo = [c for c in configs if bs > 1 or not (CONTINUOUS in c[0] or c[0].endswith(ROW_CAP))]  # the same at 1
        todo += [("hf-assisted", None)] if hf_assisted and bs == 1 else []
        for name, options in todo:
            _run(name, options, models, audios, durations, batches[:1], {})  # warm-up
        # Repeats go round-robin over the configurations, so a slow phase of the machine costs every configuration
        # one run rather than all the runs of one configuration; the fastest run of each counts (with its split).
        walls, results, splits = {name: float("inf") for name, _ in todo}, {}, {}
        for _ in tqdm(range(repeats), desc=f"bench batch {bs}", disable=not progress):
            for name, options in todo:
                timings: dict = {}
                t0 = time.perf_counter()
                results[name] = _run(name, options, models, audios, durations, batches, timings)
                wall = time.perf_counter() - t0
                if wall < walls[name]:
                    walls[name], splits[name] = wall, timings
        if keep is not None:
            keep.update(results)
        reference = None
        for name, _ in todo:
            hyps, wall = results[name], walls[name]
            if reference is None:
                reference = [h.tokens for h in hyps]
            st = [h.stats for h in hyps]
            n, rounds = len(hyps), sum(s.rounds for s in st)
            proposed = sum(s.draft_tokens_proposed for s in st)
            accepted = sum(s.draft_tokens_accepted for s in st)
            wer = None
            if references and all(references):
                wer = error_rates(references, [target.decode_text(h.tokens) for h in hyps]).wer
            routes = {}
            for h in hyps:
                routes[h.route] = routes.get(h.route, 0) + 1
            rows.append(BenchRow(
                name, bs, n, sum(durations), wall, sum(s.target_forward_passes for s in st) / n,
                sum(s.draft_forward_passes for s in st) / n, (accepted + rounds) / rounds if rounds else 1.0,
                accepted / proposed if proposed else 0.0, sum(h.tokens == r for h, r in zip(hyps, reference)),
                wer, routes, encode_s=splits[name].get("encode", 0.0), decode_s=splits[name].get("decode", 0.0),
            ))
        base = next(r for r in rows if r.batch_size == bs and r.config == "ar")
        for r in rows:
            if r.batch_size == bs:
                r.rtfx = r.audio_s / r.wall_s
                r.speedup = base.wall_s / r.wall_s
                r.nfe_reduction = base.nfe_per_utt / r.nfe_per_utt if r.nfe_per_utt else float("inf")
    return rows


def _bound_cells(r: BenchRow, ar: BenchRow) -> list[str]:
    """The encoder bound of a row, AR's wall time over the row's drafting side alone (its speed-up with a free target
    side), and the share of it the row reaches: (speed-up - 1) / (bound - 1)."""
    if not r.encode_s:
        return ["-", "-"]
    bound = ar.wall_s / r.encode_s
    return [f"{bound:.2f}x", "-" if r is ar or bound <= 1 else f"{100 * (r.speedup - 1) / (bound - 1):.0f}%"]


def _cells(r: BenchRow, suite: str, ar: BenchRow) -> list:
    ar_wer = ar.wer
    pct = lambda k: f"{100 * (r.routes or {}).get(k, 0) / r.utterances:.0f}"  # noqa: E731
    common = [r.config, r.batch_size, r.utterances, f"{r.nfe_per_utt:.2f}", f"{r.nfe_reduction:.2f}x"]
    tail = [f"{r.wall_s:.2f}", f"{r.rtfx:.1f}", f"{r.speedup:.2f}x", f"{r.identical_to_ar}/{r.utterances}"]
    if suite in ("spec", "medusa"):
        return common + [f"{r.draft_passes_per_utt:.2f}", f"{r.mean_accepted_length:.2f}",
                         f"{r.acceptance_rate:.3f}"] + tail + ["-" if r.wer is None else f"{100 * r.wer:.2f}"]
    rel = "-" if r.wer is None or not ar_wer else f"{100 * (r.wer - ar_wer) / ar_wer:+.1f}%"
    if suite == "methods":
        decode = "-" if r.decode_s == 0 else f"{ar.decode_s / r.decode_s:.2f}x"
        return common + [f"{r.encode_s:.2f}", f"{r.decode_s:.2f}", f"{r.wall_s:.2f}", f"{r.rtfx:.1f}", decode,
                         f"{r.speedup:.2f}x"] + _bound_cells(r, ar) + [
            f"{r.identical_to_ar}/{r.utterances}", "-" if r.wer is None else f"{100 * r.wer:.2f}", rel]
    return common + [pct("ctc"), pct("verified"), pct("fallback"),
                     "-" if r.wer is None else f"{100 * r.wer:.2f}", rel] + tail


SPEC_HEADER = ["config", "batch", "utts", "NFE/utt", "NFE reduction", "draft passes/utt", "mean accepted length",
               "acceptance rate", "wall s", "RTFx", "speed-up vs AR", "identical to AR", "WER %"]
HEADERS = {
    "spec": SPEC_HEADER,
    "medusa": SPEC_HEADER,
    "ssd": ["config", "batch", "utts", "NFE/utt", "NFE reduction", "%C (gate)", "%L (verified)", "%fallback",
            "WER %", "WER vs AR", "wall s", "RTFx", "speed-up vs AR", "identical to AR"],
    "methods": ["method", "batch", "utts", "NFE/utt", "NFE reduction", "encode s", "decode s", "wall s", "RTFx",
                "decode speed-up vs AR", "speed-up vs AR", "bound (free decode)", "share of bound",
                "identical to AR", "WER %", "WER vs AR"],
}
METHODS_NOTES = (
    "\n- encode s: the drafting side of the counted run (log-mel features, the target's encoder over its 30 s "
    "windows, the CTC head where the method reads one); decode s: the target side (target passes, draft passes, "
    "verification). bound (free decode): AR's wall time over the row's encode s, the speed-up the method would "
    "reach if its target side cost nothing; share of bound: (speed-up - 1) / (bound - 1).\n")


def write_outputs(rows: list[BenchRow], out_dir: str, title: str, suite: str, notes: str = "") -> str:
    """Write ``bench-<suite>.md`` (table, then ``notes``), ``.csv`` and ``.png`` to ``out_dir``; returns the
    Markdown."""
    os.makedirs(out_dir, exist_ok=True)
    header = HEADERS[suite]
    cells = []
    for r in rows:
        ar = next(x for x in rows if x.batch_size == r.batch_size and x.config == "ar")
        cells.append(_cells(r, suite, ar))
    stem = os.path.join(out_dir, f"bench-{suite}")
    text = write_table(stem, title, header, cells, notes)
    _plot(rows, stem + ".png", title, suite)
    return text


@torch.inference_mode()
def decoder_pass_ms(model, encoder_output, batch: int, passes: int = 200, project: bool = True) -> float:
    """Mean wall time in milliseconds of one decoder pass of ``model`` over one new token per row, ``batch`` rows
    that all read ``encoder_output``'s first row (the best of 3 runs of ``passes`` passes, after a warm-up run; each
    run ends with a device synchronisation on CUDA), read out as decoding does with ``project``: over the model's own
    vocabulary where it lists one (a draft's), else all tokens; without ``project``, the decoder layers alone."""
    enc = encoder_output.select(torch.zeros(batch, dtype=torch.long, device=encoder_output.states.device))
    cache = model.new_cache(enc, passes + 1)
    tokens = torch.full((batch, 1), model.prompt_ids[0], device=model.device)
    kept, times, first = np.zeros((batch, 1), dtype=np.int64), [], np.zeros(batch, dtype=bool)
    for _ in range(4):
        cache.crop([0] * batch)
        synchronize(model.device)
        t0 = time.perf_counter()
        for _ in range(passes):
            hidden = model.decode_hidden(cache, tokens)[:, 0]
            if project:
                model.readout_logits(hidden, first) if model.vocabulary else model.project(hidden)
            cache.commit(kept, np.ones(batch, dtype=np.int64))
        synchronize(model.device)
        times.append((time.perf_counter() - t0) / passes)
    return 1e3 * min(times[1:])  # the first run is the warm-up


def pass_time_notes(target, draft, audio) -> str:
    """A Markdown line: target and draft decoder pass times at batch 1 and 16 over ``audio``'s encoder states (the
    fastest of three alternating measurements each)."""
    with torch.inference_mode():
        enc = target.encode(*target.features([audio]))
        denc = draft.encode(*draft.features([audio])) if draft.has_encoder else enc
    cells = []
    for bs in (1, 16):
        t = d = float("inf")
        for _ in range(3):  # alternating, so that a slow phase of the machine does not fall on one model only
            t, d = min(t, decoder_pass_ms(target, enc, bs)), min(d, decoder_pass_ms(draft, denc, bs))
        cells.append(f"batch {bs}: target {t:.2f} ms, draft {d:.2f} ms (**{t / d:.1f}x**)")
    return (f"\nDecoder pass time (one token per row, {len(audio) / target.sample_rate:.1f} s utterance, same "
            f"threads): {'; '.join(cells)}.\n")


def plot_head_accuracy(target, heads_dir: str, utterances, out_dir: str) -> list[float]:
    """Per-head top-1 agreement of Medusa heads with the target's own tokens on ``utterances``; written to
    ``bench-medusa-heads.png`` (and returned)."""
    from ..decoding.medusa_proposer import load_heads
    from ..train.medusa import head_accuracy

    acc = head_accuracy(target, load_heads(heads_dir, str(target.device), target.dtype), utterances)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return acc
    os.makedirs(out_dir, exist_ok=True)
    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.plot(range(1, len(acc) + 1), [100 * a for a in acc], marker="o")
    ax.set_xlabel("head k (predicts the k-th token after the target's next)")
    ax.set_ylabel("top-1 agreement with the target %")
    ax.set_xticks(range(1, len(acc) + 1))
    ax.set_title(f"Medusa heads on {len(utterances)} utterances", fontsize=9)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "bench-medusa-heads.png"), dpi=120)
    return acc


def _plot(rows, path, title, suite) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    if suite in ("spec", "medusa", "methods"):  # one line per configuration (long names), top to bottom in table order
        configs = list(dict.fromkeys(r.config for r in rows))
        fig, axes = plt.subplots(1, 2, figsize=(12, 1.5 + 0.28 * len(configs)), sharey=True)
        for bs in sorted({r.batch_size for r in rows}):
            sub = [r for r in rows if r.batch_size == bs]
            y = [configs.index(r.config) for r in sub]
            axes[0].plot([r.speedup for r in sub], y, marker="o", ls="none", label=f"batch {bs}")
            axes[1].plot([r.nfe_per_utt for r in sub], y, marker="o", ls="none", label=f"batch {bs}")
        axes[0].axvline(1.0, color="gray", lw=0.8)
        axes[0].set_xlabel("wall-clock speed-up vs AR")
        axes[1].set_xlabel("target passes (NFE) per utterance")
        axes[0].set_yticks(range(len(configs)), configs, fontsize=8)
        axes[0].invert_yaxis()
        for ax in axes:
            ax.grid(axis="y", lw=0.3)
            ax.legend()
    else:  # WER vs RTFx Pareto plot with AR marked (SSD Figures 3-4)
        fig, ax = plt.subplots(figsize=(7, 5))
        for r in rows:
            if r.wer is None:
                continue
            style = {"marker": "*", "s": 160, "color": "red"} if r.config == "ar" else {"marker": "o", "s": 30}
            ax.scatter(r.rtfx, 100 * r.wer, **style)
            ax.annotate(r.config, (r.rtfx, 100 * r.wer), fontsize=6)
        ax.set_xlabel("RTFx (audio s / processing s)")
        ax.set_ylabel("WER %")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def cmd_bench_asr(args) -> int:
    """``rayspec bench --suite spec|medusa|ssd|methods``."""
    if not args.manifests:
        raise ValueError(f"--suite {args.suite} needs at least one manifest")
    from ..audio import load_audio
    from ..manifest import read_manifest
    from ..models.ctc import CTCHead
    from ..models.whisper import WhisperASR
    from ..models.registry import DRAFTERS, default_drafter

    if args.threads:
        torch.set_num_threads(args.threads)
    ctype = resolve("float32" if args.compute_type == "auto" else args.compute_type, args.device)
    target = WhisperASR.from_pretrained(args.target, args.device, ctype.dtype).pack_for_inference()
    draft = None
    if args.suite != "ssd-gate" and (args.draft or args.suite != "medusa" or
                                     target.name in DRAFTERS and "draft" in DRAFTERS[target.name]):
        draft = WhisperASR.from_pretrained(args.draft or default_drafter(target.name, "draft"), args.device,
                                           ctype.dtype).pack_for_inference()
    ctc = (CTCHead.from_pretrained(args.ctc or default_drafter(target.name, "ctc"), args.device).to(ctype.dtype)
           if args.suite in ("ssd", "methods", "ssd-gate") else None)
    utts = [u for m in args.manifests for u in read_manifest(m)]
    if args.limit:
        utts = utts[: args.limit]
    audios = [load_audio(u.audio, target.sample_rate) for u in tqdm(utts, desc="audio")]
    if args.suite == "spec":
        configs = SPEC_ABLATION
        if args.max_draft:
            configs = [(n, o if o.method == "ar" or n.startswith("fixed") else
                        replace(o, speculation=replace(o.speculation, max_draft=args.max_draft))) for n, o in configs]
    elif args.suite == "medusa":
        configs = medusa_ablation(args.medusa, with_draft=draft is not None)
        plot_head_accuracy(target, args.medusa or default_drafter(target.name, "medusa"), utts, args.output)
    elif args.suite == "methods":
        configs = method_defaults(args.medusa, args.methods.split(",") if args.methods else None)
    elif args.suite == "ssd-gate":
        configs = ssd_gate(tuple(args.tau_ctc))
    else:
        configs = ssd_grid(tuple(args.tau_ctc), tuple(args.tau_slm))
    rows = run_bench((target, draft, ctc), audios, [u.text for u in utts], configs, tuple(args.batch_sizes),
                     hf_assisted=args.suite == "spec" and not args.no_hf, repeats=args.repeats)
    helper = {"spec": draft.name if draft else "", "ssd": "ctc", "ssd-gate": "ctc", "medusa": "medusa heads",
              "methods": "the bundled drafters"}[args.suite]
    title = (f"{args.suite}: {target.name} + {helper} on "
             f"{', '.join(os.path.basename(os.path.dirname(os.path.abspath(m))) for m in args.manifests)} "
             f"({len(audios)} utterances, {sum(len(a) for a in audios) / target.sample_rate:.0f} s audio), "
             f"{args.device}, {ctype.name}, {torch.get_num_threads()} threads"
             + (f", wall = best of {args.repeats} runs" if args.repeats > 1 else ""))
    notes = (pass_time_notes(target, draft, audios[0]) if args.suite == "spec" else
             METHODS_NOTES if args.suite == "methods" else "")
    print(write_outputs(rows, args.output, title, "ssd" if args.suite == "ssd-gate" else args.suite, notes))
    return 0
