"""llama2.c checkpoints (Karpathy's ``run.c`` format) -> a transformers ``LlamaForCausalLM`` directory.

The bundled voice-chat LM is llama2.c's stories260K (karpathy/tinyllamas). Its ``.bin`` holds a 7-int header (dim,
hidden_dim, n_layers, n_heads, n_kv_heads, vocab_size (negative: separate classifier), seq_len) and float32 arrays in
``run.c``'s order; ``tok512.bin`` holds the vocabulary with merge scores. Two format facts shape the conversion:

* ``run.c`` rotates interleaved pairs ``(2i, 2i+1)`` of each head (RoPE), transformers' Llama rotates half-split
  pairs ``(i, i + d/2)``: the query and key rows are permuted so both compute the same attention.
* ``run.c``'s tokenizer merges the adjacent pair whose concatenation has the highest score (sentencepiece BPE) after
  a dummy-prefix space, with byte fallback: a ``tokenizers`` BPE whose merge ranks follow the piece scores, with the
  ``Prepend("▁")`` normalizer and byte fallback of transformers' ``LlamaConverter``.

``pad_head_dim`` widens the heads with identical outputs (:mod:`rayspec.chat.heads`; vLLM's CPU attention accepts
head sizes 32, 64, ... only, stories260K has 8).
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass

import numpy as np
import torch

from .heads import widen_heads

HEADER = struct.Struct("7i")


class Llama2cError(ValueError):
    """The file is not a llama2.c checkpoint or tokenizer (its sizes do not add up)."""


@dataclass
class Llama2cConfig:
    """The ``run.c`` header. Sizes in elements; ``shared_classifier`` is the sign of the stored vocab size."""

    dim: int
    hidden_dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    vocab_size: int
    seq_len: int
    shared_classifier: bool

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


def read_checkpoint(path: str) -> tuple[Llama2cConfig, dict[str, np.ndarray]]:
    """Read a llama2.c ``.bin`` checkpoint.

    Returns:
        The header and float32 arrays keyed by ``run.c``'s names: ``token_embedding [V, D]``, ``rms_att [L, D]``,
        ``wq [L, D, D]``, ``wk``/``wv [L, KV, D]`` (KV = n_kv_heads * head_dim), ``wo [L, D, D]``, ``rms_ffn [L, D]``,
        ``w1``/``w3 [L, H, D]``, ``w2 [L, D, H]``, ``rms_final [D]``, ``wcls [V, D]``.

    Raises:
        Llama2cError: the header's sizes do not match the file's length.
    """
    with open(path, "rb") as f:
        raw = f.read()
    if len(raw) < HEADER.size:
        raise Llama2cError(f"{path}: too short for a llama2.c header")
    dim, hidden, layers, heads, kv_heads, vocab, seq = HEADER.unpack_from(raw)
    cfg = Llama2cConfig(dim, hidden, layers, heads, kv_heads, abs(vocab), seq, vocab > 0)
    if min(dim, hidden, layers, heads, kv_heads, abs(vocab), seq) <= 0 or dim % heads:
        raise Llama2cError(f"{path}: not a llama2.c checkpoint (header {HEADER.unpack_from(raw)})")
    kv = kv_heads * cfg.head_dim
    shapes = [("token_embedding", (cfg.vocab_size, dim)), ("rms_att", (layers, dim)), ("wq", (layers, dim, dim)),
              ("wk", (layers, kv, dim)), ("wv", (layers, kv, dim)), ("wo", (layers, dim, dim)),
              ("rms_ffn", (layers, dim)), ("w1", (layers, hidden, dim)), ("w2", (layers, dim, hidden)),
              ("w3", (layers, hidden, dim)), ("rms_final", (dim,)),
              ("freq_cis_real", (seq, cfg.head_dim // 2)), ("freq_cis_imag", (seq, cfg.head_dim // 2))]
    if not cfg.shared_classifier:
        shapes.append(("wcls", (cfg.vocab_size, dim)))
    need = sum(math.prod(s) for _, s in shapes) * 4 + HEADER.size
    if need != len(raw):
        raise Llama2cError(f"{path}: {len(raw)} bytes, the header {HEADER.unpack_from(raw)} implies {need}")
    flat = np.frombuffer(raw, dtype="<f4", offset=HEADER.size)
    out, at = {}, 0
    for name, shape in shapes:
        n = math.prod(shape)
        out[name] = flat[at : at + n].reshape(shape).copy()
        at += n
    out.setdefault("wcls", out["token_embedding"])
    return cfg, out


def read_tokenizer(path: str, vocab_size: int) -> tuple[list[str], list[float]]:
    """Read a llama2.c ``tokenizer.bin`` / ``tok512.bin``: ``vocab_size`` pieces (UTF-8) and their merge scores.

    Raises:
        Llama2cError: the file ends early or a piece is not UTF-8.
    """
    with open(path, "rb") as f:
        raw = f.read()
    pieces, scores, at = [], [], 4
    try:
        for _ in range(vocab_size):
            score, n = struct.unpack_from("<fi", raw, at)
            pieces.append(raw[at + 8 : at + 8 + n].decode("utf-8"))
            scores.append(score)
            at += 8 + n
    except (struct.error, UnicodeDecodeError) as e:
        raise Llama2cError(f"{path}: not a llama2.c tokenizer with {vocab_size} pieces ({e})") from e
    return pieces, scores


def _rope_permutation(head_dim: int) -> np.ndarray:
    """Row order that turns ``run.c``'s interleaved pairs into transformers' half-split pairs, per head:
    new row ``i`` (``i < d/2``) is old row ``2i``, new row ``d/2 + i`` is old row ``2i + 1``."""
    half = head_dim // 2
    return np.concatenate([np.arange(half) * 2, np.arange(half) * 2 + 1])


def convert(checkpoint: str, tokenizer: str, out_dir: str, pad_head_dim: int | None = None) -> str:
    """Write a llama2.c checkpoint + tokenizer as a ``from_pretrained``-loadable ``LlamaForCausalLM`` directory
    (safetensors, ``config.json``, ``generation_config.json``, ``tokenizer.json``).

    Args:
        checkpoint: llama2.c ``.bin`` (float32, version 0 format of ``run.c``).
        tokenizer: llama2.c tokenizer ``.bin`` with as many pieces as the model's vocabulary.
        out_dir: output directory (created).
        pad_head_dim: widen every attention head to this size with identical outputs (see the module docstring);
            a multiple of the original head size.

    Returns:
        ``out_dir``.

    Raises:
        Llama2cError: malformed files, or a ``pad_head_dim`` that is not a multiple of the head size.
    """
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    cfg, w = read_checkpoint(checkpoint)
    hd = cfg.head_dim
    width = pad_head_dim or hd
    if width % hd or width < hd:
        raise Llama2cError(f"--pad-head-dim {width} is not a multiple of the head size {hd}")
    rope = _rope_permutation(hd)
    config = LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.dim, intermediate_size=cfg.hidden_dim,
        num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.n_kv_heads,
        head_dim=hd, max_position_embeddings=cfg.seq_len, rms_norm_eps=1e-5, rope_theta=10000.0,
        tie_word_embeddings=cfg.shared_classifier, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        attention_bias=False, mlp_bias=False, hidden_act="silu",
    )
    model = LlamaForCausalLM(config)
    state = {"model.embed_tokens.weight": w["token_embedding"], "model.norm.weight": w["rms_final"]}
    if not cfg.shared_classifier:
        state["lm_head.weight"] = w["wcls"]
    for i in range(cfg.n_layers):
        p = f"model.layers.{i}."
        state[p + "input_layernorm.weight"] = w["rms_att"][i]
        state[p + "post_attention_layernorm.weight"] = w["rms_ffn"][i]
        state[p + "self_attn.q_proj.weight"] = w["wq"][i].reshape(cfg.n_heads, hd, -1)[:, rope].reshape(cfg.dim, -1)
        state[p + "self_attn.k_proj.weight"] = w["wk"][i].reshape(cfg.n_kv_heads, hd, -1)[:, rope].reshape(-1, cfg.dim)
        state[p + "self_attn.v_proj.weight"] = w["wv"][i]
        state[p + "self_attn.o_proj.weight"] = w["wo"][i]
        state[p + "mlp.gate_proj.weight"] = w["w1"][i]
        state[p + "mlp.down_proj.weight"] = w["w2"][i]
        state[p + "mlp.up_proj.weight"] = w["w3"][i]
    missing, unexpected = model.load_state_dict({k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in
                                                 state.items()}, strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise Llama2cError(f"weights do not map onto LlamaForCausalLM: missing {missing}, unexpected {unexpected}")
    if width != hd:
        widen_heads(model, width)
    model.generation_config = GenerationConfig(bos_token_id=1, eos_token_id=[2, 1], pad_token_id=0)
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir)
    _tokenizer(*read_tokenizer(tokenizer, cfg.vocab_size)).save_pretrained(out_dir)
    with open(os.path.join(out_dir, "rayspec_source.json"), "w") as f:
        json.dump({"llama2c_checkpoint": os.path.basename(checkpoint), "llama2c_tokenizer": os.path.basename(tokenizer),
                   "original_head_dim": hd, "head_dim": width}, f, indent=2)
    return out_dir


def _tokenizer(pieces: list[str], scores: list[float]):
    """A ``PreTrainedTokenizerFast`` that encodes as ``run.c``'s ``encode`` does (BPE by piece score, dummy-prefix
    space, byte fallback) and decodes as its ``decode`` does."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    special = {0: "<unk>", 1: "<s>", 2: "</s>"}
    vocab = {}
    for i, p in enumerate(pieces):
        vocab[special.get(i, p.replace(" ", "\u2581"))] = i
    ranked = sorted(((s, i) for i, s in enumerate(scores) if i > 258), key=lambda t: (-t[0], t[1]))
    merges = []
    for _, i in ranked:  # every split of a piece into two pieces is a merge, ranked by the piece's score
        piece = pieces[i].replace(" ", "\u2581")
        for k in range(1, len(piece)):
            left, right = piece[:k], piece[k:]
            if left in vocab and right in vocab:
                merges.append((left, right))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   add_bos_token=False, clean_up_tokenization_spaces=False)
