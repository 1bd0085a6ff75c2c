"""The fused bfloat16 encoder attention (rayspec.models.fused_attention): where it runs, its error against a float32
reference (no larger than PyTorch's own bfloat16 attention's), a row's bits independent of the batch, the thread
count and the input strides, and PyTorch's attention kept where the kernel cannot be built."""

import warnings

import pytest
import torch
import torch.nn.functional as F

from rayspec.models import fused_attention as fa
from rayspec.models import whisper_layers as layers

ZEN4 = frozenset({"avx2", "avx512f", "avx512_bf16"})
AMX = ZEN4 | {"amx_bf16", "amx_tile"}


@pytest.mark.parametrize("flags, capability, expected", [
    (ZEN4, "AVX512", True),
    (ZEN4, "AVX2", False),  # PyTorch held to AVX2 (ATEN_CPU_CAPABILITY): a CPU without AVX-512 is being imitated
    (AMX, "AVX512", False),  # PyTorch's kernel runs on AMX tiles
    (frozenset({"avx2", "avx512f"}), "AVX512", False),  # AVX-512 without BF16
    (frozenset(), "DEFAULT", False),
])
def test_host_supports(flags, capability, expected):
    assert fa.host_supports(flags, capability) is expected


runs_here = pytest.mark.skipif(fa._library() is None, reason="the fused attention kernel does not run on this host")


def _sdpa(q, k, v, heads):
    b, s, d = q.shape
    h = lambda t: t.reshape(b, s, heads, -1).transpose(1, 2)
    return F.scaled_dot_product_attention(h(q), h(k), h(v), scale=1.0).transpose(1, 2).reshape(b, s, d)


def _qkv(b, s, heads, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(b, s, heads * 64, generator=g) * scale).bfloat16() for scale in (0.5, 0.5, 1.0)]


@runs_here
@pytest.mark.parametrize("b, s, heads", [(1, 1500, 8), (2, 100, 6), (3, 37, 2), (1, 1, 1), (2, 0, 2)])
def test_matches_a_float32_reference_as_closely_as_sdpa(b, s, heads):
    q, k, v = _qkv(b, s, heads)
    with torch.inference_mode():
        out = fa.self_attention(q, k, v, heads)
        assert out.shape == q.shape and out.dtype == torch.bfloat16 and out.is_contiguous()
        if s:
            ref = _sdpa(q.float(), k.float(), v.float(), heads)
            ours = (out.float() - ref).abs().max().item()
            theirs = (_sdpa(q, k, v, heads).float() - ref).abs().max().item()
            assert ours <= max(1.25 * theirs, 1e-2)


@runs_here
def test_a_row_never_depends_on_the_batch_the_threads_or_the_strides():
    q, k, v = _qkv(3, 1500, 8, seed=1)
    threads = torch.get_num_threads()
    with torch.inference_mode():
        whole = fa.self_attention(q, k, v, 8)
        torch.set_num_threads(1)
        try:
            alone = fa.self_attention(q[1:2].clone(), k[1:2].clone(), v[1:2].clone(), 8)
        finally:
            torch.set_num_threads(threads)
        fused = torch.cat([q, k, v], -1)  # q, k, v as views of one tensor (an int8 model's fused product)
        strided = fa.self_attention(*fused.chunk(3, -1), 8)
    assert torch.equal(alone[0], whole[1])
    assert torch.equal(strided, whole)


def test_applies_only_to_bfloat16_cpu_inference_with_64_wide_heads():
    q = torch.zeros(1, 10, 128, dtype=torch.bfloat16)
    assert not fa.applies(q.float(), 2)
    assert not fa.applies(q, 4)  # heads of 32
    assert not fa.applies(q.clone().requires_grad_(), 2)
    assert fa.applies(q, 2) == (fa._library() is not None)


@runs_here
def test_a_failed_build_warns_once_and_keeps_pytorchs_attention(tmp_path, monkeypatch):
    monkeypatch.setenv("RAYSPEC_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", "no-such-compiler")
    fa._library.cache_clear()
    try:
        with pytest.warns(UserWarning, match="fused attention kernel not built"):
            assert fa._library() is None
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert fa._library() is None  # remembered: no second build, no second warning
        assert not fa.applies(torch.zeros(1, 4, 64, dtype=torch.bfloat16), 1)
    finally:
        monkeypatch.undo()
        fa._library.cache_clear()


@runs_here
def test_the_encoder_layer_attends_through_the_kernel_in_bfloat16(monkeypatch):
    """A transformers WhisperEncoderLayer in bfloat16: rayspec's layer calls the kernel (unmasked, inference) and
    stays within bfloat16 error of the same layer in float32; with a mask it keeps SDPA (no second call)."""
    from transformers import WhisperConfig
    from transformers.models.whisper.modeling_whisper import WhisperEncoderLayer

    cfg = WhisperConfig(d_model=128, encoder_attention_heads=2, encoder_ffn_dim=256)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    layer = WhisperEncoderLayer(cfg).eval().bfloat16()
    x = torch.randn(2, 50, 128).bfloat16()
    calls = []
    kernel = fa.self_attention
    monkeypatch.setattr(fa, "self_attention", lambda *a: (calls.append(1), kernel(*a))[1])
    with torch.inference_mode():
        ours = layers.encoder_layer(layer, x, None)
        layer_f = WhisperEncoderLayer(cfg).eval()
        layer_f.load_state_dict({n: p.float() for n, p in layer.state_dict().items()})
        ref = layers.encoder_layer(layer_f, x.float(), None)
        masked = layers.encoder_layer(layer, x, torch.zeros(2, 1, 1, 50, dtype=torch.bfloat16))
    assert len(calls) == 1
    assert (ours.float() - ref).abs().max() < 0.1 and (masked.float() - ref).abs().max() < 0.1
