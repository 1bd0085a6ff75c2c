"""``rayspec train draft-decoder``: a shallow Whisper decoder over the frozen target's encoder, distilled from it.

The draft is distil-whisper's assistant form (Gandhi et al. 2023, "Distil-Whisper", arXiv:2311.00430, sections 3
and 4.4): a ``WhisperForCausalLM`` with the target's width, a few decoder layers copied from the target's (maximally
spaced: the first, then the last), and no encoder of its own: at decode time it reads the target's encoder states
(the whole 30 s window of a stock Whisper), so drafting costs decoder passes only. It shares the target's token
embedding and output projection (frozen, not shipped: :func:`export_draft_decoder`). Training:

1. Teacher pass (``<work_dir>/teacher.pt`` when it is small enough to cache): for every training utterance at each
   speed (0.9/1.0/1.1) and every dev utterance (1.0), the target's encoder states (computed from the audio exactly
   as at decode time) and its greedy transcript.
2. Student loss (Distil-Whisper eq. 3): ``kl_weight * KL(p_target || p_draft) + CE(pseudo-label)``, the pseudo-label
   being the target's greedy token (word- and sequence-level distillation, Kim & Rush 2016, arXiv:1606.07947); the
   target's teacher-forced distribution is computed per batch (Whisper's suppress lists applied, as at decode
   time). Only the draft's layers, positions and final norm train; AdamW with warm-up and cosine decay; TF32
   matrix products on a GPU; a resumable checkpoint and a log line per epoch with the dev top-1 agreement
   (teacher-forced: how often the draft's argmax is the target's greedy token, the quantity acceptance rests on).
"""

from __future__ import annotations

import copy
import json
import os
import random
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from ..audio import AudioError, load_audio
from ..decoding.ar import greedy_decode
from ..manifest import Utterance
from ..models.encoded import EncoderOutput
from ..models.whisper import WhisperASR
from ..models.whisper_loading import EMBEDDING_KEY
from .data import SPEEDS, frozen_teacher, perturb_speed, teacher_batch
from .recipe import length_batches, warmup_cosine

RAYSPEC_FEATURE_KEYS = ("rayspec_encoder_masking", "rayspec_frame_stack", "rayspec_feature_mean", "rayspec_feature_std")
"""Config entries of the target's front-end, meaningless for a decoder without an encoder (dropped from its config)."""
CACHE_FORMAT = 2
"""Format of ``teacher.pt`` and ``checkpoint.pt`` (2: whole-window states, no cached distributions, frozen embedding);
an older work directory's files are recomputed, not misread."""
TEACHER_CACHE_BYTES = 4 << 30
"""Largest teacher pass cached to ``<work_dir>/teacher.pt`` (a stock Whisper's states are 1,500 x d per utterance)."""


@dataclass
class TeacherRecord:
    """The target on one utterance (one speed).

    Attributes:
        states: float16 ``[S, D]`` encoder states on the training device (a masking target: its real positions; a
            fixed-window target: the whole window).
        real: real (non-padding) encoder positions.
        tokens: int64 ``[L]`` the target's greedy transcript, followed by EOS when it finished.
        masked: whether the target masks padding (:attr:`EncoderOutput.masked`).
    """

    states: torch.Tensor
    real: int
    tokens: torch.Tensor
    masked: bool


def _audio(path: str, sample_rate: int, speed: float) -> Optional[np.ndarray]:
    """The waveform at ``speed``, or None when the file cannot be read (the teacher pass skips it)."""
    try:
        return perturb_speed(load_audio(path, sample_rate), sample_rate, speed)
    except (AudioError, OSError):
        return None


