"""``rayspec train medusa``: Medusa-1 heads on a frozen target, self-distilled from the target's own greedy output.

Source: Medusa (Cai et al. 2024, arXiv:2401.10774) section 2.2.1 (Medusa-1: frozen backbone, loss
``sum_k lambda^k * CE(head_k)``) and 2.3.2 (self-distillation: train on the model's own outputs so the heads predict
what the target will say); Whisper-Medusa (../shared/seeds/whisper-medusa.txt) trains its heads the same way.

1. The target greedy-decodes every training and dev utterance; one teacher-forced pass over prompt + transcript +
   EOS gives its last hidden states. Both are cached in the work directory (``states.pt``), so head training never
   runs the target again.
2. Head ``k`` learns, from the state that predicts token ``i``, token ``i + k``. AdamW, cosine decay; every epoch
   writes a resumable checkpoint and a log line with each head's top-1 accuracy on the dev split.
3. The saved heads carry their candidate vocabulary: every token of the training transcripts (the target's own, so
   none it suppresses), over which the proposer reads them out.
"""

from __future__ import annotations

import json
import math
import os
import random
import time
from typing import Optional

import torch
import torch.nn.functional as F
from tqdm import tqdm

from ..audio import load_audio
from ..decoding.ar import greedy_decode
from ..models.medusa import MedusaHeads
from ..models.whisper import WhisperASR
from .data import frozen_teacher


