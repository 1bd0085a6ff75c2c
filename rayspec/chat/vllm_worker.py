"""The vLLM side of rayspec's vLLM LLM backend: a stand-alone script run by the vLLM environment's interpreter
(``scripts/setup-vllm.sh``), speaking JSON lines on stdin/stdout. It imports vLLM and the standard library only.

Request:  ``{"ids": [token ids], "since": s, "k": K}``
Response: ``{"top": [[token ids]...], "logprobs": [[float]...], "cached": n}``: for every prefix ``ids[:j]``, ``j = s .. len(ids)``,
the K most likely next tokens (descending) and their log-probabilities, from ONE vLLM request (the prompt's
``prompt_logprobs`` (only when ``s < len(ids)``: such requests bypass vLLM's prefix cache) plus one generated
position; ``cached``: prompt tokens served by the prefix cache).
The first line written is ``{"ready": true, "vllm": version}``.
"""

import argparse
import json
import os
import sys


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", required=True)
    p.add_argument("--max-model-len", type=int, default=512)
    args = p.parse_args()
    reply = os.fdopen(os.dup(1), "w", buffering=1)  # the protocol's channel
    os.dup2(2, 1)  # whatever vLLM prints to stdout goes to stderr
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=args.model, dtype="float32", max_model_len=args.max_model_len, enable_prefix_caching=True,
              skip_tokenizer_init=True, seed=0)
    print(json.dumps({"ready": True, "vllm": vllm.__version__}), file=reply, flush=True)
    for line in sys.stdin:
        try:
            print(json.dumps(answer(llm, json.loads(line), SamplingParams, TokensPrompt)), file=reply, flush=True)
        except Exception as exc:  # noqa: BLE001 - one bad request is one error reply; the worker stays up
            print(json.dumps({"error": f"{type(exc).__name__}: {exc}"}), file=reply, flush=True)
    return 0


def answer(llm, req: dict, SamplingParams, TokensPrompt) -> dict:  # noqa: N803 - vLLM's classes, passed in
    """One request (see the module docstring); ``{"reset": true}`` empties the prefix cache."""
    if req.get("reset"):
        llm.reset_prefix_cache()
        return {"reset": True}
    ids, since, k = req["ids"], int(req["since"]), int(req["k"])
    # prompt log-probs only when verifying: vLLM does not serve such requests from its prefix cache
    params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=k, detokenize=False,
                            prompt_logprobs=k if since < len(ids) else None)
    out = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)[0]
    rows = [out.prompt_logprobs[j] for j in range(since, len(ids))] + [out.outputs[0].logprobs[0]]
    top, lps = [], []
    for row in rows:
        best = sorted(((v.rank, t, v.logprob) for t, v in row.items() if v.rank is not None and v.rank <= k))[:k]
        top.append([t for _, t, _ in best])
        lps.append([lp for _, _, lp in best])
    cached = getattr(out, "num_cached_tokens", None) or 0
    return {"top": top, "logprobs": lps, "cached": cached}


if __name__ == "__main__":
    sys.exit(main())
