"""The vLLM LLM backend (its own environment, scripts/setup-vllm.sh; .ci/run creates it): the same greedy replies
as transformers, the same PredGen turns. Skipped only where that environment was not created."""

import os

import pytest

from rayspec.chat.commands import DEFAULT_VLLM_PYTHON, load_lm
from rayspec.chat.predgen import PredGenOptions, run_turn
from rayspec.chat.streaming import text_partials

ROOT = os.path.join(os.path.dirname(__file__), "..")
PYTHON = os.environ.get("RAYSPEC_VLLM_PYTHON", os.path.join(ROOT, DEFAULT_VLLM_PYTHON))
PROMPTS = ["Once upon a time, there was a little dog named Max.", "Tom was sad because he lost his favorite toy.",
           "Mia saw a cat sitting on the fence."]

pytestmark = pytest.mark.skipif(not os.path.exists(PYTHON), reason="no vLLM environment (scripts/setup-vllm.sh)")


class SilentVoice:
    sample_rate = 16000

    def synthesize(self, text):
        import numpy as np

        return np.zeros(160, np.float32)


@pytest.fixture(scope="module")
def engines():
    hf = load_lm("stories260K")
    vl = load_lm("stories260K", "vllm", PYTHON)
    yield hf, vl
    vl.close()


@pytest.mark.parametrize("prompt", PROMPTS)
def test_vllm_greedy_reply_equals_transformers(engines, prompt):
    hf, vl = engines
    ids = hf.prompt_ids(prompt)
    assert vl.prompt_ids(prompt) == ids
    hf.reset()
    assert vl.generate(ids, 40) == hf.generate(ids, 40)


def test_vllm_predgen_turn_equals_transformers(engines):
    hf, vl = engines
    opts = PredGenOptions(max_reply_tokens=30)
    parts = text_partials(PROMPTS[0])
    a, b = run_turn(hf, SilentVoice(), parts, opts), run_turn(vl, SilentVoice(), parts, opts)
    assert a.reply_ids == b.reply_ids and a.outcome == b.outcome and a.accepted_tokens == b.accepted_tokens


def test_vllm_serves_the_default_chat_llm_with_transformers_greedy_reply():
    """SmolLM2-135M-Instruct: vLLM loads the same dequantized directory (chat template included)."""
    hf = load_lm(None)
    vl = load_lm(None, "vllm", PYTHON)
    try:
        question = "What is the capital of France?"
        ids = hf.prompt_ids(question)
        assert vl.prompt_ids(question) == ids
        reply = hf.generate(ids, 20)
        assert vl.generate(ids, 20) == reply and "Paris" in hf.decode(reply)
    finally:
        vl.close()
