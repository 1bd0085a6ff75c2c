"""Causal LMs for voice chat: prompt formatting and a greedy engine whose KV cache is cut to the shared prefix.

Input-time speculation (PredGen) re-checks a candidate reply under a prompt that keeps growing; the engine keeps the
KV cache of the last sequence it ran and, for the next one, crops it to the longest common token prefix and runs only
the rest, as vLLM's prefix cache does across requests. One engine call that runs tokens is one target forward pass
(NFE).
"""

from __future__ import annotations

import hashlib
import inspect
import json
import math
import os
import tempfile
from dataclasses import dataclass

import torch

from ..models.errors import ModelLoadError

SENTENCE_END = (".", "!", "?")


@dataclass
class PromptTemplate:
    """How a user's (possibly partial) utterance becomes the LM's prompt.

    A chat model's own chat template is used when its tokenizer has one (``apply_chat_template`` with the generation
    prompt). Otherwise ``base`` formats the text for a base LM such as the bundled story model: ``{text}`` is the
    user's words with a sentence end added when they have none, then a paragraph break, so the reply starts a new
    paragraph after the user's part of the story.
    """

    base: str = "{text}\n"
    system: str | None = None

    def render(self, tokenizer, text: str) -> str:
        """The prompt string for one user turn: the tokenizer's chat template (with :attr:`system`, if any, as the
        system message) when it has one, else the text itself ending in a sentence mark; white space folded."""
        text = " ".join(text.split())
        if getattr(tokenizer, "chat_template", None):
            messages = ([{"role": "system", "content": self.system}] if self.system else []) + [
                {"role": "user", "content": text}]
            return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        if text and not text.endswith(SENTENCE_END):
            text += "."
        return self.base.format(text=text)


class CausalLM:
    """A transformers causal LM run greedily with one reusable KV cache (batch 1; a voice session is one stream).

    Attributes:
        forward_passes: model calls that ran at least one token (NFE), since construction.
        tokens_run: tokens fed through the model (prefill + decode), since construction.
    """

    max_top_k = 1 << 30  # full logits: any k

    def __init__(self, model, tokenizer, template: PromptTemplate | None = None, generation_config=None) -> None:
        self.model = model.eval() if model is not None else None
        # transformers renamed the KV-cache argument and output (``past_key_values`` -> ``cache``, 5.x)
        self._cache_arg = ("cache" if model is not None and "cache" in inspect.signature(model.forward).parameters
                           else "past_key_values")
        self.tokenizer = tokenizer
        self.template = template or PromptTemplate()
        eos = (generation_config or model.generation_config).eos_token_id
        self.stop_ids = set(eos if isinstance(eos, list) else [eos]) - {None}
        self.bos = tokenizer.bos_token_id
        self._ids: list[int] = []
        self._cache = None
        self.forward_passes = 0
        self.tokens_run = 0

    @classmethod
    def from_pretrained(cls, path: str, template: PromptTemplate | None = None, dtype=torch.float32) -> "CausalLM":
        """Load any local causal-LM directory (Llama family, the bundled stories260K, ...).

        Raises:
            ModelLoadError: no such directory or not a causal LM.
        """
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if not os.path.isdir(path):
            raise ModelLoadError(f"LM directory not found: {path} (rayspec loads local directories only)")
        try:
            model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
            tok = AutoTokenizer.from_pretrained(path)
        except (OSError, ValueError, KeyError) as e:
            raise ModelLoadError(f"{path}: not a transformers causal LM ({e})") from e
        return cls(model, tok, template)

    def reset(self) -> None:
        """Forget the cached sequence (a new conversation turn starts from nothing cached)."""
        self._ids, self._cache = [], None

    def prompt_ids(self, text: str) -> list[int]:
        """Token ids of the formatted prompt for the user's ``text`` (BOS first when the model has one)."""
        rendered = self.template.render(self.tokenizer, text)
        ids = self.tokenizer(rendered, add_special_tokens=False).input_ids
        return ([self.bos] if self.bos is not None and ids[:1] != [self.bos] else []) + ids

    def decode(self, ids: list[int]) -> str:
        """Text of token ids, stop and special tokens left out."""
        return self.tokenizer.decode([i for i in ids if i not in self.stop_ids], skip_special_tokens=True)

    @torch.no_grad()
    def next_logits(self, ids: list[int], since: int) -> torch.Tensor:
        """Greedy-verification scores: the next-token logits after every prefix ``ids[:j]``, ``j = since .. len(ids)``.

        One forward pass (one NFE) over ``ids[start:]``, ``start = min(shared prefix with the cached run, since - 1)``:
        the KV cache is cut to ``start`` tokens and reused. Afterwards it holds exactly ``ids``.

        Args:
            ids: the whole sequence (prompt + candidate); since: ``1 <= since <= len(ids)``.

        Returns:
            float32 ``[len(ids) - since + 1, V]``.

        Raises:
            ValueError: ``since`` outside ``1..len(ids)``.
        """
        if not 1 <= since <= len(ids):
            raise ValueError(f"since={since} outside 1..{len(ids)}")
        shared = 0
        limit = min(len(ids), len(self._ids))
        while shared < limit and ids[shared] == self._ids[shared]:
            shared += 1
        start = min(shared, since - 1)
        if start == 0:
            self._cache = None
        elif start < len(self._ids):
            self._cache.crop(start - len(self._ids))  # drop the cached tokens after the shared prefix
        out = self.model(torch.tensor([ids[start:]]), use_cache=True, **{self._cache_arg: self._cache})
        self._cache = getattr(out, self._cache_arg)
        self._ids = list(ids)
        self.forward_passes += 1
        self.tokens_run += len(ids) - start
        return out.logits[0, since - 1 - start :].float()

    def generate(self, ids: list[int], max_new_tokens: int) -> list[int]:
        """Greedy continuation of ``ids`` (reusing the cache): stops at a stop token (not returned) or after
        ``max_new_tokens``."""
        out: list[int] = []
        seq = list(ids)
        for _ in range(max_new_tokens):
            tok = int(self.next_logits(seq, len(seq))[-1].argmax())
            if tok in self.stop_ids:
                break
            out.append(tok)
            seq.append(tok)
        return out


