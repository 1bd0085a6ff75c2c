"""llama2.c -> transformers conversion: the converted LlamaForCausalLM computes what llama2.c's run.c computes.

The reference here is an independent NumPy transcription of run.c's ``forward`` (interleaved RoPE, grouped-query
attention, SwiGLU) and ``encode`` (merge the highest-scoring adjacent pair until none is left) over the original
``.bin`` files; the demo LM is llama2.c's stories260K (MIT, tests/data/llama2c)."""

import os

import numpy as np
import pytest
import torch

from rayspec.chat.llama2c import Llama2cError, convert, read_checkpoint, read_tokenizer

DATA = os.path.join(os.path.dirname(__file__), "data", "llama2c")
BIN, TOK = os.path.join(DATA, "stories260K.bin"), os.path.join(DATA, "tok512.bin")
ZOO = os.path.join(os.path.dirname(__file__), "..", "rayspec", "zoo", "stories260K")


def _rmsnorm(x, w):
    return x / np.sqrt(np.mean(x * x) + 1e-5) * w


def run_c_logits(cfg, w, tokens):
    """run.c's forward for each position of ``tokens``; float64 -> ``[len(tokens), V]``."""
    hd, kvmul = cfg.head_dim, cfg.n_heads // cfg.n_kv_heads
    kc = np.zeros((cfg.n_layers, len(tokens), cfg.n_kv_heads * hd))
    vc = np.zeros_like(kc)
    out = []
    for pos, tok in enumerate(tokens):
        x = w["token_embedding"][tok].astype(np.float64)
        for l in range(cfg.n_layers):
            xb = _rmsnorm(x, w["rms_att"][l])
            q, k, v = w["wq"][l] @ xb, w["wk"][l] @ xb, w["wv"][l] @ xb
            for vec in (q, k):
                for i in range(0, len(vec), 2):
                    freq = 1.0 / 10000.0 ** ((i % hd) / hd)
                    c, s = np.cos(pos * freq), np.sin(pos * freq)
                    if vec is k and i >= len(k):
                        break
                    vec[i], vec[i + 1] = vec[i] * c - vec[i + 1] * s, vec[i] * s + vec[i + 1] * c
            kc[l, pos], vc[l, pos] = k, v
            att_out = np.zeros(cfg.dim)
            for h in range(cfg.n_heads):
                kvh = h // kvmul
                qh = q[h * hd : (h + 1) * hd]
                scores = kc[l, : pos + 1, kvh * hd : (kvh + 1) * hd] @ qh / np.sqrt(hd)
                p = np.exp(scores - scores.max())
                p /= p.sum()
                att_out[h * hd : (h + 1) * hd] = p @ vc[l, : pos + 1, kvh * hd : (kvh + 1) * hd]
            x = x + w["wo"][l] @ att_out
            xb = _rmsnorm(x, w["rms_ffn"][l])
            h1, h3 = w["w1"][l] @ xb, w["w3"][l] @ xb
            x = x + w["w2"][l] @ (h1 / (1 + np.exp(-h1)) * h3)
        out.append(w["wcls"] @ _rmsnorm(x, w["rms_final"]))
    return np.stack(out)


def run_c_encode(pieces, scores, text):
    """run.c's encode (dummy prefix, no BOS/EOS)."""
    lookup = {p: i for i, p in enumerate(pieces)}
    toks = [lookup[" "]] if text else []
    for ch in text:
        toks += [lookup[ch]] if ch in lookup else [b + 3 for b in ch.encode()]
    while True:
        best = (-1e10, -1, -1)
        for i in range(len(toks) - 1):
            j = lookup.get(pieces[toks[i]] + pieces[toks[i + 1]])
            if j is not None and scores[j] > best[0]:
                best = (scores[j], j, i)
        if best[1] < 0:
            return toks
        toks[best[2] : best[2] + 2] = [best[1]]


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = convert(BIN, TOK, str(tmp_path_factory.mktemp("stories")))
    return AutoModelForCausalLM.from_pretrained(out).eval(), AutoTokenizer.from_pretrained(out)


def test_logits_equal_run_c(converted):
    model, _ = converted
    cfg, w = read_checkpoint(BIN)
    tokens = [1, 403, 407, 261, 378, 267, 293, 45]
    ref = run_c_logits(cfg, w, tokens)
    with torch.no_grad():
        got = model(torch.tensor([tokens])).logits[0].double().numpy()
    assert np.abs(got - ref).max() < 1e-4


def test_greedy_text_equals_run_c(converted):
    """Greedy from BOS: the reference's tokens, and llama2.c's known story opening."""
    model, tok = converted
    cfg, w = read_checkpoint(BIN)
    tokens = [1]
    for _ in range(24):
        tokens.append(int(run_c_logits(cfg, w, tokens)[-1].argmax()))
    with torch.no_grad():
        got = model.generate(torch.tensor([[1]]), max_new_tokens=24, do_sample=False)[0].tolist()
    assert got == tokens
    assert tok.decode(got[1:]).startswith("Once upon a time, there was a little girl named Lily.")


@pytest.mark.parametrize("text", ["Once upon a time, there was a dog.", "Tom said, \"Hi!\" 3 ü€",
                                  "  two  spaces", "a"])
def test_tokenizer_equals_run_c(converted, text):
    _, tok = converted
    pieces, scores = read_tokenizer(TOK, 512)
    ids = tok(text, add_special_tokens=False).input_ids
    assert ids == run_c_encode(pieces, scores, text)
    assert tok.decode(ids) == text


def test_padded_heads_are_exact(converted, tmp_path):
    """The head_dim 8 -> 32 re-parameterization (for vLLM's CPU attention) gives the same logits and greedy text."""
    from transformers import AutoModelForCausalLM

    model, _ = converted
    wide = AutoModelForCausalLM.from_pretrained(convert(BIN, TOK, str(tmp_path), pad_head_dim=32)).eval()
    assert wide.config.head_dim == 32
    ids = torch.tensor([[1, 403, 407, 261, 378, 267, 293, 45, 300, 301]])
    with torch.no_grad():  # float64: equal up to rounding (float32 differs ~1e-5 from the summation order)
        assert torch.allclose(model.double()(ids).logits, wide.double()(ids).logits, rtol=0, atol=1e-9)
        model.float(), wide.float()
        assert torch.equal(model.generate(ids, max_new_tokens=30, do_sample=False),
                           wide.generate(ids, max_new_tokens=30, do_sample=False))


def test_zoo_copy_is_the_conversion(converted):
    from transformers import AutoModelForCausalLM

    model, _ = converted
    zoo = AutoModelForCausalLM.from_pretrained(ZOO)
    for (n, a), (_, b) in zip(model.state_dict().items(), zoo.state_dict().items()):
        assert torch.equal(a, b), n


def test_bad_files(tmp_path):
    bad = tmp_path / "x.bin"
    bad.write_bytes(b"\x01\x00")
    with pytest.raises(Llama2cError, match="too short"):
        read_checkpoint(str(bad))
    bad.write_bytes(open(BIN, "rb").read()[:1000])
    with pytest.raises(Llama2cError, match="bytes"):
        read_checkpoint(str(bad))
    with pytest.raises(Llama2cError, match="multiple"):
        convert(BIN, TOK, str(tmp_path / "o"), pad_head_dim=12)
