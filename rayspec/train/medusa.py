"""``rayspec train medusa``: Medusa-1 heads on a frozen target, self-distilled from the target's own greedy output.

Source: Medusa (Cai et al. 2024, arXiv:2401.10774) section 2.2.1 (Medusa-1: frozen backbone, loss
``sum_k lambda^k * CE(head_k)``) and 2.3.2 (self-distillation: train on the model's own outputs so the heads predict
what the target will say); Whisper-Medusa (Segal-Feldman et al. 2024, arXiv:2409.15869) trains its heads the same way.

1. The target greedy-decodes every training and dev utterance; one teacher-forced pass over prompt + transcript +
   EOS gives its last hidden states. Both are cached in the work directory (``states.pt``), so head training never
   runs the target again.
2. Head ``k`` learns, from the state that predicts token ``i``, token ``i + k``. AdamW, cosine decay; every epoch
   writes a resumable checkpoint and a log line with each head's top-1 accuracy on the dev split.
   With ``block`` (Medusa-Block, Whisper-Medusa section 2) the cache also holds each utterance's encoder states
   (float16 ``[1500, D]`` for a 30 s window); the block attends over the target's last-layer keys/values of them,
   computed per batch with the target's frozen projections, and starts from the target's last decoder layer.
3. The heads carry their candidate vocabulary: every token of the training transcripts (the target's own, so none it
   suppresses), over which they train (a softmax over those rows of the output projection, 7x fewer than the
   whole vocabulary's for whisper-base) and over which the proposer reads them out.
"""

from __future__ import annotations

import json
import math
import os
import random
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

import torch
import torch.nn.functional as F
from tqdm import tqdm

from ..audio import load_audio
from ..decoding.ar import greedy_decode
from ..models.medusa import MedusaHeads
from ..models.whisper import WhisperASR
from .data import frozen_teacher, teacher_batch


@torch.inference_mode()
def _target_states(target: WhisperASR, utterances, cap: int = 200, encoder: bool = False, batch: int = 16,
                   workers: int = 2) -> list[tuple]:
    """Per utterance ``(hidden [L, D], labels [L], encoder states)`` on the CPU: the target's hidden state at each
    position that predicts a transcript token or EOS, that token (its own greedy output), and with ``encoder`` its
    encoder states (float16 ``[S, D]``; else None). ``batch`` utterances per target pass; audio decoding on
    ``workers`` threads."""
    order = sorted(range(len(utterances)), key=lambda i: utterances[i].duration_s or 0.0)
    out: dict[int, tuple] = {}
    p = len(target.prompt_ids)
    with ThreadPoolExecutor(workers) as pool:
        for s in tqdm(range(0, len(order), batch), desc="target states"):
            idx = order[s : s + batch]
            audios = list(pool.map(lambda i: load_audio(utterances[i].audio, target.sample_rate), idx))
            enc = target.encode(*target.features(audios, pool.map))
            hyps = greedy_decode(target, enc, [cap] * len(idx))
            seqs = [h.tokens + [target.eos_token_id] for h in hyps]
            width = max(len(q) for q in seqs)
            eos = target.eos_token_id
            tokens = torch.tensor([target.prompt_ids + q[:-1] + [eos] * (width - len(q)) for q in seqs])
            cache = target.new_cache(enc, p + width)
            hidden = target.decode_hidden(cache, tokens.to(target.device), hidden_from=p - 1)
            for k, (i, q) in enumerate(zip(idx, seqs)):
                out[i] = (hidden[k, : len(q)].float().cpu(), torch.tensor(q),
                          enc.states[k].half().cpu().clone() if encoder else None)
    return [out[i] for i in range(len(utterances))]


def _head_states(heads: MedusaHeads, target: WhisperASR, batch) -> torch.Tensor:
    """Head states ``[K, N, D]`` for the ``N`` positions of a list of ``(hidden, labels, encoder states)``, in order."""
    device = target.device
    if heads.cross_block is None:
        return heads(torch.cat([h for h, _, _ in batch]).to(device))
    lengths = [len(h) for h, _, _ in batch]
    x = torch.nn.utils.rnn.pad_sequence([h for h, _, _ in batch], batch_first=True).to(device)  # [U, L, D]
    with torch.no_grad():
        enc = torch.stack([e for _, _, e in batch]).to(device, target.dtype)  # [U, S, D]
        k, v = target.cross_attention_kv(enc, -1)  # [U, H, S, Dh]
    states = heads(x, (k, v, None))  # [K, U, L, D]
    return torch.cat([states[:, u, :n] for u, n in enumerate(lengths)], dim=1)


def _head_loss(heads, target, batch, lam: float):
    """Weighted CE over heads and per-head (correct, total) top-1 counts for a list of ``(hidden, labels, encoder
    states)``. Heads with a candidate vocabulary are scored over it, as the proposer reads them out (a label outside
    it counts as a miss and adds no loss)."""
    loss, counts = 0.0, []
    proj = target.model.proj_out
    weight, bias, where = proj.weight, proj.bias, None
    if heads.vocab is not None:
        weight, bias = weight[heads.vocab], None if bias is None else bias[heads.vocab]
        where = torch.full((proj.weight.shape[0],), -100, dtype=torch.long)  # [V] index in the vocabulary
        where[heads.vocab] = torch.arange(len(heads.vocab))
    states = _head_states(heads, target, batch)  # [K, N, D]
    for k in range(heads.num_heads):
        rows, targets = [], []
        start = 0
        for h, y, _ in batch:  # head k+1 at position i predicts label i + k + 1
            n = len(y) - (k + 1)
            if n > 0:
                rows.append(torch.arange(start, start + n))
                targets.append(y[k + 1 :])
            start += len(y)
        if not rows:
            counts.append((0, 0))
            continue
        logits = F.linear(states[k, torch.cat(rows).to(states.device)], weight, bias)
        y = torch.cat(targets)
        index = (y if where is None else where[y]).to(logits.device)
        y = y.to(logits.device)
        if bool((index >= 0).any()):
            loss = loss + lam ** (k + 1) * F.cross_entropy(logits, index, ignore_index=-100)
        pred = logits.argmax(-1)
        counts.append((int(((pred if where is None else heads.vocab[pred]) == y).sum()), len(y)))
    return loss, counts


