"""Recipes for the TTS zoo: ``rayspec train tts-target`` and ``rayspec train tts-draft``.

Target: teacher-forced cross-entropy on the coarse token of every frame + the fine codebooks of the depth head +
mean-squared error of ``log(1 + frames)`` per phone for the duration predictor; AdamW with warmup and cosine decay.
Draft: distilled from the target (soft cross-entropy against the target's teacher-forced distribution, i.e. the
KL divergence up to a constant; Leviathan et al. 2023 note acceptance grows as the draft approaches the target).
Both resume from ``<work-dir>`` after an interruption and log per epoch to ``<work-dir>/<kind>-log.jsonl``.
"""

from __future__ import annotations

import json
import math
import os
import random
import time
from dataclasses import dataclass

import numpy as np
import torch
from torch.nn import functional as F

from ..models.speech_lm import SpeechDraft, SpeechLM, frame_layout, histories, phone_windows
from ..tts.codec import coarse_tokens
from .tts_data import TTSExample, load_dir, prepare, split_dev


@dataclass
class TTSTrainOptions:
    """Options of both TTS recipes (sizes in frames of 20 ms)."""

    epochs: int = 60
    batch_frames: int = 6000
    lr: float = 1e-3
    warmup_steps: int = 200
    seed: int = 0
    threads: int = 2
    dropout: float = 0.1
    eval_every: int = 0  # steps between dev evaluations and checkpoints inside an epoch (0: once per epoch)


def _pad(arrays: list[np.ndarray], dtype=np.int64) -> torch.Tensor:
    n = max(len(a) for a in arrays)
    out = np.zeros((len(arrays), n, *arrays[0].shape[1:]), dtype=dtype)
    for i, a in enumerate(arrays):
        out[i, :len(a)] = a
    return torch.from_numpy(out)


def collate(examples: list[TTSExample], bos: int, context: int = 0) -> dict[str, torch.Tensor]:
    """Padded training tensors of a batch, zero-padded to the batch's longest row: per phone ``[B, P]`` (``phones``,
    ``phone_mask``, ``durations``), per frame ``[B, T]`` (the frame layout ``index`` / ``since`` / ``to_end``, the
    previous coarse token ``prev`` starting with ``bos``, the ``coarse`` targets, ``frame_mask``) and the ``fine``
    codebooks ``[B, T, 14]``; ``context > 0`` adds the draft's inputs, ``window`` ``[B, T, 3]`` and ``history`` ``[B, T, context]`` (see
    :class:`~rayspec.models.speech_lm.SpeechLM` and :class:`~rayspec.models.speech_lm.SpeechDraft`)."""
    layouts = [frame_layout(e.durations) for e in examples]
    coarse = [coarse_tokens(e.codes) for e in examples]
    batch = {
        "phones": _pad([e.phones for e in examples]),
        "phone_mask": _pad([np.ones(len(e.phones)) for e in examples]).bool(),
        "durations": _pad([e.durations for e in examples]),
        "index": _pad([lay[0] for lay in layouts]), "since": _pad([lay[1] for lay in layouts]),
        "to_end": _pad([lay[2] for lay in layouts]),
        "prev": _pad([np.concatenate([[bos], c[:-1]]) for c in coarse]),
        "coarse": _pad(coarse), "fine": _pad([e.codes[:, 2:] for e in examples]),
        "frame_mask": _pad([np.ones(len(c)) for c in coarse]).bool(),
    }
    if context:
        batch["window"] = _pad([phone_windows(e.phones, lay[0]) for e, lay in zip(examples, layouts)])
        batch["history"] = _pad([histories(c, context, bos) for c in coarse])
    return batch


def batches(examples: list[TTSExample], batch_frames: int, rng: random.Random | None = None) -> list[list[TTSExample]]:
    """Length-sorted batches of at most ``batch_frames`` padded frames (shuffled when ``rng`` is given)."""
    order = sorted(examples, key=lambda e: len(e.codes))
    out, cur = [], []
    for e in order:
        if cur and (len(cur) + 1) * len(e.codes) > batch_frames:
            out.append(cur)
            cur = []
        cur.append(e)
    if cur:
        out.append(cur)
    if rng:
        rng.shuffle(out)
    return out


def target_losses(model: SpeechLM, b: dict) -> dict[str, torch.Tensor]:
    """Coarse / fine / duration losses and coarse top-1 accuracy of one batch."""
    enc = model.encode_phones(b["phones"], b["phone_mask"])
    hidden = model(model.condition(enc, b["index"], b["since"], b["to_end"]), b["prev"])
    m = b["frame_mask"]
    logits = model.head(hidden)
    coarse = F.cross_entropy(logits[m], b["coarse"][m])
    fine_logits = model.fine_logits(hidden[m], b["coarse"][m], b["fine"][m])
    fine = F.cross_entropy(fine_logits.flatten(0, 1), b["fine"][m].flatten())
    pm = b["phone_mask"]
    dur = F.mse_loss(model.log_durations(enc)[pm], torch.log1p(b["durations"][pm].float()))
    acc = (logits[m].argmax(-1) == b["coarse"][m]).float().mean()
    return {"loss": coarse + fine + dur, "coarse": coarse, "fine": fine, "duration": dur, "top1": acc}