@torch.inference_mode()
def _target_states(target: WhisperASR, utterances, cap: int = 200) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per utterance ``(hidden [L, D], labels [L])``: the target's hidden state at each position that predicts
    a transcript token or EOS, and that token (its own greedy output)."""
    order = sorted(range(len(utterances)), key=lambda i: utterances[i].duration_s or 0.0)
    out: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    p = len(target.prompt_ids)
    for s in tqdm(range(0, len(order), 16), desc="target states"):
        idx = order[s : s + 16]
        audios = [load_audio(utterances[i].audio, target.sample_rate) for i in idx]
        enc = target.encode(*target.features(audios))
        hyps = greedy_decode(target, enc, [cap] * len(idx))
        seqs = [h.tokens + [target.eos_token_id] for h in hyps]
        width = max(len(q) for q in seqs)
        eos = target.eos_token_id
        tokens = torch.tensor([target.prompt_ids + q[:-1] + [eos] * (width - len(q)) for q in seqs])
        cache = target.new_cache(enc, p + width)
        _, hidden = target.decode(cache, tokens.to(target.device), logits_from=p - 1, return_hidden=True)
        for k, (i, q) in enumerate(zip(idx, seqs)):
            out[i] = (hidden[k, : len(q)].float().cpu(), torch.tensor(q))
    return [out[i] for i in range(len(utterances))]


def _head_loss(heads, proj, batch, lam: float):
    """Weighted CE over heads and per-head (correct, total) top-1 counts for a list of ``(hidden, labels)``."""
    loss, counts = 0.0, []
    states = heads(torch.cat([h for h, _ in batch]))  # [K, N, D]
    for k in range(heads.num_heads):
        rows, targets = [], []
        start = 0
        for h, y in batch:  # head k+1 at position i predicts label i + k + 1
            n = len(y) - (k + 1)
            if n > 0:
                rows.append(torch.arange(start, start + n))
                targets.append(y[k + 1 :])
            start += len(y)
        if not rows:
            counts.append((0, 0))
            continue
        logits = proj(states[k, torch.cat(rows)])
        y = torch.cat(targets)
        loss = loss + lam ** (k + 1) * F.cross_entropy(logits, y)
        counts.append((int((logits.argmax(-1) == y).sum()), len(y)))
    return loss, counts


@torch.no_grad()
def head_accuracy(target: WhisperASR, heads: MedusaHeads, utterances) -> list[float]:
    """Per head, top-1 agreement with the target's own greedy token ``k`` positions ahead on ``utterances``
    (fractions in head order; the heads' accuracy curve)."""
    _, counts = _head_loss(heads, target.model.proj_out, _target_states(target, utterances), 1.0)
    return [c / n if n else 0.0 for c, n in counts]


def train_medusa(target_dir: str, manifests: list[str], out_dir: str, work_dir: str, num_heads: int = 4,
                 epochs: int = 40, lr: float = 1e-3, lam: float = 0.8, batch_utterances: int = 32, seed: int = 0,
                 threads: int = 2, dev_fraction: float = 0.08, max_utterances: Optional[int] = None) -> dict:
    """Train Medusa heads for the target in ``target_dir`` and write them to ``out_dir``.

    Args:
        manifests: training audio (transcripts are not used: the targets are the target's own greedy output).
        work_dir: cached target states, checkpoints and ``log.jsonl`` (a re-run resumes).
        num_heads: ``K``; lam: loss weight base (head ``k`` weighs ``lam ** k``).

    Returns:
        Summary dict (per-head dev top-1 accuracy, epochs, minutes), also in ``<work_dir>/summary.json``.
    """
    target, train_utts, dev_utts = frozen_teacher(target_dir, manifests, work_dir, dev_fraction, seed, threads,
                                                  max_utterances)
    rng = random.Random(seed)
    cached = os.path.join(work_dir, "states.pt")
    if os.path.exists(cached):
        saved = torch.load(cached, weights_only=True)
        train, dev = saved["train"], saved["dev"]
    else:
        train, dev = _target_states(target, train_utts), _target_states(target, dev_utts)
        torch.save({"train": train, "dev": dev}, cached + ".tmp")
        os.replace(cached + ".tmp", cached)
    heads = MedusaHeads(target.config.d_model, num_heads, target.name)
    optim = torch.optim.AdamW(heads.parameters(), lr=lr, weight_decay=0.01)
    steps_per_epoch = math.ceil(len(train) / batch_utterances)
    total = max(1, epochs * steps_per_epoch)
    epoch, history = 0, []
    ckpt = os.path.join(work_dir, "checkpoint.pt")
    if os.path.exists(ckpt):
        saved = torch.load(ckpt, weights_only=True)
        heads.load_state_dict(saved["heads"])
        optim.load_state_dict(saved["optim"])
        epoch, history = saved["epoch"], json.loads(saved["history"])
        rng.seed(seed + epoch)
    proj = target.model.proj_out
    t_start = time.time()
    while epoch < epochs:
        t0 = time.time()
        order = list(range(len(train)))
        rng.shuffle(order)
        heads.train()
        total_loss = 0.0
        for s in range(0, len(order), batch_utterances):
            step = epoch * steps_per_epoch + s // batch_utterances
            for g in optim.param_groups:
                g["lr"] = lr * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * step / total)))
            loss, _ = _head_loss(heads, proj, [train[i] for i in order[s : s + batch_utterances]], lam)
            optim.zero_grad(set_to_none=True)
            loss.backward()
            optim.step()
            total_loss += loss.item()
        epoch += 1
        heads.eval()
        with torch.no_grad():
            _, counts = _head_loss(heads, proj, dev, lam)
        acc = [round(c / n, 4) if n else None for c, n in counts]
        rec = {"epoch": epoch, "loss": round(total_loss / steps_per_epoch, 4), "dev_top1": acc,
               "epoch_s": round(time.time() - t0, 1)}
        history.append(rec)
        print(json.dumps(rec), flush=True)
        with open(os.path.join(work_dir, "log.jsonl"), "a") as f:
            f.write(json.dumps(rec) + "\n")
        torch.save({"heads": heads.state_dict(), "optim": optim.state_dict(), "epoch": epoch,
                    "history": json.dumps(history)}, ckpt + ".tmp")
        os.replace(ckpt + ".tmp", ckpt)
    heads.set_vocab(int(t) for _, y in train for t in y)
    heads.eval().save_pretrained(out_dir, torch.float16)  # loaded back in the target's dtype
    summary = {"kind": "medusa", "target": target_dir, "heads": num_heads, "epochs": epoch,
               "train_utterances": len(train), "dev_utterances": len(dev), "candidate_vocabulary": len(heads.vocab),
               "dev_top1": history[-1]["dev_top1"] if history else None,
               "train_minutes_this_run": round((time.time() - t_start) / 60, 2),
               "parameters": sum(p.numel() for p in heads.parameters())}
    with open(os.path.join(work_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    return summary