@torch.no_grad()  # not inference_mode: the states feed the student's autograd graph
def teacher_pass(target: WhisperASR, utterances: list[Utterance], speeds: tuple[float, ...], batch: int = 16,
                 cap: int = 200, workers: int = 2, whole_window: bool = True) -> list[TeacherRecord]:
    """:class:`TeacherRecord` s of ``utterances`` at each speed factor in ``speeds`` (speed-major order), on
    ``target.device``: features and encoder exactly as at decode time (:meth:`WhisperASR.features`), then the
    target's greedy decode (at most ``cap`` tokens, and at most one per two log-mel frames). Audio decoding and
    log-mel features run on ``workers`` threads. ``whole_window=False`` keeps only the real positions of a
    fixed-window target's states (what a CTC head reads)."""
    eos, out = target.eos_token_id, []
    sr, most = target.sample_rate, int(target.max_audio_seconds * target.sample_rate)
    with ThreadPoolExecutor(workers) as pool:
        for speed in speeds:
            audios = list(tqdm(pool.map(lambda u: _audio(u.audio, sr, speed), utterances), total=len(utterances),
                               desc=f"audio x{speed}", leave=False))
            order = sorted((i for i, a in enumerate(audios) if a is not None and 0 < len(a) <= most),
                           key=lambda i: len(audios[i]))
            if len(order) < len(audios):
                print(f"teacher pass x{speed}: {len(audios) - len(order)} of {len(audios)} utterances skipped "
                      f"(unreadable, empty, or over the model's {target.max_audio_seconds:g} s)", flush=True)
            got: dict[int, TeacherRecord] = {}
            for k in tqdm(range(0, len(order), batch), desc=f"teacher pass x{speed}"):
                idx = order[k : k + batch]
                x, xl = target.features([audios[i] for i in idx], pool.map)  # log-mel on `workers` threads
                enc = target.encode(x, xl)
                hyps = greedy_decode(target, enc, [min(cap, int(n) // 2) for n in xl])
                for r, (i, h) in enumerate(zip(idx, hyps)):
                    real = int(enc.lengths[r])
                    cut = real if enc.masked or not whole_window else None
                    states = enc.states[r, :cut].to(torch.float16).clone()
                    tokens = h.tokens + ([eos] if h.finished else [])
                    if tokens:  # a row with nothing to learn (no token, no EOS) is left out
                        got[i] = TeacherRecord(states, real, torch.tensor(tokens, dtype=torch.long), enc.masked)
            out += [got[i] for i in sorted(got)]
    return out


def new_draft_decoder(target: WhisperASR, layers: int, dropout: float) -> WhisperASR:
    """A ``WhisperForCausalLM`` with the target's width, tokenizer and generation config, its ``layers`` decoder
    layers copied from the target's maximally spaced ones (Distil-Whisper section 4.4), position embeddings and
    final layer norm from the target, and the target's token embedding (tied to the output projection), frozen.

    Raises:
        ValueError: ``layers`` outside ``1 .. target decoder layers``.
    """
    from transformers import WhisperForCausalLM

    n_t = target.config.decoder_layers
    if not 1 <= layers <= n_t:
        raise ValueError(f"a draft decoder has 1 to {n_t} layers (the target's), not {layers}")
    cfg = copy.deepcopy(target.config)
    for key in RAYSPEC_FEATURE_KEYS:
        if hasattr(cfg, key):
            delattr(cfg, key)
    cfg.decoder_layers = layers
    cfg.dropout, cfg.attention_dropout, cfg.activation_dropout = dropout, dropout * 2 / 3, dropout * 2 / 3
    cfg.architectures = ["WhisperForCausalLM"]
    student = WhisperForCausalLM(cfg).to(target.device)
    src, dst = target.model.model.decoder, student.model.decoder
    for name in ("embed_tokens", "embed_positions", "layer_norm"):
        getattr(dst, name).load_state_dict(getattr(src, name).state_dict())
    picks = [round(i * (n_t - 1) / max(1, layers - 1)) for i in range(layers)]
    for i, j in enumerate(picks):
        dst.layers[i].load_state_dict(src.layers[j].state_dict())
    student.tie_weights()
    dst.embed_tokens.weight.requires_grad_(False)
    return WhisperASR(student, None, target.tokenizer, copy.deepcopy(target.generation_config),
                      name=f"{target.name}-draft-decoder")


def _batch_loss(student: WhisperASR, target: Optional[WhisperASR], records: list[TeacherRecord], kl_weight: float):
    """Distillation loss over a batch (the KL term needs ``target``) and its ``(agreeing, total)`` top-1 counts."""
    p, eos, dev = len(student.prompt_ids), student.eos_token_id, student.device
    widest = max(r.states.shape[0] for r in records)
    states = records[0].states.new_zeros(len(records), widest, records[0].states.shape[1])
    for i, r in enumerate(records):
        states[i, : r.states.shape[0]] = r.states
    enc = EncoderOutput(states.to(student.dtype), torch.tensor([r.real for r in records], device=dev),
                        masked=records[0].masked)
    width = max(len(r.tokens) for r in records)
    inp = torch.full((len(records), p + width - 1), eos, dtype=torch.long)
    valid = torch.zeros(len(records), width, dtype=torch.bool)
    for i, r in enumerate(records):
        inp[i, :p] = torch.tensor(student.prompt_ids)
        inp[i, p : p + len(r.tokens) - 1] = r.tokens[:-1]
        valid[i, : len(r.tokens)] = True
    inp, valid = inp.to(dev), valid.to(dev)
    labels = torch.cat([r.tokens for r in records]).to(dev)
    logits = student.decode(student.new_cache(enc, inp.shape[1]), inp)[:, p - 1 :][valid].float()  # [N, V]
    loss = F.cross_entropy(logits, labels)
    if kl_weight:
        with torch.no_grad():
            t = target.decode(target.new_cache(enc, inp.shape[1]), inp)[:, p - 1 :].float()
            first = torch.zeros(valid.shape, dtype=torch.bool, device=dev)
            first[:, 0] = True
            probs = target.suppress(t, first).softmax(-1)[valid]
        loss = loss + kl_weight * F.cross_entropy(logits, probs)
    return loss, (int((logits.argmax(-1) == labels).sum()), len(labels))


def cached_teacher_pass(target: WhisperASR, train_utts, dev_utts, work_dir: str, speeds: tuple[float, ...],
                        batch: int, workers: int, whole_window: bool = True):
    """The teacher pass (:func:`teacher_pass`) over training (every speed) and dev (1.0) utterances, from
    ``<work_dir>/teacher.pt`` when an earlier run of the same kind cached it.

    Returns:
        ``(train records, dev records)``.
    """
    cached = os.path.join(work_dir, "teacher.pt")
    if os.path.exists(cached):
        saved = torch.load(cached, weights_only=True, map_location=target.device)
        if saved.get("format") == CACHE_FORMAT and saved.get("whole_window", True) == whole_window:
            return [[TeacherRecord(*r) for r in saved[k]] for k in ("train", "dev")]
        print(f"{cached} is from another recipe: the teacher pass runs again", flush=True)
    train = teacher_pass(target, train_utts, speeds, batch, workers=workers, whole_window=whole_window)
    dev = teacher_pass(target, dev_utts, (1.0,), batch, workers=workers, whole_window=whole_window)
    size = sum(r.states.numel() * 2 for r in train + dev)
    if size <= TEACHER_CACHE_BYTES:
        torch.save({"format": CACHE_FORMAT, "whole_window": whole_window,
                    **{k: [(r.states, r.real, r.tokens, r.masked) for r in v]
                                               for k, v in (("train", train), ("dev", dev))}}, cached + ".tmp")
        os.replace(cached + ".tmp", cached)
    else:
        print(f"teacher pass of {size / 2**30:.1f} GiB not cached (over {TEACHER_CACHE_BYTES / 2**30:.0f} GiB): "
              "a resumed run repeats it", flush=True)
    return train, dev


def train_draft_decoder(target_dir: str, manifests: list[str], out_dir: str, work_dir: str, layers: int = 2,
                        epochs: int = 10, lr: float = 1e-3, kl_weight: float = 0.8, batch_positions: int = 6000,
                        dropout: float = 0.1, warmup_steps: int = 200, seed: int = 0, threads: int = 2,
                        dev_fraction: float = 0.08, max_utterances: Optional[int] = None, device: str = "cpu",
                        speeds: tuple[float, ...] = SPEEDS, max_steps: Optional[int] = None) -> dict:
    """Train a draft decoder for the target ``target_dir`` (a model name or directory) and write it to ``out_dir``
    (:func:`export_draft_decoder`).

    Args:
        manifests: training audio (JSONL/CSV/Parquet); the references are not used (the targets are the target's).
        work_dir: cached teacher pass, checkpoints and ``log.jsonl`` (a re-run resumes).
        layers: decoder layers of the draft; kl_weight: weight of the KL term (the pseudo-label CE weighs 1).
        batch_positions: padded encoder positions per batch (a stock Whisper window is 1,500).
        device: "cpu" or "cuda" (teacher pass and training; TF32 matrix products for training on a GPU).
        speeds: speed-perturbation factors of the training audio.
        max_steps: stop after this many optimizer steps (smoke runs).

    Returns:
        Summary dict (dev top-1 agreement, epochs, minutes, parameters), also in ``<work_dir>/summary.json``.

    Raises:
        ValueError: ``layers`` out of range.
    """
    target, train_utts, dev_utts = frozen_teacher(target_dir, manifests, work_dir, dev_fraction, seed, threads,
                                                  max_utterances, device)
    train, dev = cached_teacher_pass(target, train_utts, dev_utts, work_dir, tuple(speeds), teacher_batch(device),
                                     threads)
    student = new_draft_decoder(target, layers, dropout)
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True  # training (and its per-batch KL) only: the greedy labels are fp32
    try:
        return _train(student, target if kl_weight else None, train, dev, target_dir, out_dir, work_dir, layers,
                      epochs, lr, kl_weight, batch_positions, warmup_steps, seed, max_steps)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32


def _train(student, target, train, dev, target_dir, out_dir, work_dir, layers, epochs, lr, kl_weight,
           batch_positions, warmup_steps, seed, max_steps) -> dict:
    rng = random.Random(seed)
    params = [p for p in student.model.parameters() if p.requires_grad]
    optim = torch.optim.AdamW(params, lr=lr, weight_decay=0.01, betas=(0.9, 0.98))
    lengths = [r.states.shape[0] for r in train]
    steps_per_epoch = len(length_batches(lengths, batch_positions, random.Random(0)))
    total = max(1, epochs * steps_per_epoch)

    epoch, step, history = 0, 0, []
    ckpt = os.path.join(work_dir, "checkpoint.pt")
    saved = torch.load(ckpt, weights_only=True, map_location=student.device) if os.path.exists(ckpt) else None
    if saved is not None and saved.get("format") != CACHE_FORMAT:
        print(f"{ckpt} is from an older recipe (trainable embedding): training starts afresh", flush=True)
    elif saved is not None:
        student.model.load_state_dict(saved["model"])
        optim.load_state_dict(saved["optim"])
        epoch, step, history = saved["epoch"], saved["step"], json.loads(saved["history"])
        print(f"resuming draft-decoder from epoch {epoch} ({ckpt})")
    t_start = time.time()
    while epoch < epochs and (max_steps is None or step < max_steps):
        t0 = time.time()
        rng.seed(seed + epoch)
        student.model.train()
        total_loss, n = 0.0, 0
        for idx in tqdm(length_batches(lengths, batch_positions, rng),
                        desc=f"draft-decoder epoch {epoch + 1}/{epochs}", leave=False):
            if max_steps is not None and step >= max_steps:
                break
            for g in optim.param_groups:
                g["lr"] = warmup_cosine(step, lr, warmup_steps, total)
            loss, _ = _batch_loss(student, target, [train[i] for i in idx], kl_weight)
            optim.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 5.0)
            optim.step()
            step += 1
            total_loss, n = total_loss + loss.item(), n + 1
        epoch += 1
        rec = {"epoch": epoch, "step": step, "loss": round(total_loss / max(1, n), 4),
               "dev_top1": round(agreement(student, dev), 4), "epoch_s": round(time.time() - t0, 1)}
        history.append(rec)
        print(json.dumps(rec), flush=True)
        with open(os.path.join(work_dir, "log.jsonl"), "a") as f:
            f.write(json.dumps(rec) + "\n")
        torch.save({"format": CACHE_FORMAT, "model": student.model.state_dict(), "optim": optim.state_dict(),
                    "epoch": epoch, "step": step, "history": json.dumps(history)}, ckpt + ".tmp")
        os.replace(ckpt + ".tmp", ckpt)
    vocabulary = sorted({int(t) for r in train for t in r.tokens})
    export_draft_decoder(student, target_dir, out_dir, vocabulary)
    summary = {"vocabulary": len(vocabulary), "kind": "draft-decoder", "target": target_dir, "layers": layers, "epochs": epoch, "steps": step,
               "train_sequences": len(train), "dev_utterances": len(dev),
               "dev_top1": history[-1]["dev_top1"] if history else None,
               "dev_top1_per_epoch": [h["dev_top1"] for h in history],
               "train_minutes_this_run": round((time.time() - t_start) / 60, 2),
               "parameters_shipped": sum(p.numel() for p in params)}
    with open(os.path.join(work_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    return summary


def export_draft_decoder(student: WhisperASR, target: str, out_dir: str, vocabulary: Sequence[int]) -> None:
    """Write a draft decoder without the target's token embedding: ``config.json`` (with ``rayspec_embedding_from``
    = ``target``, the model name or absolute directory whose embedding, tokenizer and generation config it loads
    with, see :meth:`WhisperASR.from_pretrained`, and ``rayspec_vocabulary`` = ``vocabulary``, the token ids of its
    training transcripts, over which it drafts: :meth:`WhisperASR.readout_logits`) and float16 ``model.safetensors``
    (layers, positions, final norm)."""
    from safetensors.torch import save_file

    model = student.model
    model.config.dropout = model.config.attention_dropout = model.config.activation_dropout = 0.0
    model.config.rayspec_embedding_from = os.path.abspath(target) if os.path.isdir(target) else target
    model.config.rayspec_vocabulary = [int(t) for t in vocabulary]
    os.makedirs(out_dir, exist_ok=True)
    model.config.save_pretrained(out_dir)
    weights = {k: v.detach().to("cpu", torch.float16).contiguous() for k, v in model.state_dict().items()
               if k not in (EMBEDDING_KEY, "proj_out.weight")}
    save_file(weights, os.path.join(out_dir, "model.safetensors.tmp"), metadata={"format": "pt"})
    os.replace(os.path.join(out_dir, "model.safetensors.tmp"), os.path.join(out_dir, "model.safetensors"))


@torch.no_grad()
def agreement(student: WhisperASR, records: list[TeacherRecord], batch: int = 32) -> float:
    """Teacher-forced top-1 agreement of the draft with the target's greedy tokens over ``records`` (a fraction)."""
    was = student.model.training
    student.model.eval()
    hit = tot = 0
    for k in range(0, len(records), batch):
        _, (h, t) = _batch_loss(student, None, records[k : k + batch], 0.0)
        hit, tot = hit + h, tot + t
    student.model.train(was)
    return hit / max(1, tot)
