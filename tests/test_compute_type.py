"""The compute type: what ``auto`` picks for a given CPU, how it reaches the result rows, and every exact method equal
to ``ar`` at bfloat16 (the type ``auto`` picks on a CPU with AMX or AVX-512 BF16) and at int8 (on other x86 CPUs)."""

import argparse

import pytest
import torch

from rayspec.compute import choose, cpu_flags, onednn_allows_bf16, resolve
from rayspec.models.whisper import KEY_BLOCK, WhisperASR

# bfloat16 exactness is claimed where auto picks bfloat16 (native products); elsewhere oneDNN emulates it
native_bf16 = pytest.mark.skipif(choose("cpu", cpu_flags()).name != "bfloat16",
                                 reason="this CPU has no native bfloat16 products (auto picks float32 here)")

AMX = {"fpu", "avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile", "amx_int8"}
ZEN4 = {"fpu", "avx2", "avx512f", "avx512_bf16"}
AVX2 = {"fpu", "sse4_2", "avx", "avx2", "fma"}
SKYLAKE = {"fpu", "avx2", "avx512f", "avx512bw", "avx512vl", "avx512_vnni"}
OLD = {"fpu", "sse4_2", "avx"}  # no AVX2: no int8 kernels worth it
fbgemm = pytest.mark.skipif("fbgemm" not in torch.backends.quantized.supported_engines,
                            reason="this PyTorch build has no fbgemm (int8 linears)")


@pytest.mark.parametrize("flags, max_isa, expected", [
    (AMX, None, "bfloat16"),
    (ZEN4, None, "bfloat16"),
    (AVX2, None, "int8"),
    (SKYLAKE, None, "int8"),  # AVX-512 without BF16: oneDNN emulates bfloat16, slower than float32
    (AMX, "AVX2", "int8"),  # BF16 masked off, as on a CPU without it
    (AMX, "avx512_core_vnni", "int8"),
    (OLD, None, "float32"),
    (set(), None, "float32"),  # no flags read (another OS or architecture)
    (AMX, "AVX512_CORE_BF16", "bfloat16"),
    (AMX, "AVX512_CORE_AMX", "bfloat16"),
    (AMX, "ALL", "bfloat16"),
])
def test_auto_picks_bfloat16_where_the_cpu_has_native_bfloat16_else_int8_with_avx2(flags, max_isa, expected):
    chosen = choose("cpu", flags, max_isa)
    assert chosen.name == expected and chosen.int8 == (expected == "int8")
    assert chosen.dtype == (torch.float32 if expected == "int8" else getattr(torch, expected))
    assert chosen.reason.startswith("auto: ")


def test_auto_on_a_gpu_is_float16_and_named_types_are_taken_as_asked(monkeypatch):
    assert choose("cuda:1", set()).name == "float16"
    assert resolve("float32").dtype == torch.float32 and resolve("BFloat16").dtype == torch.bfloat16
    with pytest.raises(ValueError, match="unknown compute type 'int4'"):
        resolve("int4")
    assert resolve("int8").int8 and resolve("int8").dtype == torch.float32
    with pytest.raises(ValueError, match="int8 runs on a CPU only"):
        resolve("int8", "cuda")
    assert not onednn_allows_bf16("AVX") and onednn_allows_bf16(None) and not onednn_allows_bf16("bogus")
    monkeypatch.setenv("RAYSPEC_COMPUTE_TYPE", "bfloat16")
    assert resolve(None).name == "bfloat16"


def test_compute_type_flag_its_alias_and_its_default(monkeypatch):
    from rayspec.options import add_model_args

    def parse(*argv):
        p = argparse.ArgumentParser()
        add_model_args(p)
        return p.parse_args(list(argv))

    assert parse("--compute-type", "bfloat16").compute_type == "bfloat16"
    assert parse("--dtype", "float32").compute_type == "float32"  # the earlier flag's name still works
    assert parse().compute_type == "float32"  # conftest pins the tests' default
    monkeypatch.delenv("RAYSPEC_COMPUTE_TYPE")
    assert parse().compute_type == "auto"


def test_result_rows_record_the_compute_type(tiny_target, tmp_path):
    from rayspec.compute import label
    from rayspec.pipeline import DecodeOptions, TargetDecoder

    assert TargetDecoder(tiny_target, DecodeOptions("ar"))._compute_type == "float32"
    assert label(torch.float32, torch.bfloat16) == "float32 (encoder bfloat16)"
    assert label(torch.bfloat16, torch.bfloat16) == "bfloat16"
    assert label(torch.float32, int8=True) == "int8"


