"""CTranslate2 (faster-whisper) Whisper checkpoints -> transformers ``WhisperForConditionalGeneration`` directories.

CTranslate2 converts transformers checkpoints into its own ``model.bin`` but ships no way back; rayspec's engine runs
on transformers' modules, so it reads the file itself (:func:`read_model_bin`) and writes a ``save_pretrained``
directory (:func:`convert_ct2`): weights (safetensors, float32), ``config.json``, tokenizer, feature extractor and a
generation config carrying CTranslate2's ``suppress_ids`` / ``suppress_ids_begin`` / ``lang_ids`` /
``alignment_heads``. The name mapping is the inverse of CTranslate2's own Whisper loader
(``ctranslate2/converters/transformers.py``: ``WhisperLoader``); no tensor is transposed (both keep torch's
``[out, in]`` layouts), and the stacked projections are split: self-attention ``linear_0`` is q|k|v, cross-attention
``linear_1`` is k|v (CTranslate2 stores a zero bias for k, which transformers' ``k_proj`` does not have).
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import tempfile
from typing import TYPE_CHECKING, BinaryIO, Iterable

import numpy as np

from .errors import ModelLoadError

if TYPE_CHECKING:  # the registry checks and names models without torch; converting imports it
    import torch

CT2_FILES = ("model.bin", "config.json")
CONVERTER_VERSION = 1  # part of the conversion cache's key: bump when the written directory changes
# model.bin dtype codes (CTranslate2's DataType enum)
_DTYPES = {0: np.float32, 1: np.int8, 2: np.int16, 3: np.int32, 4: np.float16}
_BFLOAT16 = 5


def is_ct2_dir(path: str) -> bool:
    """Whether ``path`` holds a CTranslate2 model (``model.bin`` + ``config.json``)."""
    return all(os.path.isfile(os.path.join(path, n)) for n in CT2_FILES)


def _read_str(f: BinaryIO) -> str:
    (n,) = struct.unpack("<H", f.read(2))
    return f.read(n).rstrip(b"\0").decode("utf-8")


def read_model_bin(stream: BinaryIO) -> dict[str, torch.Tensor]:
    """Every variable of a CTranslate2 ``model.bin`` (format version 6), aliases resolved.

    Layout: u32 version, the spec name, u32 revision, u32 variable count, then per variable its name, u8 rank,
    rank x u32 dims, u8 dtype, u32 byte count and the raw little-endian data; then u32 alias count and
    ``(alias, target)`` name pairs.

    Returns:
        name -> tensor in the stored dtype (float16 / bfloat16 / float32 / int), rank-0 for scalars.

    Raises:
        ModelLoadError: another format version, an unknown dtype, or a truncated file.
    """
    import torch

    try:
        (version,) = struct.unpack("<I", stream.read(4))
        if version != 6:
            raise ModelLoadError(f"CTranslate2 model.bin format version {version} is not supported (expected 6)")
        _read_str(stream)  # spec name, e.g. "WhisperSpec"
        _revision, count = struct.unpack("<II", stream.read(8))
        out: dict[str, torch.Tensor] = {}
        for _ in range(count):
            name = _read_str(stream)
            (rank,) = struct.unpack("<B", stream.read(1))
            dims = struct.unpack(f"<{rank}I", stream.read(4 * rank)) if rank else ()
            (code,), (nbytes,) = struct.unpack("<B", stream.read(1)), struct.unpack("<I", stream.read(4))
            raw = stream.read(nbytes)
            if len(raw) != nbytes:
                raise ModelLoadError("CTranslate2 model.bin is truncated")
            if code == _BFLOAT16:
                t = torch.frombuffer(bytearray(raw), dtype=torch.bfloat16)
            elif code in _DTYPES:
                t = torch.from_numpy(np.frombuffer(raw, dtype=_DTYPES[code]).copy())
            else:
                raise ModelLoadError(f"CTranslate2 variable {name} has unknown dtype code {code}")
            out[name] = t.reshape(dims)
        (aliases,) = struct.unpack("<I", stream.read(4) or b"\0\0\0\0")
        for _ in range(aliases):
            alias, target = _read_str(stream), _read_str(stream)
            out[alias] = out[target]
        return out
    except struct.error as e:
        raise ModelLoadError(f"CTranslate2 model.bin is truncated or corrupt ({e})") from e


class _Concat:
    """A read-only stream over several files in order (a ``model.bin`` split into parts)."""

    def __init__(self, paths: Iterable[str]) -> None:
        self._files = [open(p, "rb") for p in paths]

    def read(self, n: int) -> bytes:
        out = b""
        while len(out) < n and self._files:
            chunk = self._files[0].read(n - len(out))
            if not chunk:
                self._files.pop(0).close()
                continue
            out += chunk
        return out

    def close(self) -> None:
        for f in self._files:
            f.close()


def _layers(variables: dict, prefix: str) -> int:
    n = 0
    while any(k.startswith(f"{prefix}/layer_{n}/") for k in variables):
        n += 1
    return n


def state_dict_from_ct2(v: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict]:
    """transformers' Whisper state dict (float32) and model dimensions from CTranslate2 variables.

    Returns:
        ``(state_dict, dims)``; dims has ``d_model``, ``heads``, ``encoder_layers``, ``decoder_layers``, ``ffn``,
        ``vocab``, ``mels``, ``source_positions``, ``target_positions``.

    Raises:
        ModelLoadError: variables of another architecture (a missing Whisper weight).
    """
    sd: dict[str, torch.Tensor] = {}

    quantized = sorted(k for k, t in v.items() if k.endswith("weight") and not t.is_floating_point())
    if quantized:
        raise ModelLoadError(f"quantized CTranslate2 weights ({v[quantized[0]].dtype}, e.g. {quantized[0]}) are not "
                             "supported: convert the model with --quantization float16 or float32")

    def put(dst: str, src: str) -> torch.Tensor:
        if src not in v:
            raise ModelLoadError(f"CTranslate2 model.bin lacks {src}: not a Whisper model")
        sd[dst] = v[src].float()
        return sd[dst]

    def linear(dst: str, src: str, bias: bool = True) -> None:
        put(f"{dst}.weight", f"{src}/weight")
        if bias:
            put(f"{dst}.bias", f"{src}/bias")

    def norm(dst: str, src: str) -> None:
        put(f"{dst}.weight", f"{src}/gamma")
        put(f"{dst}.bias", f"{src}/beta")

    def split(dst: str, names: list[str], src: str) -> None:
        w, b = v[f"{src}/weight"].float().chunk(len(names)), v[f"{src}/bias"].float().chunk(len(names))
        for name, wi, bi in zip(names, w, b):
            sd[f"{dst}.{name}.weight"] = wi.contiguous()
            if name != "k_proj":  # transformers' k projections have no bias (CTranslate2 stores zeros)
                sd[f"{dst}.{name}.bias"] = bi.contiguous()

    enc, dec = "model.encoder", "model.decoder"
    linear(f"{enc}.conv1", "encoder/conv1")
    linear(f"{enc}.conv2", "encoder/conv2")
    put(f"{enc}.embed_positions.weight", "encoder/position_encodings/encodings")
    norm(f"{enc}.layer_norm", "encoder/layer_norm")
    n_enc, n_dec = _layers(v, "encoder"), _layers(v, "decoder")
    def self_attention_and_ffn(dst: str, src: str) -> None:  # what encoder and decoder layers share
        split(f"{dst}.self_attn", ["q_proj", "k_proj", "v_proj"], f"{src}/self_attention/linear_0")
        linear(f"{dst}.self_attn.out_proj", f"{src}/self_attention/linear_1")
        norm(f"{dst}.self_attn_layer_norm", f"{src}/self_attention/layer_norm")
        linear(f"{dst}.fc1", f"{src}/ffn/linear_0")
        linear(f"{dst}.fc2", f"{src}/ffn/linear_1")
        norm(f"{dst}.final_layer_norm", f"{src}/ffn/layer_norm")

    for i in range(n_enc):
        self_attention_and_ffn(f"{enc}.layers.{i}", f"encoder/layer_{i}")
    put(f"{dec}.embed_tokens.weight", "decoder/embeddings/weight")
    put(f"{dec}.embed_positions.weight", "decoder/position_encodings/encodings")
    norm(f"{dec}.layer_norm", "decoder/layer_norm")
    for i in range(n_dec):
        src, dst = f"decoder/layer_{i}", f"{dec}.layers.{i}"
        self_attention_and_ffn(dst, src)
        linear(f"{dst}.encoder_attn.q_proj", f"{src}/attention/linear_0")
        split(f"{dst}.encoder_attn", ["k_proj", "v_proj"], f"{src}/attention/linear_1")
        linear(f"{dst}.encoder_attn.out_proj", f"{src}/attention/linear_2")
        norm(f"{dst}.encoder_attn_layer_norm", f"{src}/attention/layer_norm")
    emb = sd[f"{dec}.embed_tokens.weight"]
    heads = v.get("encoder/num_heads", v.get("num_heads"))
    d_model = emb.shape[1]
    dims = dict(
        d_model=d_model, heads=int(heads) if heads is not None else d_model // 64, encoder_layers=n_enc,
        decoder_layers=n_dec, ffn=sd[f"{enc}.layers.0.fc1.weight"].shape[0], vocab=emb.shape[0],
        mels=sd[f"{enc}.conv1.weight"].shape[1], source_positions=sd[f"{enc}.embed_positions.weight"].shape[0],
        target_positions=sd[f"{dec}.embed_positions.weight"].shape[0],
    )
    return sd, dims


def _tokenizer(src: str, vocab_size: int):
    """transformers' Whisper tokenizer from CTranslate2's ``tokenizer.json``, completed to ``vocab_size`` ids with
    the tokens of ``vocabulary.txt`` / ``vocabulary.json`` it lacks (tiny.en's file stops before the 1,501
    timestamp tokens)."""
    from tokenizers import AddedToken, Tokenizer
    from transformers import WhisperTokenizerFast

    path = os.path.join(src, "tokenizer.json")
    if not os.path.isfile(path):
        raise ModelLoadError(f"{src} has no tokenizer.json (a faster-whisper directory has one)")
    tok = Tokenizer.from_file(path)
    if tok.get_vocab_size(with_added_tokens=True) < vocab_size:
        if os.path.isfile(os.path.join(src, "vocabulary.json")):
            with open(os.path.join(src, "vocabulary.json"), encoding="utf-8") as f:
                words = json.load(f)
        elif os.path.isfile(os.path.join(src, "vocabulary.txt")):
            with open(os.path.join(src, "vocabulary.txt"), encoding="utf-8") as f:
                words = f.read().split("\n")
        else:
            raise ModelLoadError(f"{src}: tokenizer.json has fewer ids than the model and no vocabulary file")
        have = tok.get_vocab_size(with_added_tokens=True)
        tok.add_special_tokens([AddedToken(w, special=True, normalized=False) for w in words[have:vocab_size]])
    if tok.get_vocab_size(with_added_tokens=True) != vocab_size:
        raise ModelLoadError(f"{src}: the tokenizer has {tok.get_vocab_size(with_added_tokens=True)} ids, the model "
                             f"{vocab_size}")
    return WhisperTokenizerFast(tokenizer_object=tok, unk_token="<|endoftext|>", bos_token="<|endoftext|>",
                                eos_token="<|endoftext|>", pad_token="<|endoftext|>")


def convert_ct2(src: str, dst: str, model_bin: Iterable[str] | None = None) -> str:
    """Write a CTranslate2 Whisper directory as a transformers ``save_pretrained`` directory.

    Args:
        src: the CTranslate2 directory (``config.json``, ``tokenizer.json``, vocabulary file; ``model.bin`` unless
            ``model_bin`` names its parts).
        dst: output directory (created, or an earlier conversion replaced; written into a temporary sibling and
            renamed, so a reader never sees half a model).
        model_bin: the parts of ``model.bin`` in order (a file split across packages), default ``src/model.bin``.

    Returns:
        ``dst``.

    Raises:
        ModelLoadError: missing files, another format or architecture.
    """
    import torch

    from transformers import GenerationConfig, WhisperConfig, WhisperFeatureExtractor, WhisperForConditionalGeneration

    parts = list(model_bin) if model_bin else [os.path.join(src, "model.bin")]
    if os.path.abspath(src) == os.path.abspath(dst):
        raise ModelLoadError(f"convert {src} into another directory, not into itself")
    for p in parts + [os.path.join(src, "config.json")]:
        if not os.path.isfile(p):
            raise ModelLoadError(f"CTranslate2 model file not found: {p}")
    stream = _Concat(parts)
    try:
        variables = read_model_bin(stream)
    finally:
        stream.close()
    sd, d = state_dict_from_ct2(variables)
    with open(os.path.join(src, "config.json"), encoding="utf-8") as f:
        ct2 = json.load(f)
    tok = _tokenizer(src, d["vocab"])
    ids = tok.convert_tokens_to_ids
    eot, sot, no_ts = ids("<|endoftext|>"), ids("<|startoftranscript|>"), ids("<|notimestamps|>")
    multilingual = d["vocab"] >= 51865  # openai/whisper: model.is_multilingual
    cfg = WhisperConfig(
        vocab_size=d["vocab"], num_mel_bins=d["mels"], d_model=d["d_model"], encoder_layers=d["encoder_layers"],
        decoder_layers=d["decoder_layers"], encoder_attention_heads=d["heads"], decoder_attention_heads=d["heads"],
        encoder_ffn_dim=d["ffn"], decoder_ffn_dim=d["ffn"], max_source_positions=d["source_positions"],
        max_target_positions=d["target_positions"], pad_token_id=eot, bos_token_id=eot, eos_token_id=eot,
        decoder_start_token_id=sot, tie_word_embeddings=True, activation_function="gelu",
    )
    with torch.device("meta"):
        model = WhisperForConditionalGeneration(cfg)
    sd["proj_out.weight"] = sd["model.decoder.embed_tokens.weight"]
    missing = set(model.state_dict()) - set(sd)
    if missing:
        raise ModelLoadError(f"CTranslate2 model.bin lacks weights for {sorted(missing)[:3]}")
    model.load_state_dict(sd, assign=True, strict=True)
    model.tie_weights()
    lang = {}
    if multilingual:
        ids_ = ct2.get("lang_ids") or range(sot + 1, ids("<|translate|>"))  # openai/whisper's layout
        for i in ids_:
            lang[tok.convert_ids_to_tokens(int(i))] = int(i)
    gen = dict(
        decoder_start_token_id=sot, eos_token_id=eot, pad_token_id=eot, bos_token_id=eot,
        no_timestamps_token_id=no_ts, max_length=d["target_positions"], max_initial_timestamp_index=50,
        suppress_tokens=list(ct2.get("suppress_ids") or []), begin_suppress_tokens=list(ct2.get("suppress_ids_begin") or []),
        alignment_heads=[list(map(int, h)) for h in ct2.get("alignment_heads") or []], is_multilingual=multilingual,
        return_timestamps=False,
    )
    if multilingual:
        gen.update(lang_to_id=lang, task_to_id={"translate": ids("<|translate|>"), "transcribe": ids("<|transcribe|>")},
                   language="<|en|>", task="transcribe")
    parent = os.path.dirname(os.path.abspath(dst))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(dst.rstrip('/'))}.", dir=parent)
    try:
        model.save_pretrained(tmp)
        GenerationConfig(**gen).save_pretrained(tmp)
        WhisperFeatureExtractor(feature_size=d["mels"]).save_pretrained(tmp)
        tok.save_pretrained(tmp)
        if os.path.isdir(dst):  # an earlier conversion (callers refuse anything else)
            shutil.rmtree(dst)
        os.replace(tmp, dst)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dst


def is_converted_dir(path: str) -> bool:
    """Whether ``path`` holds a transformers model directory (``config.json`` + safetensors weights)."""
    return os.path.isfile(os.path.join(path, "config.json")) and os.path.isfile(os.path.join(path, "model.safetensors"))