def _schedule(step: int, total: int, warmup: int) -> float:
    if step < warmup:
        return (step + 1) / warmup
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total - warmup))))


def _fit(kind: str, model, loss_fn, train, dev, out_dir: str, work_dir: str, opt: TTSTrainOptions,
         collate_fn) -> dict:
    """Shared loop: AdamW + warmup/cosine, JSONL log, and a dev evaluation plus a resumable checkpoint at the end of
    each epoch and every ``opt.eval_every`` steps (a resumed run redraws the epoch's batch order and skips the
    batches done). Each log row counts the hours of audio trained on so far, so the log is the learning curve. The
    model of the evaluation with the lowest dev loss is what ``out_dir`` gets."""
    torch.set_num_threads(opt.threads)
    os.makedirs(work_dir, exist_ok=True)
    rng = random.Random(opt.seed)
    torch.manual_seed(opt.seed)
    optim = torch.optim.AdamW(model.parameters(), lr=opt.lr, weight_decay=0.01)
    per_epoch = len(batches(train, opt.batch_frames))
    total = per_epoch * opt.epochs
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda s: _schedule(s, total, opt.warmup_steps))
    ckpt, log_path = os.path.join(work_dir, f"{kind}-checkpoint.pt"), os.path.join(work_dir, f"{kind}-log.jsonl")
    start, done, seen_frames = 0, 0, 0
    if os.path.exists(ckpt):
        state = torch.load(ckpt, weights_only=False)
        model.load_state_dict(state["model"])
        optim.load_state_dict(state["optim"])
        sched.load_state_dict(state["sched"])
        rng.setstate(state["rng"])
        start, done, seen_frames = state["epoch"], state.get("batches_done", 0), state.get("frames_seen", 0)
    best_path = os.path.join(work_dir, f"{kind}-best.pt")
    best = torch.load(best_path, weights_only=False) if os.path.exists(best_path) else {"loss": float("inf")}
    dev_batches = [collate_fn(bb) for bb in batches(dev, opt.batch_frames)]

    def evaluate() -> dict:
        model.eval()
        with torch.no_grad():
            rows = [{k: float(v) for k, v in loss_fn(model, bb).items()} for bb in dev_batches]
        model.train()
        return {k: round(float(np.mean([r[k] for r in rows])), 4) for k in rows[0]}

    def checkpoint(epoch: int, epoch_rng, batches_done: int, losses: list[float], t0: float) -> None:
        nonlocal best
        row = {"epoch": epoch + 1, "step": int(sched.last_epoch), "hours_seen": round(seen_frames / 50 / 3600, 3),
               "train_loss": round(float(np.mean(losses)), 4) if losses else None, "dev": evaluate(),
               "seconds": round(time.time() - t0, 1)}
        if row["dev"]["loss"] < best["loss"]:
            best = {"loss": row["dev"]["loss"], "epoch": epoch + 1, "step": row["step"], "model": model.state_dict()}
            torch.save(best, best_path + ".tmp")
            os.replace(best_path + ".tmp", best_path)
        with open(log_path, "a") as f:
            f.write(json.dumps(row) + "\n")
        print(json.dumps(row), flush=True)
        finished = batches_done == per_epoch
        torch.save({"model": model.state_dict(), "optim": optim.state_dict(), "sched": sched.state_dict(),
                    "rng": rng.getstate() if finished else epoch_rng, "epoch": epoch + finished,
                    "batches_done": 0 if finished else batches_done, "frames_seen": seen_frames}, ckpt + ".tmp")
        os.replace(ckpt + ".tmp", ckpt)

    for epoch in range(start, opt.epochs):
        t0 = time.time()
        model.train()
        losses: list[float] = []
        epoch_rng = rng.getstate()  # the batch order of this epoch is redrawn from it on resume
        for n, bb in enumerate(batches(train, opt.batch_frames, rng)):
            if n < done:
                continue
            out = loss_fn(model, collate_fn(bb))
            optim.zero_grad()
            out["loss"].backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optim.step()
            sched.step()
            losses.append(float(out["loss"].detach()))
            seen_frames += sum(len(e.codes) for e in bb)
            if opt.eval_every and (n + 1) % opt.eval_every == 0 and n + 1 < per_epoch:
                checkpoint(epoch, epoch_rng, n + 1, losses, t0)
        done = 0
        checkpoint(epoch, epoch_rng, per_epoch, losses, t0)
    if "model" in best:
        model.load_state_dict(best["model"])
    model.eval()
    model.save_pretrained(out_dir, torch.float16)  # loaded back as float32
    return {"dev": evaluate(), "best_epoch": best.get("epoch"), "best_step": best.get("step"),
            "train_clips": len(train), "dev_clips": len(dev), "hours_seen": round(seen_frames / 50 / 3600, 3)}