def _low_precision(fp32, compute_type: str) -> WhisperASR:
    """``fp32`` (a float32 WhisperASR) at ``compute_type``: bfloat16 weights, or int8 linear layers."""
    if compute_type == "int8":
        return fp32.pack_for_inference(int8=True)
    return WhisperASR(fp32.model.to(torch.bfloat16), fp32.feature_extractor, fp32.tokenizer, fp32.generation_config)


@pytest.mark.parametrize("compute_type", [pytest.param("bfloat16", marks=native_bf16),
                                          pytest.param("int8", marks=fbgemm)])
def test_batch_invariant_steps_equal_a_multi_token_pass(tmp_path, compute_type):
    """bfloat16 or int8 on a CPU: caches hold whole key blocks, and a token decoded one step at a time gets bitwise the
    states it gets inside a longer pass (what verifying a draft computes), so greedy choices cannot differ between
    them."""
    import numpy as np

    from tiny import make_tiny

    fp32 = make_tiny(tmp_path, d_model=64, layers=2, seed=5)
    assert not fp32.batch_invariant
    model = _low_precision(fp32, compute_type)
    assert model.batch_invariant
    feats, lengths = model.features([np.random.default_rng(0).standard_normal(16000).astype(np.float32)])
    with torch.inference_mode():
        enc = model.encode(feats.to(model.dtype), lengths)
        prompt = torch.tensor([model.prompt_ids])
        new = torch.tensor([[5, 9, 12, 7, 30, 31]])
        p = prompt.shape[1]

        def primed():
            cache = model.new_cache(enc, p + new.shape[1])
            model.decode_hidden(cache, prompt)
            cache.commit(np.arange(p)[None], np.array([p]))
            return cache

        one = primed()
        assert one.capacity % KEY_BLOCK == 0
        steps = []
        for t in new[0]:
            steps.append(model.decode_hidden(one, t.view(1, 1)))
            one.commit(np.zeros((1, 1), dtype=np.int64), np.array([1]))
        passed = model.decode_hidden(primed(), new)
        assert torch.equal(torch.cat(steps, 1), passed)
        assert torch.equal(model.project(torch.cat(steps, 1)).argmax(-1), model.project(passed).argmax(-1))


@native_bf16
@pytest.mark.parametrize("packed", [True, False])
def test_batch_invariant_products_give_a_row_its_one_row_result_at_any_row_count(tmp_path, packed):
    """A bfloat16 decoder's products (whisper-base's fc2 shape, 2048 -> 512, packed or not): a row among 160 others
    (16 rows x 10 tokens, a batch-16 verification pass) gets bitwise what it gets alone. oneDNN's own product did not,
    from 33 rows on on an AMX host (which let batch-16 speculation differ from ar on 4 of 99 held-out clips), and from
    2 rows at some offsets on an AMD EPYC without AMX: rows go in blocks of ROW_BLOCK, inputs in blocks of
    REDUCTION_BLOCK."""
    from rayspec.models.linear import REDUCTION_BLOCK, PackedLinear, linear
    from rayspec.models.whisper import ROW_BLOCK
    from tiny import make_tiny

    model = _low_precision(make_tiny(tmp_path, d_model=64, layers=2, seed=5), "bfloat16")
    torch.manual_seed(0)
    dense = torch.nn.Linear(2048, 512).to(torch.bfloat16)
    layer = PackedLinear(dense, REDUCTION_BLOCK) if packed else dense
    x = torch.randn(16, 10, 2048).to(torch.bfloat16)
    with torch.inference_mode():
        alone = torch.stack([torch.cat([model._linear(layer, t[None, None])[0] for t in row]) for row in x])
        w = dense.weight[:, :REDUCTION_BLOCK].contiguous()
        block = x.reshape(-1, 2048)[3:ROW_BLOCK, :REDUCTION_BLOCK]
        if not torch.equal(linear(block, w), torch.cat([linear(r[None], w) for r in block])):
            pytest.skip(f"this CPU's oneDNN bfloat16 product over {REDUCTION_BLOCK} inputs rounds a row by the row "
                        "count: blocks cannot make it batch-invariant here")
        assert torch.equal(model._linear(layer, x), alone)
    with pytest.raises(ValueError, match="without reduction blocks"):
        model._linear(PackedLinear(dense), x)