def ends_sentence(text: str) -> bool:
    """True when ``text`` ends a sentence (., ! or ?, possibly followed by a closing quote)."""
    t = text.rstrip().rstrip("\"'\u201d)")
    return t.endswith(SENTENCE_END)


class VLLMCausalLM(CausalLM):
    """The same engine interface served by vLLM in its own Python environment (``scripts/setup-vllm.sh``): each
    :meth:`next_logits` is one vLLM request (prompt log-probabilities over the sequence + one generated position),
    run by ``rayspec/chat/vllm_worker.py`` in a child process of that environment's interpreter. vLLM's prefix cache
    takes the place of the cut KV cache. Models whose head size vLLM's CPU attention lacks (stories260K: 8) are
    widened first with identical outputs (:mod:`rayspec.chat.heads`).

    ``next_logits`` returns log-probabilities for the top ``k`` tokens of each row and ``-inf`` elsewhere: enough for
    the greedy and top-k verifiers and for greedy generation (argmax).

    Raises:
        ModelLoadError: the model directory is missing; OSError: the vLLM interpreter is missing or the worker
            fails to start.
    """

    max_top_k = 8  # the top-k log-probs each request returns

    def __init__(self, path: str, python: str, template: PromptTemplate | None = None,
                 work_dir: str | None = None) -> None:
        import subprocess

        from transformers import AutoConfig, AutoTokenizer, GenerationConfig

        from .heads import VLLM_CPU_HEAD_SIZES, widened_copy

        if not os.path.isdir(path):
            raise ModelLoadError(f"LM directory not found: {path} (rayspec loads local directories only)")
        if not os.path.exists(python):
            raise OSError(f"no vLLM interpreter at {python}: create it with scripts/setup-vllm.sh")
        cfg = AutoConfig.from_pretrained(path)
        hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        serve_dir = path
        if hd not in VLLM_CPU_HEAD_SIZES:
            width = next((w for w in VLLM_CPU_HEAD_SIZES if w % hd == 0), None)
            if width is None:
                raise ModelLoadError(f"{path}: head size {hd} divides none of vLLM's CPU head sizes")
            stamp = [os.path.abspath(path)] + [f"{f}:{os.path.getmtime(os.path.join(path, f))}"
                                               for f in sorted(os.listdir(path))]
            key = hashlib.sha1("|".join(stamp).encode()).hexdigest()[:12]
            serve_dir = os.path.join(work_dir or os.path.join(tempfile.gettempdir(), "rayspec-vllm"),
                                     f"{os.path.basename(os.path.normpath(path))}-{key}-head{width}")
            if not os.path.isdir(serve_dir):  # written whole, then renamed: never half a model
                tmp = tempfile.mkdtemp(dir=os.path.dirname(serve_dir) if os.path.isdir(os.path.dirname(serve_dir))
                                       else None)
                widened_copy(path, tmp, width)
                os.makedirs(os.path.dirname(serve_dir), exist_ok=True)
                try:
                    os.replace(tmp, serve_dir)
                except OSError:  # another process got there first
                    pass
        super().__init__(None, AutoTokenizer.from_pretrained(path), template, GenerationConfig.from_pretrained(path))
        self.vocab_size, self.k = cfg.vocab_size, self.max_top_k
        self.max_len = min(cfg.max_position_embeddings, 4096)
        worker = os.path.join(os.path.dirname(__file__), "vllm_worker.py")
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
               "TOKENIZERS_PARALLELISM": "false"}
        self._proc = subprocess.Popen([python, worker, "--model", serve_dir,
                                       "--max-model-len", str(self.max_len)],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        while True:  # vLLM may print its own lines first
            line = self._proc.stdout.readline()
            if not line:
                raise OSError(f"the vLLM worker exited with status {self._proc.wait()} (run it by hand: "
                              f"{python} {worker} --model {serve_dir})")
            if line.startswith('{"ready"'):
                break

    def next_logits(self, ids: list[int], since: int) -> torch.Tensor:
        """As :meth:`CausalLM.next_logits`, computed by vLLM in its worker process (one request with prompt
        log-probabilities per call): float ``[len(ids) - since + 1, V]`` log-probabilities of each position's top
        ``k`` tokens, ``-inf`` elsewhere (enough for greedy and top-k verification).

        Raises:
            ValueError: ``since`` outside ``1..len(ids)``, or ``ids`` longer than the LLM's context.
        """
        if not 1 <= since <= len(ids):
            raise ValueError(f"since={since} outside 1..{len(ids)}")
        if len(ids) >= self.max_len:
            raise ValueError(f"{len(ids)} tokens: over the LLM's context of {self.max_len}")
        self._proc.stdin.write(json.dumps({"ids": list(ids), "since": since, "k": self.k}) + "\n")
        self._proc.stdin.flush()
        line = self._proc.stdout.readline()
        if not line:
            raise OSError(f"the vLLM worker exited with status {self._proc.wait()}")
        reply = json.loads(line)
        if "error" in reply:
            raise RuntimeError(f"vLLM: {reply['error']}")
        out = torch.full((len(reply["top"]), self.vocab_size), -math.inf)
        for row, (top, lps) in enumerate(zip(reply["top"], reply["logprobs"])):
            out[row, top] = torch.tensor(lps)
        self.forward_passes += 1
        self.tokens_run += len(ids) - int(reply.get("cached", 0))  # what vLLM's prefix cache did not serve
        return out

    def reset(self) -> None:
        """A new turn: also empty vLLM's prefix cache (so one method's run does not warm the next's)."""
        super().reset()
        self._proc.stdin.write(json.dumps({"reset": True}) + "\n")
        self._proc.stdin.flush()
        self._proc.stdout.readline()

    def close(self) -> None:
        """Stop the worker process."""
        if self._proc.poll() is None:
            self._proc.stdin.close()
            self._proc.wait(timeout=60)
