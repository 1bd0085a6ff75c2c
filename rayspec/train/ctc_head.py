"""``rayspec train ctc``: a CTC head over a frozen target's encoder, trained on the target's own transcripts.

The drafter of SSD (Saon et al. 2026, arXiv:2603.11243, section 3.1): the target's encoder is frozen and
shared, only the head trains. Its vocabulary is small: the printable characters
(:func:`~rayspec.models.ctc.character_vocabulary`) plus the target's few thousand most frequent text tokens
(:func:`token_shortlist`), not all 51,865; a word outside the shortlist is spelled in characters. At decode time the
hypothesis is re-tokenized into the target's tokens (:func:`~rayspec.decoding.ssd.retokenize`). What it must predict
is the target, not the reference: its labels are the target's greedy transcripts with their casing, punctuation and
leading spaces. (A characters-only head learns to spell by ear on a few hours of audio: "in being comparatively
modern" came out as "In bein comparitivly moder" after 3 epochs, 29% dev CER; the token shortlist keeps the
target's spelling.)

1. Teacher pass (cached in ``<work_dir>/teacher.pt``): the target's encoder states of every utterance, computed
   exactly as at decode time (a stock Whisper's 30 s window; only the real positions are kept) and its greedy
   transcript (:func:`~rayspec.train.draft_decoder.teacher_pass`). Utterances whose decode did not finish are left
   out.
2. Training: CTC loss over the real positions, the head's Transformer layers masking padding; dropout on the states
   (input) and in the layers; AdamW, linear warm-up and cosine decay; a resumable checkpoint and a ``log.jsonl``
   line per epoch with the dev CER of the greedy hypothesis against the target's text and the share of dev
   utterances whose re-tokenized hypothesis is exactly the target's output.
3. Gate table (``summary.json``): per entropy threshold, how many dev utterances the SSD gate would accept and how
   far those hypotheses are from the target (:func:`gate_table`), to calibrate ``--tau-ctc``.
"""

from __future__ import annotations

import json
import os
import random
import time
from collections import Counter
from typing import Optional

import torch
import torch.nn.functional as F
from tqdm import tqdm

from ..metrics import error_rates
from ..models.ctc import CTCHead, character_vocabulary, max_frame_entropy
from .data import frozen_teacher, teacher_batch
from .draft_decoder import TeacherRecord, cached_teacher_pass
from .recipe import length_batches, warmup_cosine


def token_shortlist(target, records: list[TeacherRecord], size: int) -> list[int]:
    """The ``size`` text tokens most frequent in the target's transcripts of ``records`` (seen at least twice)."""
    counts = Counter(t for r in records for t in r.tokens.tolist() if t < target.eos_token_id)
    return [t for t, n in counts.most_common(size) if n >= 2]


def _labels(target, records: list[TeacherRecord], vocab: dict[str, int], head: CTCHead):
    """Per record: the target's text (its tokens' decode, leading space kept) and its CTC class indices (a token of
    the head's vocabulary is one class, any other token is spelled in characters, characters outside the vocabulary
    dropped); records whose decode did not reach EOS are None."""
    eos, tok, own, out = target.eos_token_id, target.tokenizer, set(head.token_ids), []
    for r in records:
        toks = r.tokens.tolist()
        if not toks or toks[-1] != eos:
            out.append(None)
            continue
        ids = []
        for t in toks[:-1]:
            ids += [t] if t in own else [vocab[c] for c in tok.decode([t]) if c in vocab]
        out.append((tok.decode(toks[:-1], skip_special_tokens=True), head.targets(torch.tensor(ids, dtype=torch.long))))
    return out


def _batch(records: list[TeacherRecord]):
    """Zero-padded float32 states ``[B, S, D]`` and real lengths int64 ``[B]`` of ``records``, on the records'
    device."""
    widest, device = max(r.real for r in records), records[0].states.device
    states = torch.zeros(len(records), widest, records[0].states.shape[1], device=device)
    for i, r in enumerate(records):
        states[i, : r.real] = r.states[: r.real]
    return states, torch.tensor([r.real for r in records], device=device)