def training_data(sources: list[str], work_dir: str, codec_dir: str,
                  max_utterances: int | None = None) -> tuple[list[TTSExample], list[str]]:
    """The examples of ``sources``: ``rayspec train tts-data`` directories are read as they are; manifests of
    recordings are encoded and force-aligned once (:func:`~rayspec.train.tts_data.prepare`, cached in
    ``work_dir``). Returns ``(examples, failed)``."""
    dirs = [s for s in sources if os.path.isdir(s)]
    manifests = [s for s in sources if not os.path.isdir(s)]
    examples, failed = prepare(manifests, work_dir, codec_dir) if manifests else ([], [])
    for d in dirs:
        got, bad = load_dir(d)
        examples, failed = examples + got, failed + bad
    return examples[:max_utterances], failed


def train_tts_target(manifests: list[str], out_dir: str, work_dir: str, codec_dir: str, opt: TTSTrainOptions,
                     arch: dict | None = None, max_utterances: int | None = None,
                     init_dir: str | None = None) -> dict:
    """Train the TTS target on ``manifests`` (see :func:`training_data`; dev:
    :func:`~rayspec.train.tts_data.split_dev`); ``init_dir``: start from that target's weights and architecture (a
    warm restart: a new schedule in a new work directory)."""
    examples, failed = training_data(manifests, work_dir, codec_dir, max_utterances)
    train, dev = split_dev(examples)
    if not dev:  # smoke runs on a few clips
        train, dev = examples[1:], examples[:1]
    if init_dir:
        init = SpeechLM.from_pretrained(init_dir)
        model = SpeechLM(**{**init.config_dict(), "dropout": opt.dropout})
        model.load_state_dict(init.state_dict())
    else:
        model = SpeechLM(**(arch or {}), dropout=opt.dropout)
    summary = _fit("tts-target", model, target_losses, train, dev, out_dir, work_dir, opt,
                   lambda bb: collate(bb, model.bos))
    return {**summary, "skipped_clips": len(failed)}


def teacher_probs(target: SpeechLM, examples: list[TTSExample], batch_frames: int) -> dict[str, np.ndarray]:
    """The target's teacher-forced coarse distributions, float16 ``[T, n_coarse]`` per clip id."""
    out = {}
    with torch.no_grad():
        for bb in batches(examples, batch_frames):
            b = collate(bb, target.bos)
            enc = target.encode_phones(b["phones"], b["phone_mask"])
            probs = target.head(target(target.condition(enc, b["index"], b["since"], b["to_end"]), b["prev"]))
            probs = probs.softmax(-1).numpy().astype(np.float16)
            for i, e in enumerate(bb):
                out[e.id] = probs[i, :len(e.codes)]
    return out


def train_tts_draft(target_dir: str, manifests: list[str], out_dir: str, work_dir: str, codec_dir: str,
                    opt: TTSTrainOptions, arch: dict | None = None, max_utterances: int | None = None) -> dict:
    """Distil the TTS draft from the target at ``target_dir`` on the same clips."""
    examples, _ = training_data(manifests, work_dir, codec_dir, max_utterances)
    train, dev = split_dev(examples)
    if not dev:
        train, dev = examples[1:], examples[:1]
    target = SpeechLM.from_pretrained(target_dir)
    torch.set_num_threads(opt.threads)
    soft = teacher_probs(target, train + dev, opt.batch_frames)
    draft = SpeechDraft(**(arch or {}))

    def collate_draft(bb):
        b = collate(bb, target.bos, draft.context)
        b["teacher"] = _pad([soft[e.id] for e in bb], np.float32)
        return b

    def loss_fn(model: SpeechDraft, b: dict) -> dict:
        m = b["frame_mask"]
        logits = model(b["window"][m], b["since"][m], b["to_end"][m], b["history"][m])
        teacher = b["teacher"][m]
        soft_ce = -(teacher * logits.log_softmax(-1)).sum(-1).mean()
        # expected acceptance of token-level speculative sampling at temperature 1: sum_x min(p, q)
        accept = torch.minimum(teacher, logits.softmax(-1)).sum(-1).mean()
        return {"loss": soft_ce, "acceptance": accept,
                "top1_agree": (logits.argmax(-1) == teacher.argmax(-1)).float().mean()}

    return _fit("tts-draft", draft, loss_fn, train, dev, out_dir, work_dir, opt, collate_draft)
