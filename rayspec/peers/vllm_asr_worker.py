"""vLLM's side of the peer benchmark: a stand-alone script run by the vLLM environment's interpreter
(``scripts/setup-vllm.sh``); it imports vLLM, NumPy and the standard library only.

It loads a Whisper directory into ``vllm.LLM`` (engine core in this process, so peak memory covers it), warms up on
one batch, then greedy-decodes every waveform of ``--audio`` (a ``.npz`` of float32 16 kHz arrays ``a0, a1, ...``) at
each batch size: one ``generate`` call per batch of consecutive waveforms. It prints one JSON line, the protocol of
:mod:`rayspec.peers.engine_worker`: ``{"engine": "vllm", "version", "startup_s", "rows": [{"batch_size", "decode_s",
"tokens"}], "peak_rss_mb"}``. ``decode_s`` covers log-mel features, encoder and decoder (all inside ``generate``).
With ``--tokens N`` every request generates exactly N tokens (``ignore_eos``), else up to ``--max-tokens`` and the
rows carry ``texts`` too (for WER). The decoder prompt is Whisper's English transcription prompt, with the language
and task tokens where the model's ``generation_config.json`` says ``is_multilingual`` (as the other engines).
Threads: set ``VLLM_CPU_OMP_THREADS_BIND`` (e.g. ``0`` or ``0-1``) in the environment.
"""

import time

T_START = time.perf_counter()

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import resource  # noqa: E402
import sys  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", required=True)
    p.add_argument("--audio", required=True)
    p.add_argument("--batch-sizes", default="1,16")
    p.add_argument("--tokens", type=int, default=0, help="exact tokens per request (0: stop at EOS)")
    p.add_argument("--max-tokens", type=int, default=200)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--enforce-eager", action="store_true", help="skip vLLM's graph compilation (faster start-up)")
    args = p.parse_args()
    reply = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # vLLM's own prints go to stderr
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import numpy as np
    import vllm
    from vllm import LLM, SamplingParams

    with np.load(args.audio) as z:
        audios = [z[f"a{i}"] for i in range(len(z.files))]
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    # the token budget admits a whole batch of 30 s encoder inputs (1,500 positions each) in one step
    llm = LLM(model=args.model, dtype=args.dtype, max_model_len=448, max_num_seqs=max(sizes), seed=0,
              max_num_batched_tokens=1500 * max(sizes) + 448, limit_mm_per_prompt={"audio": 1},
              enforce_eager=args.enforce_eager)
    startup = time.perf_counter() - T_START
    n = args.tokens or args.max_tokens
    texts = not args.tokens  # decoding to EOS: a real model, scored by WER
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=bool(args.tokens), detokenize=texts)
    tokenizer = llm.get_tokenizer()
    with open(os.path.join(args.model, "generation_config.json")) as f:
        multilingual = json.load(f).get("is_multilingual", False)
    prompt = (["<|startoftranscript|>", "<|en|>", "<|transcribe|>", "<|notimestamps|>"] if multilingual
              else ["<|startoftranscript|>", "<|notimestamps|>"])
    prompt_ids = tokenizer.convert_tokens_to_ids(prompt)
    eos = tokenizer.eos_token_id

    def decode(batch):
        prompts = [{"encoder_prompt": {"prompt": "", "multi_modal_data": {"audio": (a, 16000)}},
                    "decoder_prompt": {"prompt_token_ids": prompt_ids}} for a in batch]
        outs = [(list(o.outputs[0].token_ids), o.outputs[0].text.strip())
                for o in llm.generate(prompts, params, use_tqdm=False)]
        # decoding to EOS, vLLM lists the EOS token too; the other engines' token lists end before it
        return [(t[:-1] if texts and t and t[-1] == eos else t, s) for t, s in outs]

    decode(audios[: max(sizes)])  # warm-up
    rows = []
    for bs in sizes:
        t0 = time.perf_counter()
        out = [t for s in range(0, len(audios), bs) for t in decode(audios[s : s + bs])]
        rows.append({"batch_size": bs, "decode_s": time.perf_counter() - t0, "tokens": [o[0] for o in out]})
        if texts:
            rows[-1]["texts"] = [o[1] for o in out]
    print(json.dumps({"engine": "vllm", "version": vllm.__version__, "startup_s": startup, "rows": rows,
                      "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}), file=reply)
    return 0


if __name__ == "__main__":
    sys.exit(main())