@torch.no_grad()
def _dev_counts(heads, target, dev, batch_utterances: int) -> list[tuple[int, int]]:
    """Per head (correct, total) top-1 counts over ``dev``, in batches (a block's keys/values for every dev utterance
    at once would not fit)."""
    counts = [(0, 0)] * heads.num_heads
    for s in range(0, len(dev), batch_utterances):
        _, c = _head_loss(heads, target, dev[s : s + batch_utterances], 1.0)
        counts = [(a + x, b + y) for (a, b), (x, y) in zip(counts, c)]
    return counts


@torch.no_grad()
def head_accuracy(target: WhisperASR, heads: MedusaHeads, utterances) -> list[float]:
    """Per head, top-1 agreement with the target's own greedy token ``k`` positions ahead on ``utterances``
    (fractions in head order; the heads' accuracy curve)."""
    states = _target_states(target, utterances, encoder=heads.cross_block is not None)
    counts = _dev_counts(heads, target, states, 32)
    return [c / n if n else 0.0 for c, n in counts]


def train_medusa(target_dir: str, manifests: list[str], out_dir: str, work_dir: str, num_heads: int = 4,
                 epochs: int = 40, lr: float = 1e-3, lam: float = 0.8, batch_utterances: int = 32, seed: int = 0,
                 threads: int = 2, dev_fraction: float = 0.08, max_utterances: Optional[int] = None,
                 block: bool = False, device: str = "cpu") -> dict:
    """Train Medusa heads for the target in ``target_dir`` and write them to ``out_dir``.

    Args:
        manifests: training audio (transcripts are not used: the targets are the target's own greedy output).
        work_dir: cached target states, checkpoints and ``log.jsonl`` (a re-run resumes).
        num_heads: ``K``; lam: loss weight base (head ``k`` weighs ``lam ** k``).
        block: Medusa-Block: the heads read a :class:`~rayspec.models.medusa.CrossBlock` over the audio (started
            from the target's last decoder layer) instead of the hidden state alone.
        device: where the target and the heads run (``cpu`` or ``cuda``; the cached states stay in host memory,
            and the target pass that makes them batches :func:`~rayspec.train.data.teacher_batch` utterances).

    Returns:
        Summary dict (per-head dev top-1 accuracy, epochs, minutes), also in ``<work_dir>/summary.json``.
    """
    target, train_utts, dev_utts = frozen_teacher(target_dir, manifests, work_dir, dev_fraction, seed, threads,
                                                  max_utterances, device)
    rng = random.Random(seed)
    cached = os.path.join(work_dir, "states.pt")
    saved = torch.load(cached, weights_only=True) if os.path.exists(cached) else None
    if saved is not None and (not block or saved["train"][0][2] is not None):
        train, dev = saved["train"], saved["dev"]
    else:  # none cached, or cached without the encoder states a block needs
        batch = teacher_batch(device)
        train = _target_states(target, train_utts, encoder=block, batch=batch, workers=threads)
        dev = _target_states(target, dev_utts, encoder=block, batch=batch, workers=threads)
        torch.save({"train": train, "dev": dev}, cached + ".tmp")
        os.replace(cached + ".tmp", cached)
    del saved
    cfg = target.config
    heads = MedusaHeads(cfg.d_model, num_heads, target.name, block_heads=cfg.decoder_attention_heads if block else 0,
                        block_ffn=cfg.decoder_ffn_dim if block else 0).to(device)
    if block:
        decoder = target.model.model.decoder
        heads.cross_block.init_from(decoder.layers[-1], decoder.layer_norm)
    heads.set_vocab(int(t) for _, y, _ in train for t in y)  # trained and read out over it
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
            loss, _ = _head_loss(heads, target, [train[i] for i in order[s : s + batch_utterances]], lam)
            optim.zero_grad(set_to_none=True)
            loss.backward()
            optim.step()
            total_loss += loss.item()
        epoch += 1
        heads.eval()
        counts = _dev_counts(heads, target, dev, batch_utterances)
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
        heads.save_pretrained(out_dir, torch.float16)  # every epoch (a run stopped early leaves its last epoch's)
    heads.eval().save_pretrained(out_dir, torch.float16)  # loaded back in the target's dtype
    summary = {"kind": "medusa", "target": target_dir, "heads": num_heads, "block": block, "epochs": epoch,
               "train_utterances": len(train), "dev_utterances": len(dev), "candidate_vocabulary": len(heads.vocab),
               "dev_top1": history[-1]["dev_top1"] if history else None,
               "train_minutes_this_run": round((time.time() - t_start) / 60, 2),
               "parameters": sum(p.numel() for p in heads.parameters())}
    with open(os.path.join(work_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    return summary
