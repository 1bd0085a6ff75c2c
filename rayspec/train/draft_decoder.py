"""``rayspec train draft-decoder``: a shallow Whisper decoder over the frozen target's encoder, distilled from it.

The draft is distil-whisper's assistant form (Gandhi et al. 2023, "Distil-Whisper", arXiv:2311.00430, sections 3
and 4.4): a ``WhisperForCausalLM`` with the target's width, a few decoder layers copied from the target's (maximally
spaced: the first, then the last), and no encoder of its own: at decode time it reads the target's encoder states,
so drafting costs decoder passes only (no second feature extraction or encoder). Training:

1. Teacher pass (cached in ``<work_dir>/teacher.pt``): for every training utterance at each speed (0.9/1.0/1.1) and
   every dev utterance (1.0), the target's encoder states, its greedy transcript and, teacher-forced on that
   transcript, its next-token distribution at every position (Whisper's suppress lists applied, as at decode time).
2. Student loss (Distil-Whisper eq. 3): ``kl_weight * KL(p_target || p_draft) + CE(pseudo-label)``, the pseudo-label
   being the target's greedy token (word- and sequence-level distillation, Kim & Rush 2016, arXiv:1606.07947).
   Only the decoder trains; AdamW with warm-up and cosine decay; a resumable checkpoint and a log line per epoch
   with the dev top-1 agreement (teacher-forced: how often the draft's argmax is the target's greedy token, the
   quantity speculative acceptance rests on).
"""

from __future__ import annotations

import copy
import json
import math
import os
import random
import time
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from tqdm import tqdm

from ..models.whisper import EncoderOutput, WhisperASR
from .data import SPEEDS, frozen_teacher, load_examples
from .recipe import length_batches, teacher_greedy

RAYSPEC_FEATURE_KEYS = ("rayspec_encoder_masking", "rayspec_frame_stack", "rayspec_feature_mean", "rayspec_feature_std")
"""Config entries of the target's front-end, meaningless for a decoder without an encoder (dropped from its config)."""


@dataclass
class TeacherRecord:
    """The target on one utterance (one speed).

    Attributes:
        states: float16 ``[S, D]`` encoder states (real positions only).
        tokens: int64 ``[L]`` the target's greedy transcript, followed by EOS when it finished.
        probs: float16 ``[L, V]`` the target's next-token distribution at each of those positions.
    """

    states: torch.Tensor
    tokens: torch.Tensor
    probs: torch.Tensor


@torch.inference_mode()
def teacher_pass(target: WhisperASR, examples, speeds: list[int]) -> list[TeacherRecord]:
    """:class:`TeacherRecord` s of ``examples`` (training :class:`~rayspec.train.data.Example` s) at each speed
    index in ``speeds`` (speed-major order)."""
    p, eos = len(target.prompt_ids), target.eos_token_id
    out: list[TeacherRecord] = []
    for s in speeds:
        got: dict[int, TeacherRecord] = {}
        for idx, enc, hyps in teacher_greedy(target, examples, s):
            seqs = [h.tokens + ([eos] if h.finished else []) for h in hyps]
            width = max(len(q) for q in seqs)
            tokens = torch.tensor([target.prompt_ids + q[:-1] + [eos] * (width - len(q)) for q in seqs])
            logits = target.decode(target.new_cache(enc, p + width), tokens.to(target.device), logits_from=p - 1)
            first = torch.zeros(logits.shape[:2], dtype=torch.bool)
            first[:, 0] = True
            probs = target.suppress(logits.float(), first.to(logits.device)).softmax(-1)
            for r, (i, q) in enumerate(zip(idx, seqs)):
                got[i] = TeacherRecord(enc.states[r, : int(enc.lengths[r])].half().cpu(), torch.tensor(q),
                                       probs[r, : len(q)].half().cpu())
        out += [got[i] for i in range(len(examples))]
    return out


