"""Causal LMs for voice chat: prompt formatting and a greedy engine whose KV cache is cut to the shared prefix.

Input-time speculation (PredGen) re-checks a candidate reply under a prompt that keeps growing; the engine keeps the
KV cache of the last sequence it ran and, for the next one, crops it to the longest common token prefix and runs only
the rest, as vLLM's prefix cache does across requests. One engine call that runs tokens is one target forward pass
(NFE).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from ..models.whisper import ModelLoadError

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

    def __init__(self, model, tokenizer, template: PromptTemplate | None = None) -> None:
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.template = template or PromptTemplate()
        eos = model.generation_config.eos_token_id
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
        out = self.model(torch.tensor([ids[start:]]), past_key_values=self._cache, use_cache=True)
        self._cache = out.past_key_values
        self._ids = list(ids)
        self.forward_passes += 1
        self.tokens_run += len(ids) - start
        return out.logits[0, since - 1 - start :].float()

    def generate(self, ids: list[int], max_new_tokens: int, until_sentence_end: bool = False) -> list[int]:
        """Greedy continuation of ``ids`` (reusing the cache): stops at a stop token (not returned), after
        ``max_new_tokens``, or, with ``until_sentence_end``, after the first token that ends a sentence."""
        out: list[int] = []
        seq = list(ids)
        for _ in range(max_new_tokens):
            tok = int(self.next_logits(seq, len(seq))[-1].argmax())
            if tok in self.stop_ids:
                break
            out.append(tok)
            seq.append(tok)
            if until_sentence_end and ends_sentence(self.tokenizer.decode(out)):
                break
        return out


def ends_sentence(text: str) -> bool:
    """True when ``text`` ends a sentence (., ! or ?, possibly followed by a closing quote)."""
    t = text.rstrip().rstrip("\"'\u201d)")
    return t.endswith(SENTENCE_END)
