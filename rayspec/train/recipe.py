"""The zoo's training recipe: joint CTC-attention training of Whisper-architecture models on real speech.

One loop serves the three zoo kinds:

* ``target``: encoder + decoder + CTC head, joint loss ``w * CTC + (1 - w) * CE`` (hybrid CTC-attention, Watanabe et
  al. 2017; ESPnet's AN4 recipe), label smoothing, SpecAugment (Park et al. 2019), on-the-fly speed perturbation
  0.9/1.0/1.1, AdamW with warmup + cosine decay, weight averaging of the last checkpoints.
* ``draft``: a much smaller model of the same family and tokenizer, trained on the data and on the target's own greedy
  transcripts (sequence-level knowledge distillation, Kim & Rush 2016) so it agrees with the target.

Every epoch writes a resumable checkpoint (model, optimizer, step, RNG) to the work directory; a re-run of the same
command resumes from it. Logs go to ``<work>/log.jsonl`` (loss and dev WER per epoch).
"""

from __future__ import annotations

import json
import math
import os
import random
import time
from dataclasses import asdict, dataclass, field
from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from ..decoding.ar import greedy_decode
from ..metrics import error_rates
from ..models.ctc import CTCHead
from ..models.tokenizer import SPECIAL_TOKENS, build_char_tokenizer
from ..models.features import stack_frames
from ..models.whisper import WhisperASR
from .data import SPEEDS, Example, load_examples, split_manifests


@dataclass
class Architecture:
    """Whisper-architecture sizes (``WhisperConfig`` fields)."""

    d_model: int = 192
    encoder_layers: int = 6
    decoder_layers: int = 3
    heads: int = 4
    ffn: int = 768
    max_source_positions: int = 750  # 30 s at 25 encoder positions / s
    max_target_positions: int = 448
    frame_stack: int = 2  # log-mel frames (10 ms hop) stacked per encoder input frame; 25 positions / s either way
    position_scale: float = 0.1  # initial encoder position embeddings = Whisper's sinusoids x this (see _init_front_end)


TARGET_ARCH = Architecture()
DRAFT_ARCH = Architecture(d_model=128, encoder_layers=4, decoder_layers=1, heads=2, ffn=512)


@dataclass
class TrainOptions:
    """Recipe options (all recorded in the model card).

    Attributes:
        epochs: passes over the training set (each utterance at one random speed per epoch).
        batch_frames: token budget of a batch in log-mel frames (sum over rows of padded length).
        lr: peak learning rate; warmup_steps linear warmup, cosine decay to 5% after.
        ctc_weight: weight of the CTC loss in the joint loss (1.0 = CTC only).
        dropout: residual dropout; attention/activation dropout is ``dropout * 2/3``.
        average: number of last epoch checkpoints averaged into the exported weights.
        eval_every: epochs between dev evaluations (CTC greedy WER and raw WER/CER, see
            :func:`~rayspec.metrics.error_rates`; attention greedy too when the decoder trains).
        regularize_after: steps trained without SpecAugment, dropout and weight decay before they switch on. From
            scratch on a CPU budget, regularizing from step 0 holds CTC on its blank plateau far longer (AN4, 500
            steps, same seed: CTC loss 2.11 with, 1.38 without; dev WER after 1,500 steps: see the issue notes).
    """

    epochs: int = 60
    batch_frames: int = 12000
    lr: float = 1.5e-3
    warmup_steps: int = 300
    weight_decay: float = 0.05
    ctc_weight: float = 0.4
    label_smoothing: float = 0.1
    dropout: float = 0.15
    freq_masks: int = 2
    freq_width: int = 15
    time_masks: int = 3
    time_fraction: float = 0.08
    average: int = 5
    eval_every: int = 5
    seed: int = 0
    threads: int = 2
    dev_fraction: float = 0.08
    regularize_after: int = 0


N_MELS = 80