def new_draft_decoder(target: WhisperASR, layers: int, dropout: float) -> WhisperASR:
    """A ``WhisperForCausalLM`` with the target's width, tokenizer and generation config, its ``layers`` decoder
    layers copied from the target's maximally spaced ones (Distil-Whisper section 4.4), embeddings, final layer norm
    and output projection from the target.

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
    student = WhisperForCausalLM(cfg)
    src, dst = target.model.model.decoder, student.model.decoder
    for name in ("embed_tokens", "embed_positions", "layer_norm"):
        getattr(dst, name).load_state_dict(getattr(src, name).state_dict())
    picks = [round(i * (n_t - 1) / max(1, layers - 1)) for i in range(layers)]
    for i, j in enumerate(picks):
        dst.layers[i].load_state_dict(src.layers[j].state_dict())
    student.tie_weights()
    return WhisperASR(student, None, target.tokenizer, copy.deepcopy(target.generation_config),
                      name=f"{target.name}-draft-decoder")


def _batch_loss(student: WhisperASR, records: list[TeacherRecord], kl_weight: float):
    """Distillation loss over a batch and its ``(agreeing, total)`` top-1 counts."""
    p, eos = len(student.prompt_ids), student.eos_token_id
    lengths = torch.tensor([r.states.shape[0] for r in records])
    states = torch.zeros(len(records), int(lengths.max()), records[0].states.shape[1])
    for i, r in enumerate(records):
        states[i, : r.states.shape[0]] = r.states.float()
    width = max(len(r.tokens) for r in records)
    inp = torch.full((len(records), p + width - 1), eos, dtype=torch.long)
    valid = torch.zeros(len(records), width, dtype=torch.bool)
    for i, r in enumerate(records):
        inp[i, :p] = torch.tensor(student.prompt_ids)
        inp[i, p : p + len(r.tokens) - 1] = r.tokens[:-1]
        valid[i, : len(r.tokens)] = True
    cache = student.new_cache(EncoderOutput(states, lengths, masked=True), inp.shape[1])
    logits = student.decode(cache, inp)[:, p - 1 :][valid]  # [N, V]
    labels = torch.cat([r.tokens for r in records])
    probs = torch.cat([r.probs for r in records]).float()
    loss = kl_weight * F.cross_entropy(logits, probs) + F.cross_entropy(logits, labels)
    return loss, (int((logits.argmax(-1) == labels).sum()), len(labels))


def train_draft_decoder(target_dir: str, manifests: list[str], out_dir: str, work_dir: str, layers: int = 1,
                        epochs: int = 30, lr: float = 1e-3, kl_weight: float = 0.8, batch_positions: int = 12000,
                        dropout: float = 0.1, warmup_steps: int = 200, seed: int = 0, threads: int = 2,
                        dev_fraction: float = 0.08, max_utterances: Optional[int] = None) -> dict:
    """Train a draft decoder for the target in ``target_dir`` and write it to ``out_dir`` (``from_pretrained``).

    Args:
        manifests: training audio (JSONL/CSV/Parquet); the references are not used (the targets are the target's).
        work_dir: cached teacher pass, checkpoints and ``log.jsonl`` (a re-run resumes).
        layers: decoder layers of the draft; kl_weight: weight of the KL term (the pseudo-label CE weighs 1).
        batch_positions: padded encoder positions per batch.

    Returns:
        Summary dict (dev top-1 agreement, epochs, minutes, parameters), also in ``<work_dir>/summary.json``.

    Raises:
        ValueError: a fixed-window target (no encoder masking), or ``layers`` out of range.
    """
    target, train_utts, dev_utts = frozen_teacher(target_dir, manifests, work_dir, dev_fraction, seed, threads,
                                                  max_utterances)
    if not target.encoder_masking:
        raise ValueError("draft-decoder needs a target with a masked, variable-length encoder (rayspec's recipes): "
                         "a fixed-window target's draft reads the whole 30 s window, which this recipe does not train")
    cached = os.path.join(work_dir, "teacher.pt")
    if os.path.exists(cached):
        saved = torch.load(cached, weights_only=True)
        train, dev = [TeacherRecord(*r) for r in saved["train"]], [TeacherRecord(*r) for r in saved["dev"]]
    else:
        cache_dir = os.path.join(work_dir, "..", "features")
        train_ex = load_examples(train_utts, target.feature_extractor, cache_dir)
        dev_ex = load_examples(dev_utts, target.feature_extractor, cache_dir, speeds=(1.0,))
        train = teacher_pass(target, train_ex, list(range(len(SPEEDS))))
        dev = teacher_pass(target, dev_ex, [0])
        torch.save({k: [(r.states, r.tokens, r.probs) for r in v] for k, v in (("train", train), ("dev", dev))},
                   cached + ".tmp")
        os.replace(cached + ".tmp", cached)
    student = new_draft_decoder(target, layers, dropout)
    del target
    rng = random.Random(seed)
    params = [p for p in student.model.parameters() if p.requires_grad]
    optim = torch.optim.AdamW(params, lr=lr, weight_decay=0.01, betas=(0.9, 0.98))
    lengths = [r.states.shape[0] for r in train]
    steps_per_epoch = len(length_batches(lengths, batch_positions, random.Random(0)))
    total = max(1, epochs * steps_per_epoch)

    def lr_at(step: int) -> float:
        if step < warmup_steps:
            return lr * (step + 1) / warmup_steps
        return lr * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup_steps) / max(1, total)))))

    epoch, step, history = 0, 0, []
    ckpt = os.path.join(work_dir, "checkpoint.pt")
    if os.path.exists(ckpt):
        saved = torch.load(ckpt, weights_only=True)
        student.model.load_state_dict(saved["model"])
        optim.load_state_dict(saved["optim"])
        epoch, step, history = saved["epoch"], saved["step"], json.loads(saved["history"])
        if "torch_rng" in saved:
            torch.set_rng_state(saved["torch_rng"])
        print(f"resuming draft-decoder from epoch {epoch} ({ckpt})")
    t_start = time.time()
    while epoch < epochs:
        t0 = time.time()
        rng.seed(seed + epoch)
        student.model.train()
        total_loss, n = 0.0, 0
        for idx in tqdm(length_batches(lengths, batch_positions, rng),
                        desc=f"draft-decoder epoch {epoch + 1}/{epochs}", leave=False):
            for g in optim.param_groups:
                g["lr"] = lr_at(step)
            loss, _ = _batch_loss(student, [train[i] for i in idx], kl_weight)
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
        torch.save({"model": student.model.state_dict(), "optim": optim.state_dict(), "epoch": epoch, "step": step,
                    "history": json.dumps(history), "torch_rng": torch.get_rng_state()}, ckpt + ".tmp")
        os.replace(ckpt + ".tmp", ckpt)
    student.model.eval()
    student.model.config.dropout = student.model.config.attention_dropout = 0.0
    student.model.config.activation_dropout = 0.0
    os.makedirs(out_dir, exist_ok=True)
    student.model.save_pretrained(out_dir)
    student.generation_config.save_pretrained(out_dir)
    student.tokenizer.save_pretrained(out_dir)
    summary = {"kind": "draft-decoder", "target": target_dir, "layers": layers, "epochs": epoch,
               "train_sequences": len(train), "dev_utterances": len(dev),
               "dev_top1": history[-1]["dev_top1"] if history else None,
               "train_minutes_this_run": round((time.time() - t_start) / 60, 2),
               "parameters": student.count_parameters()}
    with open(os.path.join(work_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    return summary


@torch.no_grad()
def agreement(student: WhisperASR, records: list[TeacherRecord], batch: int = 32) -> float:
    """Teacher-forced top-1 agreement of the draft with the target's greedy tokens over ``records`` (a fraction)."""
    was = student.model.training
    student.model.eval()
    hit = tot = 0
    for k in range(0, len(records), batch):
        _, (h, t) = _batch_loss(student, records[k : k + batch], 0.0)
        hit, tot = hit + h, tot + t
    student.model.train(was)
    return hit / max(1, tot)