@pytest.mark.parametrize("dtype", [pytest.param(torch.bfloat16, marks=native_bf16), torch.float32])
@pytest.mark.parametrize("keys", [1500, 64])
def test_invariant_attention_gives_a_query_row_its_one_row_result(keys, dtype):
    """rayspec.models.invariant.attention (bfloat16, or float32 as an int8 decoder attends; whisper-base's head
    shapes): a query row gets bitwise its one-query result whatever rows share the call, at which offset, in which
    memory layout, and whatever masked keys follow its own (KEY_BLOCK padding), with a mask per key or per query
    (a draft tree's); and it stays within rounding of PyTorch's attention."""
    import torch.nn.functional as F

    from rayspec.models.invariant import KEY_CHUNK, attention

    g = torch.Generator().manual_seed(0)
    bf = dtype
    b, h, dh = 2, 8, 64
    pad = 64 if keys + 64 <= KEY_CHUNK else 0  # a self-attention's KEY_BLOCK padding; audio keys are never padded
    k, v = (torch.randn(b, h, keys + pad, dh, generator=g).to(bf) for _ in range(2))
    q = (torch.randn(b, 12, h, dh, generator=g) * dh ** -0.5).to(bf).transpose(1, 2)  # [B, H, N, Dh], strided
    mask = torch.ones(b, 1, 1, keys + pad, dtype=torch.bool)
    mask[..., keys:] = False  # the padding block
    mask[1, ..., keys - 7:] = False  # a shorter row
    with torch.inference_mode():
        alone = torch.cat([attention(q[:, :, i:i + 1].contiguous(), k[:, :, :keys], v[:, :, :keys],
                                     mask[..., :keys]) for i in range(12)], 2)
        for n, offset in ((2, 0), (5, 3), (9, 1), (12, 0)):
            rows = q[:, :, offset:offset + n]
            assert torch.equal(attention(rows, k, v, mask), alone[:, :, offset:offset + n])  # padded keys, if any
            assert torch.equal(attention(rows.contiguous(), k[:, :, :keys], v[:, :, :keys], mask[..., :keys]),
                               alone[:, :, offset:offset + n])
        tree = mask.expand(b, 1, 12, keys + pad).clone()
        tree[0, :, 5, 3] = False  # a node that does not see key 3
        alone = torch.cat([attention(q[:, :, i:i + 1].contiguous(), k, v, tree[:, :, i:i + 1]) for i in range(12)], 2)
        for n, offset in ((1, 5), (3, 4), (7, 5), (12, 0)):
            got = attention(q[:, :, offset:offset + n], k, v, tree[:, :, offset:offset + n])
            assert torch.equal(got, alone[:, :, offset:offset + n])
        sdpa = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask, scale=1.0)
        tol = dict(atol=0.03, rtol=0.02) if dtype == torch.bfloat16 else dict(atol=1e-5, rtol=1e-5)
        assert torch.allclose(attention(q, k, v, mask).float(), sdpa, **tol)