@torch.no_grad()
def dev_hypotheses(head: CTCHead, target, records: list[TeacherRecord], labels, batch: int = 32):
    """Per dev utterance that the target finished: ``(target text, greedy CTC text, equal to the target's tokens
    after re-tokenization, largest frame entropy in nats)``."""
    from ..decoding.ssd import retokenize

    was = head.training
    head.eval()
    out = []
    for k in range(0, len(records), batch):
        part = [(r, lab) for r, lab in zip(records[k : k + batch], labels[k : k + batch]) if lab is not None]
        if not part:
            continue
        states, lengths = _batch([r for r, _ in part])
        logp = head(states, lengths)
        entropy = max_frame_entropy(logp, lengths).tolist()
        for (r, (text, _)), ids, ent in zip(part, head.greedy(logp, lengths), entropy):
            out.append((text, target.tokenizer.decode(ids), retokenize(ids, head, target) == r.tokens[:-1].tolist(),
                        ent))
    head.train(was)
    return out


def evaluate(head: CTCHead, target, records: list[TeacherRecord], labels) -> dict:
    """Dev CER (case and space folded, :func:`~rayspec.metrics.error_rates`) of the head's greedy hypotheses against
    the target's texts, and the share of utterances whose re-tokenized hypothesis equals the target's tokens."""
    rows = dev_hypotheses(head, target, records, labels)
    return {"dev_cer": round(error_rates([r[0] for r in rows], [r[1] for r in rows], normalized=False).cer, 4),
            "dev_exact": round(sum(r[2] for r in rows) / max(1, len(rows)), 4)}


GATE_GRID = (0.05, 0.1, 0.2, 0.3, 0.5, 0.7, 1.0, 1.5, 2.0, 3.0)
"""Gate thresholds (nats) tabulated on dev data after training (SSD eq. 3's tau_CTC)."""


def gate_table(rows) -> list[dict]:
    """For each threshold of :data:`GATE_GRID`: the share of dev utterances the CTC gate would accept (largest frame
    entropy below it) and, among those, the share equal to the target and their WER against the target's text
    (the error the gate adds where it skips the target), from :func:`dev_hypotheses` rows."""
    out = []
    for tau in GATE_GRID:
        gated = [r for r in rows if r[3] < tau]
        wer = error_rates([r[0] for r in gated], [r[1] for r in gated]).wer if gated else 0.0
        out.append({"tau_ctc": tau, "gated": round(len(gated) / max(1, len(rows)), 4),
                    "gated_equal": round(sum(r[2] for r in gated) / max(1, len(gated)), 4),
                    "gated_wer_vs_target": round(wer, 4)})
    return out