def feature_extractor_config(frame_stack: int) -> dict:
    """``WhisperFeatureExtractor`` settings: 80 log-mel bins, 25 ms window, a hop of ``20 / frame_stack`` ms so that
    stacking gives 50 input frames (25 encoder positions) per second."""
    return dict(feature_size=N_MELS, sampling_rate=16000, hop_length=320 // frame_stack, chunk_length=30, n_fft=400)


def new_model(arch: Architecture, dropout: float, out_dir: str, feature_stats=None) -> WhisperASR:
    """A randomly initialised zoo model with the character tokenizer, written to ``out_dir`` and loaded back.

    Args:
        feature_stats: optional ``(mean, std)`` per mel bin of the training features, stored in the config and
            applied by the adapter's masked encoder (global mean/variance normalization).
    """
    from transformers import GenerationConfig, WhisperConfig, WhisperFeatureExtractor, WhisperForConditionalGeneration

    tok = build_char_tokenizer(out_dir)
    ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    eot, sot, nots = ids["<|endoftext|>"], ids["<|startoftranscript|>"], ids["<|notimestamps|>"]
    space = tok.convert_tokens_to_ids("\u0120")
    cfg = WhisperConfig(
        vocab_size=len(tok), num_mel_bins=N_MELS * arch.frame_stack, d_model=arch.d_model,
        encoder_layers=arch.encoder_layers, decoder_layers=arch.decoder_layers,
        encoder_attention_heads=arch.heads, decoder_attention_heads=arch.heads,
        encoder_ffn_dim=arch.ffn, decoder_ffn_dim=arch.ffn,
        max_source_positions=arch.max_source_positions, max_target_positions=arch.max_target_positions,
        dropout=dropout, attention_dropout=dropout * 2 / 3, activation_dropout=dropout * 2 / 3,
        pad_token_id=eot, bos_token_id=eot, eos_token_id=eot, decoder_start_token_id=sot,
        suppress_tokens=[], begin_suppress_tokens=[space, eot], tie_word_embeddings=True,
    )
    cfg.rayspec_encoder_masking = True
    cfg.rayspec_frame_stack = arch.frame_stack
    if feature_stats is not None:
        cfg.rayspec_feature_mean, cfg.rayspec_feature_std = [list(map(float, v)) for v in feature_stats]
    model = WhisperForConditionalGeneration(cfg)
    _init_front_end(model.model.encoder, arch.position_scale)
    gen = GenerationConfig(
        decoder_start_token_id=sot, eos_token_id=eot, pad_token_id=eot, bos_token_id=eot,
        no_timestamps_token_id=nots, is_multilingual=False, max_length=arch.max_target_positions,
        suppress_tokens=sorted(set(ids.values()) - {eot}), begin_suppress_tokens=[space, eot],
    )
    model.generation_config = gen
    model.save_pretrained(out_dir)
    gen.save_pretrained(out_dir)
    WhisperFeatureExtractor(**feature_extractor_config(arch.frame_stack)).save_pretrained(out_dir)
    return WhisperASR.from_pretrained(out_dir)


def architecture_of(config) -> Architecture:
    """The :class:`Architecture` of a ``WhisperConfig`` (to warm-start a run from an existing model)."""
    return Architecture(
        d_model=config.d_model, encoder_layers=config.encoder_layers, decoder_layers=config.decoder_layers,
        heads=config.encoder_attention_heads, ffn=config.encoder_ffn_dim,
        max_source_positions=config.max_source_positions, max_target_positions=config.max_target_positions,
        frame_stack=int(getattr(config, "rayspec_frame_stack", 1)),
    )


def _init_front_end(encoder, position_scale: float) -> None:
    """Give the audio path a fair start against the position embeddings.

    With Whisper's init (std 0.02) and Whisper's log-mel scale (std ~0.35), the conv front-end's output is ~40x
    smaller than the sinusoidal position embeddings it is added to. Trained from scratch on an hour of speech, CTC then
    sat on the blank plateau for 900+ steps (measured, CTC loss 2.8, dev WER 100%). Kaiming-normal convs and position
    embeddings scaled by ``position_scale`` (:attr:`Architecture.position_scale`, 0.1 by default; stored in the
    checkpoint, so loading and inference are unchanged) fix the ratio. The zoo target's first phase kept Whisper's
    own scale (1.0), without regularization.
    """
    with torch.no_grad():
        for conv in (encoder.conv1, encoder.conv2):
            torch.nn.init.kaiming_normal_(conv.weight, nonlinearity="relu")
            conv.bias.zero_()
        encoder.embed_positions.weight.mul_(position_scale)


def feature_stats(examples: list[Example], frame_stack: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-bin mean and standard deviation (float64 ``[n_mels * frame_stack]`` each; the deviation at least 1e-3) of
    the speed-1.0 training features after frame stacking, over every frame of ``examples``."""
    cat = np.concatenate([stack_frames(e.features[SPEEDS.index(1.0)].astype(np.float64), frame_stack)
                          for e in examples], axis=1)
    return cat.mean(axis=1), np.maximum(cat.std(axis=1), 1e-3)


def _spec_augment(x: torch.Tensor, lengths: torch.Tensor, opt: TrainOptions, rng: random.Random, frame_stack: int,
                  fill: Optional[torch.Tensor] = None) -> torch.Tensor:
    """SpecAugment frequency and time masks on stacked features ``[B, n_mels * frame_stack, T]``, per row within its
    length; a frequency mask covers the same mel bins in every stacked frame (stacked rows ``m * frame_stack + j``,
    see :func:`~rayspec.models.features.stack_frames`). Masked cells get ``fill`` (``[n_mels * frame_stack, 1]``, the
    feature mean, i.e. 0 after normalization) or 0."""
    fill = torch.zeros(x.shape[1], 1) if fill is None else fill
    x = x.clone()
    n_mels = x.shape[1] // frame_stack
    for b in range(x.shape[0]):
        for _ in range(opt.freq_masks):
            w = rng.randint(0, opt.freq_width)
            f0 = rng.randint(0, n_mels - w)
            lo, hi = f0 * frame_stack, (f0 + w) * frame_stack
            x[b, lo:hi, :] = fill[lo:hi]
        t_len = int(lengths[b])
        for _ in range(opt.time_masks):
            w = rng.randint(0, max(1, int(t_len * opt.time_fraction)))
            t0 = rng.randint(0, max(0, t_len - w))
            x[b, :, t0 : t0 + w] = fill
    return x


def warmup_cosine(step: int, lr: float, warmup_steps: int, total: int) -> float:
    """Learning rate at optimizer ``step``: linear warm-up to ``lr`` over ``warmup_steps``, then cosine decay to 5% of
    ``lr`` over ``total`` steps (the frozen-target recipes: draft decoder, CTC head)."""
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    return lr * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup_steps) / max(1, total)))))


def length_batches(lengths: list[int], budget: int, rng: random.Random) -> list[list[int]]:
    """Length-sorted batches under a padded-frame budget, in random order."""
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], rng.random()))
    out, cur = [], []
    for i in order:
        if cur and lengths[i] * (len(cur) + 1) > budget:
            out.append(cur)
            cur = []
        cur.append(i)
    if cur:
        out.append(cur)
    rng.shuffle(out)
    return out


def collate_features(examples: list[Example], speed_idx: list[int], tokenizer, device, frame_stack: int):
    """One padded batch of ``examples``, each at its speed index: ``(features [B, n_mels * frame_stack, T] float32,
    frame lengths int64 [B], token id lists of the transcripts)``."""
    feats = [stack_frames(torch.from_numpy(ex.features[s].astype(np.float32)), frame_stack)
             for ex, s in zip(examples, speed_idx)]
    lengths = torch.tensor([f.shape[1] for f in feats])
    x = torch.zeros(len(feats), feats[0].shape[0], int(lengths.max()))
    for i, f in enumerate(feats):
        x[i, :, : f.shape[1]] = f
    toks = [tokenizer(ex.text, add_special_tokens=False).input_ids for ex in examples]
    return x.to(device), lengths.to(device), toks


def _losses(model: WhisperASR, ctc: CTCHead, x, lengths, toks, opt: TrainOptions):
    enc = model.encode(x, lengths)
    logp = ctc(enc.states, enc.lengths)
    targets = [ctc.targets(torch.tensor(t, dtype=torch.long)) for t in toks]
    flat = torch.cat(targets) if targets else torch.zeros(0, dtype=torch.long)
    ctc_loss = F.ctc_loss(
        logp.transpose(0, 1), flat, enc.lengths.cpu(), torch.tensor([len(t) for t in targets]),
        blank=0, reduction="mean", zero_infinity=True,
    )
    prompt = model.prompt_ids
    p, eos = len(prompt), model.eos_token_id
    width = max(len(t) for t in toks) + 1
    inp = torch.full((len(toks), p + width - 1), eos, dtype=torch.long)
    labels = torch.full((len(toks), width), -100, dtype=torch.long)
    for i, t in enumerate(toks):
        inp[i, :p] = torch.tensor(prompt)
        inp[i, p : p + len(t)] = torch.tensor(t, dtype=torch.long)
        labels[i, : len(t) + 1] = torch.tensor(t + [eos], dtype=torch.long)
    cache = model.new_cache(enc, inp.shape[1])
    logits = model.decode(cache, inp.to(x.device))[:, p - 1 :]
    att = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.to(x.device).reshape(-1),
                          ignore_index=-100, label_smoothing=opt.label_smoothing)
    return ctc_loss, att


@torch.no_grad()
def evaluate(model: WhisperASR, ctc: CTCHead, examples: list[Example]) -> dict:
    """Dev WER of greedy CTC and greedy attention decoding, speed 1.0 features, batches of 16."""
    was = model.model.training
    model.model.eval()
    refs, hyp_ctc, hyp_att = [], [], []
    order = sorted(range(len(examples)), key=lambda i: examples[i].features[SPEEDS.index(1.0)].shape[1])
    for s in range(0, len(order), 16):
        batch = [examples[i] for i in order[s : s + 16]]
        x, lengths, _ = collate_features(batch, [SPEEDS.index(1.0)] * len(batch), model.tokenizer, model.device,
                                         model.frame_stack)
        enc = model.encode(x, lengths)
        refs += [ex.text for ex in batch]
        hyp_ctc += [model.decode_text(t) for t in ctc.greedy(ctc(enc.states, enc.lengths), enc.lengths)]
        caps = [min(200, int(l) // 2) for l in lengths]
        hyp_att += [model.decode_text(h.tokens) for h in greedy_decode(model, enc, caps)]
    model.model.train(was)
    out = {}
    for name, hyps in (("ctc", hyp_ctc), ("att", hyp_att)):
        if hyps:
            raw = error_rates(refs, hyps, normalized=False)  # spelled-out numbers stay words: progress shows early
            out.update({f"dev_{name}_wer": error_rates(refs, hyps).wer, f"dev_{name}_wer_raw": raw.wer,
                        f"dev_{name}_cer_raw": raw.cer})
    return out


@dataclass
class RunState:
    """Where a training run stands, saved with each checkpoint so an interrupted run resumes: the next epoch, the
    optimizer steps taken, and one dict of metrics per finished epoch."""

    epoch: int = 0
    step: int = 0
    history: list = field(default_factory=list)


def train(
    kind: str,
    manifests: list[str],
    out_dir: str,
    work_dir: str,
    opt: TrainOptions,
    arch: Optional[Architecture] = None,
    teacher_dir: Optional[str] = None,
    ctc_out: Optional[str] = None,
    max_steps: Optional[int] = None,
    max_utterances: Optional[int] = None,
    init_dir: Optional[str] = None,
    init_ctc: Optional[str] = None,
) -> dict:
    """Train one zoo model and export it.

    Args:
        kind: "target" (joint CTC-attention; exports the CTC head to ``ctc_out`` if given) or "draft" (distilled
            from ``teacher_dir``'s greedy transcripts when given). The CTC head of a frozen target is
            :func:`~rayspec.train.ctc_head.train_ctc_head`.
        manifests: training manifests (JSONL/CSV/Parquet with id, audio, text).
        out_dir: where the model directory is written (``from_pretrained``-loadable).
        work_dir: checkpoints, feature cache and ``log.jsonl``; a re-run resumes from here.
        opt, arch: recipe options and sizes (defaults per kind).
        max_steps, max_utterances: limits for smoke runs.
        init_dir, init_ctc: warm start (target/draft): initialise from this model directory (its architecture and
            feature normalization; ``arch`` is ignored) and this CTC head directory instead of random weights. A
            curriculum: a model that left CTC's blank plateau on easy data (AN4) continues on the harder mix.

    Returns:
        Summary dict (parameters, epochs, minutes, last dev metrics), also written to ``<work_dir>/summary.json``.

    Raises:
        ValueError: unknown kind.
    """
    if kind not in ("target", "draft"):
        raise ValueError(f"unknown kind {kind!r} (target or draft)")
    torch.set_num_threads(opt.threads)
    torch.manual_seed(opt.seed)
    rng = random.Random(opt.seed)
    os.makedirs(work_dir, exist_ok=True)
    arch = arch or (DRAFT_ARCH if kind == "draft" else TARGET_ARCH)
    from transformers import WhisperFeatureExtractor

    train_utts, dev_utts = split_manifests(manifests, opt.dev_fraction, opt.seed)
    if max_utterances:
        train_utts, dev_utts = train_utts[:max_utterances], dev_utts[: max(2, max_utterances // 4)]
    cache_dir = os.path.join(work_dir, "..", "features")
    warm = WhisperASR.from_pretrained(init_dir) if init_dir else None
    if warm is not None:
        arch = architecture_of(warm.config)
    fe = warm.feature_extractor if warm is not None else WhisperFeatureExtractor(**feature_extractor_config(
        arch.frame_stack))
    train_ex = load_examples(train_utts, fe, cache_dir)
    dev_ex = load_examples(dev_utts, fe, cache_dir, speeds=(1.0,))

    fresh_dir = os.path.join(work_dir, "init")
    if warm is not None:
        stats = (warm.config.rayspec_feature_mean, warm.config.rayspec_feature_std)
        model = new_model(arch, opt.dropout, fresh_dir, stats)
        model.model.load_state_dict(warm.model.state_dict())
        del warm
    else:
        model = new_model(arch, opt.dropout, fresh_dir, feature_stats(train_ex, arch.frame_stack))
    model.model.model.encoder.embed_positions.requires_grad_(False)  # fixed sinusoids (from_pretrained unfreezes)
    tok = model.tokenizer
    special = set(tok.convert_tokens_to_ids(SPECIAL_TOKENS))
    char_ids = [i for i in range(len(tok)) if i not in special]
    ctc = CTCHead(model.config.d_model, char_ids)
    if init_ctc:
        ctc.load_state_dict(CTCHead.from_pretrained(init_ctc).state_dict())
    dev_ex = [Example(e.id, [e.features[0]] * len(SPEEDS), e.text) for e in dev_ex]
    if kind == "draft" and teacher_dir:
        train_ex += _distillation_examples(teacher_dir, train_ex, work_dir)

    named = [(n, p) for n, p in model.model.named_parameters() if p.requires_grad] + list(ctc.named_parameters())
    params = [p for _, p in named]
    # Weight decay on matrices only: not on biases, LayerNorm gains or embeddings (the usual AdamW practice).
    decayed = [p for n, p in named if p.ndim >= 2 and "embed" not in n]
    ids = {id(p) for p in decayed}
    optim = torch.optim.AdamW([{"params": decayed, "weight_decay": opt.weight_decay},
                               {"params": [p for p in params if id(p) not in ids], "weight_decay": 0.0}],
                              lr=opt.lr, betas=(0.9, 0.98))
    lengths = [e.features[1].shape[1] // model.frame_stack for e in train_ex]  # encoder input frames
    steps_per_epoch = len(length_batches(lengths, opt.batch_frames, random.Random(0)))
    total = max(1, opt.epochs * steps_per_epoch)

    def lr_at(step: int) -> float:
        if step < opt.warmup_steps:
            return opt.lr * (step + 1) / opt.warmup_steps
        prog = min(1.0, (step - opt.warmup_steps) / max(1, total - opt.warmup_steps))
        return opt.lr * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * prog)))

    state = RunState()
    ckpt = os.path.join(work_dir, "checkpoint.pt")
    if os.path.exists(ckpt):
        saved = torch.load(ckpt, weights_only=True)
        model.model.load_state_dict(saved["model"])
        ctc.load_state_dict(saved["ctc"])
        _load_optimizer(optim, saved["optim"], params)
        state = RunState(**saved["state"])
        rng.setstate(saved["rng"])
        torch.set_rng_state(saved["torch_rng"])
        print(f"resuming {kind} from epoch {state.epoch} ({ckpt})")
    model.model.train()
    ctc.train()
    log_path = os.path.join(work_dir, "log.jsonl")
    t_start = time.time()
    while state.epoch < opt.epochs and (max_steps is None or state.step < max_steps):
        t0 = time.time()
        batches = length_batches(lengths, opt.batch_frames, rng)
        sums = np.zeros(3)
        bar = tqdm(batches, desc=f"{kind} epoch {state.epoch + 1}/{opt.epochs}", leave=False)
        for idx in bar:
            if max_steps is not None and state.step >= max_steps:
                break
            ex = [train_ex[i] for i in idx]
            x, xl, toks = collate_features(ex, [rng.randrange(len(SPEEDS)) for _ in ex], tok, model.device,
                                           model.frame_stack)
            regularize = state.step >= opt.regularize_after
            if regularize:
                x = _spec_augment(x, xl, opt, rng, model.frame_stack, model.feature_mean)
            model.model.train(regularize)  # eval mode = no dropout (Whisper has no batch norm)
            ctc_loss, att_loss = _losses(model, ctc, x, xl, toks, opt)
            loss = opt.ctc_weight * ctc_loss + (1 - opt.ctc_weight) * att_loss
            for g in optim.param_groups:
                g["lr"] = lr_at(state.step)
            optim.param_groups[0]["weight_decay"] = opt.weight_decay if regularize else 0.0
            optim.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 5.0)
            optim.step()
            state.step += 1
            sums += [ctc_loss.item(), att_loss.item(), 1]
            bar.set_postfix(ctc=f"{sums[0] / sums[2]:.3f}", att=f"{sums[1] / sums[2]:.3f}")
        state.epoch += 1
        rec = {"epoch": state.epoch, "step": state.step, "ctc_loss": float(sums[0] / max(1, sums[2])),
               "att_loss": float(sums[1] / max(1, sums[2])), "epoch_s": round(time.time() - t0, 1),
               "lr": lr_at(state.step)}
        if state.epoch % opt.eval_every == 0 or state.epoch == opt.epochs:
            rec.update(evaluate(model, ctc, dev_ex))
            model.model.train()
        state.history.append(rec)
        print(json.dumps(rec), flush=True)
        with open(log_path, "a") as f:
            f.write(json.dumps(rec) + "\n")
        _save_epoch(work_dir, model, ctc, optim, state, rng, opt.average)

    model.model.load_state_dict(_average(work_dir, "model", opt.average, model.model.state_dict()))
    ctc.load_state_dict(_average(work_dir, "ctc", opt.average, ctc.state_dict()))
    model.model.eval()
    ctc.eval()
    final = evaluate(model, ctc, dev_ex)
    _export(model, out_dir)
    if ctc_out:
        ctc.save_pretrained(ctc_out)
    summary = {
        "kind": kind, "parameters": model.count_parameters(), "ctc_parameters": sum(p.numel() for p in ctc.parameters()),
        "epochs": state.epoch, "steps": state.step, "train_minutes_this_run": round((time.time() - t_start) / 60, 1),
        "train_minutes_total": round(sum(r["epoch_s"] for r in state.history) / 60, 1),
        "train_utterances": len(train_utts), "dev_utterances": len(dev_utts),
        "averaged_last": opt.average, "final_dev": final, "options": asdict(opt), "architecture": asdict(arch),
    }
    with open(os.path.join(work_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    return summary


def _distillation_examples(teacher_dir: str, examples: list[Example], work_dir: str) -> list[Example]:
    """Sequence-level distillation: the teacher's greedy transcript of every training utterance at every speed."""
    path = os.path.join(work_dir, "teacher_transcripts.json")
    if os.path.exists(path):
        with open(path) as f:
            texts = json.load(f)
    else:
        teacher = WhisperASR.from_pretrained(teacher_dir)
        texts = {}
        for s in range(len(SPEEDS)):
            for idx, _, hyps in teacher_greedy(teacher, examples, s):
                for i, h in zip(idx, hyps):
                    texts[f"{examples[i].id}@{s}"] = teacher.decode_text(h.tokens)
        with open(path, "w") as f:
            json.dump(texts, f)
    out = []
    for ex in examples:
        for s in range(len(SPEEDS)):
            only = [ex.features[s]] * len(SPEEDS)
            out.append(Example(f"{ex.id}@{s}", only, texts[f"{ex.id}@{s}"]))
    return out


@torch.inference_mode()
def teacher_greedy(teacher: WhisperASR, examples: list[Example], speed: int, batch: int = 16, cap: int = 200):
    """The teacher's greedy decode of ``examples`` at speed index ``speed``, in length-sorted batches: yields
    ``(example indices, encoder output, hypotheses)`` per batch (at most ``cap`` tokens, and at most one per two
    encoder input frames)."""
    order = sorted(range(len(examples)), key=lambda i: examples[i].features[speed].shape[1])
    for k in tqdm(range(0, len(order), batch), desc=f"teacher pass x{SPEEDS[speed]}"):
        idx = order[k : k + batch]
        x, xl, _ = collate_features([examples[i] for i in idx], [speed] * len(idx), teacher.tokenizer,
                                    teacher.device, teacher.frame_stack)
        enc = teacher.encode(x, xl)
        yield idx, enc, greedy_decode(teacher, enc, [min(cap, int(n) // 2) for n in xl])


def _load_optimizer(optim: torch.optim.Optimizer, saved: dict, params: list) -> None:
    """Resume an optimizer's state; a checkpoint from before weight decay was split into two parameter groups (one
    group over ``params`` in order) gets its per-parameter moments moved over, with today's groups."""
    if len(saved["param_groups"]) == len(optim.param_groups):
        optim.load_state_dict(saved)
        return
    order = [i for g in saved["param_groups"] for i in g["params"]]
    if len(order) != len(params):
        raise ValueError(f"the checkpoint's optimizer holds {len(order)} parameters, the model {len(params)}")
    for i, p in zip(order, params):
        if i in saved["state"]:
            optim.state[p] = {k: v.to(p.device) if torch.is_tensor(v) else v for k, v in saved["state"][i].items()}


def _save_epoch(work_dir, model, ctc, optim, state: RunState, rng, keep: int) -> None:
    torch.save({"model": model.model.state_dict(), "ctc": ctc.state_dict()},
               os.path.join(work_dir, f"epoch{state.epoch:04d}.pt"))
    old = os.path.join(work_dir, f"epoch{state.epoch - keep:04d}.pt")
    if os.path.exists(old):
        os.remove(old)
    tmp = os.path.join(work_dir, "checkpoint.pt.tmp")
    torch.save({"model": model.model.state_dict(), "ctc": ctc.state_dict(), "optim": optim.state_dict(),
                "state": asdict(state), "rng": rng.getstate(), "torch_rng": torch.get_rng_state()}, tmp)
    os.replace(tmp, os.path.join(work_dir, "checkpoint.pt"))


def _average(work_dir: str, key: str, k: int, current: dict) -> dict:
    """Average the last ``k`` epoch checkpoints (ESPnet's checkpoint averaging); ``current`` if none exist."""
    files = sorted(f for f in os.listdir(work_dir) if f.startswith("epoch") and f.endswith(".pt"))[-k:]
    if not files:
        return current
    states = [torch.load(os.path.join(work_dir, f), weights_only=True)[key] for f in files]
    return {n: (sum(s[n].float() for s in states) / len(states)).to(v.dtype) if v.is_floating_point() else v
            for n, v in current.items()}


def _export(model: WhisperASR, out_dir: str) -> None:
    """Write the trained model as a ``from_pretrained`` directory (safetensors + configs + tokenizer)."""
    os.makedirs(out_dir, exist_ok=True)
    model.model.config.dropout = model.model.config.attention_dropout = model.model.config.activation_dropout = 0.0
    model.model.save_pretrained(out_dir)
    model.generation_config.save_pretrained(out_dir)
    model.feature_extractor.save_pretrained(out_dir)
    model.tokenizer.save_pretrained(out_dir)