@fbgemm
def test_int8_fused_and_cached_weights_give_the_same_states(tmp_path, monkeypatch):
    """An int8 model's fused attention products (q|k|v, cross k|v) give bitwise the states of separate int8 layers, and
    a second load reads the quantized weights from the cache (no float32 linear weight quantized) to the same bits."""
    import os

    import numpy as np

    from rayspec.models import linear
    from rayspec.models.linear import INT8_FILE, quantize_linears
    from tiny import make_tiny

    monkeypatch.setenv("RAYSPEC_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "model"
    make_tiny(path, d_model=64, layers=2, seed=7)
    separate = WhisperASR.from_pretrained(str(path))
    quantize_linears(separate.model.model)  # unfused, uncached
    separate.int8 = True
    built = WhisperASR.from_pretrained(str(path)).pack_for_inference(int8=True)
    folder = built._int8_cache()
    assert os.path.isfile(os.path.join(folder, INT8_FILE))
    assert hasattr(built.model.model.encoder.layers[0].self_attn, "qkv_proj")
    calls = []
    monkeypatch.setattr(linear, "quantize_weight", lambda w: calls.append(w) or pytest.fail("quantized again"))
    cached = WhisperASR.from_pretrained(str(path)).pack_for_inference(int8=True)
    assert not calls
    feats, lengths = built.features([np.random.default_rng(1).standard_normal(16000).astype(np.float32)])
    tokens = torch.tensor([built.prompt_ids + [5, 9, 12]])
    states = []
    with torch.inference_mode():
        for model in (separate, built, cached):
            enc = model.encode(feats, lengths)
            cache = model.new_cache(enc, 64)
            states.append((enc.states, model.decode_hidden(cache, tokens)))
    for enc, hidden in states[1:]:
        assert torch.equal(enc, states[0][0]) and torch.equal(hidden, states[0][1])


@fbgemm
def test_int8_linear_rows_do_not_depend_on_their_batch_mates():
    """An int8 linear layer's row is bitwise the same alone as among other rows of any range, and near float32's."""
    from rayspec.models.linear import Int8Linear

    torch.manual_seed(0)
    layer = torch.nn.Linear(96, 40)
    q = Int8Linear(layer)
    x = torch.randn(7, 96) * torch.logspace(-2, 2, 7)[:, None]
    with torch.inference_mode():
        together = q(x)
        assert torch.equal(torch.cat([q(r[None]) for r in x]), together)
        assert torch.equal(q(x[None, 2:5])[0], together[2:5])
        ref = layer(x)
    assert ((together - ref).norm(dim=-1) / ref.norm(dim=-1)).max() < 0.05


def test_float16_projection_packed_in_a_thread_is_the_one_packed_before_returning():
    """The output projection's float16 weight packed in the background gives bitwise the same rows."""
    from rayspec.models.linear import Float16RowLinear

    torch.manual_seed(0)
    layer = torch.nn.Linear(64, 300, bias=False)
    x = torch.randn(3, 64)
    with torch.inference_mode():
        assert torch.equal(Float16RowLinear(layer, background=True)(x), Float16RowLinear(layer)(x))
    with pytest.raises(ValueError, match="without bias"):
        Float16RowLinear(torch.nn.Linear(4, 4), background=True)


@pytest.mark.parametrize("compute_type", [pytest.param("bfloat16", marks=native_bf16),
                                          pytest.param("int8", marks=fbgemm)])
@pytest.mark.parametrize("batch_size", [1, 4])
def test_every_method_equals_ar_at_low_precision(tiny_en_drafters, samples_manifest, batch_size, compute_type,
                                                 tmp_path):
    """Real whisper-tiny.en at bfloat16 (what auto picks on a CPU with AMX or AVX-512 BF16) and at int8 (what it picks
    on other x86 CPUs): every exact method gives ar's tokens at the same batch size."""
    from rayspec.audio import load_audio
    from rayspec.manifest import read_manifest
    from rayspec.models.ctc import CTCHead
    from rayspec.models.medusa import MedusaHeads
    from rayspec.options import decode_options_from
    from rayspec.pipeline import decode_batch

    int8 = compute_type == "int8"
    dtype = torch.float32 if int8 else torch.bfloat16
    model = WhisperASR.from_pretrained("whisper-tiny.en", dtype=dtype).pack_for_inference(int8)
    assert model.batch_invariant
    draft = WhisperASR.from_pretrained(tiny_en_drafters[0], dtype=dtype).pack_for_inference(int8)
    ctc = CTCHead.from_pretrained(tiny_en_drafters[1]).to(dtype)
    torch.manual_seed(0)
    MedusaHeads(model.config.d_model, 3).save_pretrained(str(tmp_path / "heads"))
    clips = [load_audio(u.audio, 16000) for u in read_manifest(samples_manifest)[:6]]

    def run(method):
        options = decode_options_from({"method": method, "max_tokens_per_second": 1000.0, "tau_ctc": 0.0,
                                       "exact": True, "medusa": str(tmp_path / "heads")})
        out = []
        for s in range(0, len(clips), batch_size):
            a = clips[s: s + batch_size]
            out += [h.tokens for h in decode_batch(model, options, a, [len(x) / 16000 for x in a], draft=draft,
                                                   ctc=ctc)]
        return out

    ar = run("ar")
    assert all(ar)
    for method in ("draft", "ctc-draft", "medusa", "ssd"):
        assert run(method) == ar, method


def test_default_batching_gives_batch_one_transcripts_in_float32(tmp_path):
    """float32 (the reference): the transcripts of rayspec's default batching (length-sorted batches, continuous
    refill) equal batch 1's whatever the batch size and the order the files come in (whisper-tiny.en, the bundled
    clips)."""
    from importlib import resources

    import pyarrow.parquet as pq

    from rayspec.batching import BatchBudget
    from rayspec.manifest import read_manifest
    from rayspec.models.errors import ModelLoadError
    from rayspec.pipeline import DecodeOptions, Transcriber
    from rayspec.runs import run_corpus

    try:
        transcriber = Transcriber("whisper-tiny.en", options=DecodeOptions("ar"))
    except ModelLoadError as e:
        pytest.skip(str(e))
    utts = read_manifest(str(resources.files("rayspec") / "samples" / "manifest.jsonl"))

    def texts(order, rows):
        out = tmp_path / f"{rows}-{len(list(tmp_path.iterdir()))}.parquet"
        run_corpus(order, transcriber, str(out), BatchBudget(max_rows=rows), continuous=True)
        return {r["id"]: r["text"] for r in pq.read_table(str(out)).to_pylist()}

    one = texts(utts, 1)
    assert len(one) == len(utts) and sum(bool(t) for t in one.values()) > len(utts) // 2
    for rows, order in ((4, utts[::-1]), (16, utts), (16, utts[1::2] + utts[::2])):
        assert texts(order, rows) == one, (rows, order[0].id)