def train_ctc_head(target_dir: str, manifests: list[str], out_dir: str, work_dir: str, layers: int = 2,
                   width: int = 256, heads: int = 4, ffn: int = 1024, tokens: int = 4000, epochs: int = 20,
                   lr: float = 1e-3, batch_positions: int = 6000, dropout: float = 0.1, warmup_steps: int = 200, seed: int = 0,
                   threads: int = 2, dev_fraction: float = 0.08, max_utterances: Optional[int] = None,
                   encoder_dtype: Optional[torch.dtype] = None, max_steps: Optional[int] = None,
                   device: str = "cpu") -> dict:
    """Train a CTC head for the frozen target ``target_dir`` (a model name or directory); write it to ``out_dir``
    (float16 weights, :meth:`CTCHead.save_pretrained`).

    Args:
        manifests: training audio (JSONL/CSV/Parquet); the references are not used (the labels are the target's).
        work_dir: cached teacher pass, checkpoint and ``log.jsonl`` (a re-run resumes).
        layers, width, heads, ffn: the head's Transformer layers (0 layers: a linear projection).
        tokens: the target's most frequent text tokens (in the training transcripts) that join the characters in
            the head's vocabulary (0: characters only).
        batch_positions: padded encoder positions per batch (50 per second of audio for Whisper).
        encoder_dtype: the teacher pass's encoder dtype (e.g. ``torch.bfloat16``: ~3x faster on a CPU with AVX-512
            BF16; the head then learns bfloat16 states and runs on the target's at decode time).
        max_steps, max_utterances: limits for smoke runs.
        device: where the target, the cached states and the head live (``cpu`` or ``cuda``; the teacher pass
            batches :func:`~rayspec.train.data.teacher_batch` utterances).

    Returns:
        Summary dict (dev CER and exact share, epochs, minutes, parameters), also in ``<work_dir>/summary.json``.
    """
    target, train_utts, dev_utts = frozen_teacher(target_dir, manifests, work_dir, dev_fraction, seed, threads,
                                                  max_utterances, device, encoder_dtype=encoder_dtype)
    train, dev = cached_teacher_pass(target, train_utts, dev_utts, work_dir, (1.0,), teacher_batch(device),
                                     threads, whole_window=False)
    vocab = character_vocabulary(target.tokenizer)
    classes = sorted(set(vocab.values()) | set(token_shortlist(target, train, tokens)))
    head = CTCHead(target.config.d_model, classes, layers, width, heads, ffn, dropout).to(device)
    train_labels, dev_labels = _labels(target, train, vocab, head), _labels(target, dev, vocab, head)
    keep = [i for i, lab in enumerate(train_labels) if lab is not None and 0 < len(lab[1]) <= train[i].real]
    rng = random.Random(seed)
    optim = torch.optim.AdamW(head.parameters(), lr=lr, weight_decay=0.01, betas=(0.9, 0.98))
    lengths = [train[i].real for i in keep]
    total = max(1, epochs * len(length_batches(lengths, batch_positions, random.Random(0))))

    epoch, step, history = 0, 0, []
    ckpt = os.path.join(work_dir, "checkpoint.pt")
    if os.path.exists(ckpt):
        saved = torch.load(ckpt, weights_only=True)
        head.load_state_dict(saved["head"])
        optim.load_state_dict(saved["optim"])
        epoch, step, history = saved["epoch"], saved["step"], json.loads(saved["history"])
        print(f"resuming ctc from epoch {epoch} ({ckpt})")
    t_start = time.time()
    while epoch < epochs and (max_steps is None or step < max_steps):
        t0 = time.time()
        rng.seed(seed + epoch)
        head.train()
        total_loss, n = 0.0, 0
        for idx in tqdm(length_batches(lengths, batch_positions, rng), desc=f"ctc epoch {epoch + 1}/{epochs}",
                        leave=False):
            if max_steps is not None and step >= max_steps:
                break
            rows = [keep[i] for i in idx]
            states, real = _batch([train[i] for i in rows])
            labels = [train_labels[i][1] for i in rows]
            logp = head(F.dropout(states, dropout), real)
            loss = F.ctc_loss(logp.transpose(0, 1), torch.cat(labels).to(real.device), real,
                              torch.tensor([len(t) for t in labels], device=real.device), blank=0, zero_infinity=True)
            for g in optim.param_groups:
                g["lr"] = warmup_cosine(step, lr, warmup_steps, total)
            optim.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(head.parameters(), 5.0)
            optim.step()
            step += 1
            total_loss, n = total_loss + loss.item(), n + 1
        epoch += 1
        rec = {"epoch": epoch, "step": step, "loss": round(total_loss / max(1, n), 4),
               **evaluate(head, target, dev, dev_labels), "epoch_s": round(time.time() - t0, 1)}
        history.append(rec)
        print(json.dumps(rec), flush=True)
        with open(os.path.join(work_dir, "log.jsonl"), "a") as f:
            f.write(json.dumps(rec) + "\n")
        torch.save({"head": head.state_dict(), "optim": optim.state_dict(), "epoch": epoch, "step": step,
                    "history": json.dumps(history)}, ckpt + ".tmp")
        os.replace(ckpt + ".tmp", ckpt)
        head.save_pretrained(out_dir, torch.float16)  # every epoch: a run stopped early leaves its last epoch's head
    head.eval()
    head.save_pretrained(out_dir, torch.float16)
    summary = {"kind": "ctc", "target": target_dir, "layers": layers, "width": width, "epochs": epoch,
               "steps": step, "train_utterances": len(keep), "dev_utterances": len(dev),
               "parameters": sum(p.numel() for p in head.parameters()),
               "train_minutes_this_run": round((time.time() - t_start) / 60, 2),
               "dev_per_epoch": [{k: h[k] for k in ("epoch", "dev_cer", "dev_exact")} for h in history],
               "dev_gate": gate_table(dev_hypotheses(head, target, dev, dev_labels))}
    with open(os.path.join(work_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    return summary
