"""Input-time speculation for cascade voice chat (PredGen: "Accelerated Inference of Large Language Models through
Input-Time Speculation for Real-Time Speech Interaction", Li & Grover 2025, arXiv:2506.15556, Algorithm 1 and
section 3.1).

While the user is still speaking, every partial prompt ``P_i`` (1) verifies the previous candidate reply ``R_{i-1}``
in one forward pass over ``P_i + R_{i-1}`` with the KV cache cut to the shared prompt prefix, (2) keeps the longest
accepted prefix plus the target's own next token (the bonus), (3) extends it to a candidate that covers the first
sentence, and (4) pre-synthesises that sentence. At the end of the input one last verification decides: the first
sentence fully accepted -> its audio plays at once (one LLM pass to first sentence); otherwise generation resumes
from the accepted prefix. With the ``greedy`` verifier the reply equals the plain cascade's greedy reply token for
token (lossless); ``topk`` accepts a candidate token while it is among the target's top k (lossy, faster).

Two additions to the paper's AR variant, both lossless: every LLM pass that extends a candidate or resumes after
the final verification also verifies draft tokens looked up in the turn's rejected candidates
(:func:`draft_from_pool`: a candidate wrong at one word is often right again after it); and the first sentence's
audio is taken from the pre-synthesised ones whenever the reply's first sentence is exactly one of them (not only
when the newest candidate was accepted), so the audio of a sentence the reply does not start with is never played.

Time is simulated the way the paper's evaluation does: partial prompts arrive on a schedule (e.g. 600 characters per
minute) and every computation is timed for real; work on a partial that is still running when the next partials
arrive makes the engine skip to the newest one, and the final input stops a candidate's extension between two tokens
(the simulation's rule; the Serve session instead lets a running speculation step finish). The LLM and the TTS are
two workers on two timelines (as the LLM and TTS deployments of the Serve endpoint are): pre-synthesis starts when
its sentence is known and the TTS worker is free, and holds up no LLM work; a sentence superseded before its
synthesis starts is dropped; a final sentence that must be synthesised anew waits for the running synthesis.
Latencies are measured from the arrival of the final input.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np

from ..spec_decode.acceptance import AcceptanceRule, accept_tree, score_tree
from ..spec_decode.tree import DraftTree, TokenTrees
from .lm import CausalLM, ends_sentence

VERIFIERS = ("greedy", "topk")


@dataclass
class PredGenOptions:
    """Options of one voice-chat turn.

    Attributes:
        speculate: False = the baseline cascade (wait for the whole input, then LLM, then TTS).
        verifier: "greedy" (lossless) or "topk" (accept a candidate token while it is in the target's top ``top_k``).
        top_k: k of the top-k verifier.
        candidate_tokens: a candidate reply is extended to at least this many tokens (and through its first
            sentence) at every partial prompt.
        max_reply_tokens: reply length cap (tokens).
        max_wasted_tokens: cap on speculative LLM tokens thrown away per turn (rejected candidate tokens); once
            reached, the turn stops speculating and waits for the end of the input like the baseline.
        presynthesize: synthesise the candidate's first sentence while the user speaks.
        draft_tokens: draft tokens per LLM pass looked up in the turn's earlier candidates when a candidate is
            extended and after the final input (:func:`draft_from_pool`; lossless with the greedy verifier);
            0 = one token per pass. The cascade has no candidates and decodes one token per pass.
    """

    speculate: bool = True
    verifier: str = "greedy"
    top_k: int = 3
    candidate_tokens: int = 24
    max_reply_tokens: int = 80
    max_wasted_tokens: int = 400
    presynthesize: bool = True
    draft_tokens: int = 16

    def __post_init__(self) -> None:
        if self.verifier not in VERIFIERS:
            raise ValueError(f"unknown verifier {self.verifier!r} ({', '.join(VERIFIERS)})")
        if self.top_k < 1 or self.candidate_tokens < 1 or self.max_reply_tokens < 1:
            raise ValueError("top_k, candidate_tokens and max_reply_tokens must be >= 1")
        if self.draft_tokens < 0:
            raise ValueError("draft_tokens must be >= 0")

    @property
    def rule(self) -> AcceptanceRule:
        """The speculative core's acceptance rule of the verifier."""
        return AcceptanceRule("greedy") if self.verifier == "greedy" else AcceptanceRule("topk", top_k=self.top_k)

    @property
    def label(self) -> str:
        if not self.speculate:
            return "cascade"
        return "predgen-greedy" if self.verifier == "greedy" else f"predgen-top{self.top_k}"


@dataclass
class TurnResult:
    """One voice-chat turn. Times in seconds from the arrival of the final input.

    Attributes:
        reply_ids / reply: the LLM's reply (token ids without the stop token / text).
        first_sentence: the reply's first sentence (the TTS unit that audio latency waits for).
        first_audio: float32 ``[S]`` audio of the first sentence at ``sample_rate`` Hz.
        ttfs_s: time to first sentence (text) after the final input.
        audio_latency_s: final input -> first audio sample ready.
        nfe_to_first_sentence: LLM forward passes after the final input until the first sentence is known
            (1 = the pre-generated first sentence was accepted at once).
        outcome: final verification "accept" (first sentence accepted), "partial", "reject", or "none" (no
            candidate: baseline or speculation stopped).
        partials_used / partials_skipped: partial prompts processed / skipped because the engine was busy.
        accepted_tokens: candidate tokens accepted by the final verification.
        wasted_tokens: speculative LLM tokens generated and later rejected (the turn's extra LLM work).
        wasted_tts_s: seconds of pre-synthesised audio never played.
        llm_s / tts_s: compute after the final input spent in the LLM / TTS.
        speculative_s: compute spent while the user was speaking.
    """

    reply_ids: list[int]
    reply: str
    first_sentence: str
    first_audio: np.ndarray
    sample_rate: int
    ttfs_s: float
    audio_latency_s: float
    nfe_to_first_sentence: int
    outcome: str
    partials_used: int = 0
    partials_skipped: int = 0
    accepted_tokens: int = 0
    wasted_tokens: int = 0
    wasted_tts_s: float = 0.0
    llm_s: float = 0.0
    tts_s: float = 0.0
    speculative_s: float = 0.0


def first_sentence_length(lm: CausalLM, ids: list[int]) -> Optional[int]:
    """Tokens of ``ids`` up to and including the end of its first sentence; None if no sentence ends in ``ids``."""
    for n in range(1, len(ids) + 1):
        if ends_sentence(lm.tokenizer.decode(ids[:n])):
            return n
    return None


def verify(lm: CausalLM, prompt: list[int], candidate: list[int], opts: PredGenOptions) -> tuple[int, list[int]]:
    """Verify ``candidate`` as the reply to ``prompt`` in one forward pass (section 3.1.1), with the speculative
    core's acceptance rules: the candidate is a one-chain token tree rooted at the prompt's last token, scored by
    ``greedy`` or ``topk`` (:mod:`rayspec.spec_decode.acceptance`).

    Returns:
        ``(k, kept)``: ``k`` accepted candidate tokens and ``kept = candidate[:k] + [bonus]``, the bonus being the
        target's argmax after the accepted prefix (absent when it is a stop token).
    """
    logits = lm.next_logits(prompt + candidate, since=len(prompt))  # [1 + len(candidate), V]: root, then drafts
    trees = TokenTrees.build([[prompt[-1]]], [DraftTree.chain(candidate)])
    dev = trees.to_device(0, np.array([-1]), logits.device)
    paths = accept_tree(dev.host, score_tree(logits[None], dev, opts.rule))
    k, bonus = int(paths.accepted[0]), int(paths.next_tokens[0])
    return k, candidate[:k] + ([] if bonus in lm.stop_ids else [bonus])


def draft_from_pool(pool: list[list[int]], reply: list[int], max_len: int) -> list[int]:
    """Draft tokens to follow ``reply``, looked up in the turn's earlier candidate replies: prompt-lookup drafting
    (Saxena 2023, "Prompt Lookup Decoding") over PredGen's own candidates. A candidate rejected at one token often
    goes on as the target's reply does after it (a word swapped, the rest of the sentence the same: the observation
    behind PredGen's Jacobi/CLLM variant, Li & Grover 2025, section 3.4), so its tail drafts what follows.

    The longest suffix of ``reply`` (3, 2 or 1 tokens) found in a candidate picks the draft: the tokens after that
    match, the match nearest ``reply``'s own position (then the newest candidate) winning; a one-token match drafts
    at most 2 tokens (on a CPU a pass over 16 tokens costs about two one-token passes, so a weak guess must be
    short). An empty ``reply`` drafts the newest candidate's start.

    Args:
        pool: candidate replies (token ids), oldest first.
        reply: the reply so far (token ids).
        max_len: the most draft tokens returned.

    Returns:
        Up to ``max_len`` token ids (empty: nothing matches).
    """
    if max_len <= 0 or not pool:
        return []
    if not reply:
        return list(pool[-1][:max_len])
    for n in range(min(3, len(reply)), 0, -1):
        key, want, best = reply[-n:], len(reply) - n, None
        for age, seq in enumerate(reversed(pool)):
            for i in range(len(seq) - n):
                if seq[i : i + n] == key:
                    score = (abs(i - want), age)
                    if best is None or score < best[0]:
                        best = (score, seq[i + n : i + n + max_len])
        if best is not None:  # a one-token match is weak evidence: it drafts at most 2 tokens
            return list(best[1] if n > 1 else best[1][:2])
    return []


def _extend(lm: CausalLM, prompt: list[int], reply: list[int], target_len: int, cap: int,
            interrupted: Callable[[], bool] = lambda: False, pool: list[list[int]] = (),
            max_draft: int = 0) -> tuple[list[int], bool]:
    """Greedy-extend ``reply`` until it has ``target_len`` tokens and a complete first sentence, a stop token,
    ``cap`` tokens, or ``interrupted()`` (asked before each LLM pass). Returns (reply, stopped): ``stopped`` is True
    at a stop token or the cap, False otherwise (interrupted included).

    With ``max_draft > 0`` each pass also verifies up to ``max_draft`` draft tokens from ``pool``
    (:func:`draft_from_pool`) and keeps the drafts the target's argmax agrees with plus its own next token, so the
    reply is the greedy one token for token whatever the drafts (lossless); a pass may then add several tokens."""
    reply = list(reply)
    has_sentence = first_sentence_length(lm, reply) is not None
    while len(reply) < cap:
        if (has_sentence and len(reply) >= target_len) or interrupted():
            return reply, False
        draft = draft_from_pool(pool, reply, min(max_draft, cap - len(reply) - 1))
        best = lm.next_logits(prompt + reply + draft, since=len(prompt) + len(reply)).argmax(-1).tolist()
        for j, tok in enumerate(best):
            if tok in lm.stop_ids:
                return reply, True
            reply.append(tok)
            # only the new prefix can end the first sentence
            has_sentence = has_sentence or ends_sentence(lm.tokenizer.decode(reply))
            if j >= len(draft) or tok != draft[j]:
                break
    return reply, True


@dataclass
class FirstSentence:
    """What the final verification decides (see :meth:`PredGenEngine.finish`).

    Attributes:
        text: the reply's first sentence.
        outcome: "accept" (the candidate's whole first sentence accepted), "partial", "reject" or "none".
        accepted_tokens: candidate tokens accepted by the final verification.
        nfe: LLM forward passes after the final input until the first sentence was known.
    """

    text: str
    outcome: str
    accepted_tokens: int
    nfe: int


class PredGenEngine:
    """The LLM side of one turn of PredGen (Algorithm 1): candidate replies from partial inputs, their verification,
    and the reply after the final input. Speech is the caller's: it synthesises :meth:`speculate`'s first sentences
    ahead and plays one only if it is exactly the first sentence :meth:`finish` returns.

    Attributes:
        wasted_tokens: candidate tokens generated and then rejected so far this turn.
        speculating: False once the wasted-token cap is reached (or for the baseline cascade).
    """

    def __init__(self, lm: CausalLM, opts: PredGenOptions) -> None:
        """Raises: ValueError: a top-k verifier wider than the engine's scores (``lm.max_top_k``)."""
        if opts.verifier == "topk" and opts.top_k > lm.max_top_k:
            raise ValueError(f"top_k {opts.top_k} is over this LLM engine's limit of {lm.max_top_k}")
        self.lm, self.opts = lm, opts
        self.candidate: list[int] = []
        self.pool: list[list[int]] = []  # earlier candidates, drafts for later passes (newest last)
        self.wasted_tokens = 0
        self.speculating = opts.speculate
        self._prompt: list[int] = []
        self._reply: list[int] = []
        self._stopped = False

    def speculate(self, text: str, interrupted: Callable[[], bool] = lambda: False) -> Optional[str]:
        """A new partial input: verify the candidate under it, keep the accepted prefix + bonus, extend (Algorithm 1
        lines 12-14) until ``interrupted()`` says a newer input has come. Returns the candidate's first sentence
        (None if it has none yet or speculation is off)."""
        if not self.speculating:
            return None
        prompt = self.lm.prompt_ids(text)
        if self.candidate:
            k, kept = verify(self.lm, prompt, self.candidate, self.opts)
            self.wasted_tokens += len(self.candidate) - k
            self._remember(self.candidate, k)
            self.candidate = kept[: self.opts.max_reply_tokens]  # the bonus may not pass the reply cap
        self.candidate, _ = _extend(self.lm, prompt, self.candidate, self.opts.candidate_tokens,
                                    self.opts.max_reply_tokens, interrupted, self.pool, self.opts.draft_tokens)
        if self.wasted_tokens >= self.opts.max_wasted_tokens:
            self.speculating = False
        n = first_sentence_length(self.lm, self.candidate)
        return None if n is None else self.lm.decode(self.candidate[:n]).strip()

    def finish(self, text: str) -> FirstSentence:
        """The final input: verify the candidate once more and, unless its first sentence was accepted whole,
        generate from the accepted prefix to the end of the first sentence (lines 17-25)."""
        self._prompt = self.lm.prompt_ids(text)
        passes0 = self.lm.forward_passes
        outcome, k = "none", 0
        if self.candidate:
            k, kept = verify(self.lm, self._prompt, self.candidate, self.opts)
            self._reply = kept[: self.opts.max_reply_tokens]
            self._stopped = len(self._reply) >= self.opts.max_reply_tokens
            self.wasted_tokens += len(self.candidate) - k
            self._remember(self.candidate, k)
            n_cand = first_sentence_length(self.lm, self.candidate)
            outcome = "accept" if n_cand is not None and k >= n_cand else ("partial" if k else "reject")
        n = first_sentence_length(self.lm, self._reply)
        if n is None and not self._stopped:  # resume from the accepted prefix until the first sentence is complete
            self._reply, self._stopped = _extend(self.lm, self._prompt, self._reply, 1, self.opts.max_reply_tokens,
                                                 pool=self.pool, max_draft=self.opts.draft_tokens)
            n = first_sentence_length(self.lm, self._reply) or len(self._reply)
        return FirstSentence(self.lm.decode(self._reply[:n]).strip(), outcome, k, self.lm.forward_passes - passes0)

    def _remember(self, candidate: list[int], accepted: int) -> None:
        """Keep a verified candidate with a rejected tail as a draft source (the newest 16)."""
        if accepted < len(candidate):
            self.pool = (self.pool + [list(candidate)])[-16:]

    def complete(self) -> list[int]:
        """The whole reply after :meth:`finish` (greedy to a stop token or ``max_reply_tokens``)."""
        if not self._stopped:
            self._reply = _complete(self.lm, self._prompt, self._reply, self.opts.max_reply_tokens)
            self._stopped = True
        return self._reply


def run_turn(lm: CausalLM, voice, partials: list[tuple[float, str]], opts: PredGenOptions,
             clock: Callable[[], float] = time.perf_counter) -> TurnResult:
    """One voice-chat turn over a stream of partial user inputs, on a simulated clock (module docstring).

    Args:
        lm: the LLM engine (its cache is reset at the start of the turn).
        voice: a TTS backend (``synthesize(text) -> float32 [S]``, ``sample_rate``).
        partials: ``(arrival_s, text)`` in arrival order; the last one is the final input.
        opts: see :class:`PredGenOptions`.

    Returns:
        :class:`TurnResult`; ``reply`` is the full reply (generation continues after the first sentence).

    Raises:
        ValueError: no partials.
    """
    if not partials:
        raise ValueError("a turn needs at least the final input")
    lm.reset()
    engine = PredGenEngine(lm, opts)
    res = TurnResult([], "", "", np.zeros(0, np.float32), voice.sample_rate, 0.0, 0.0, 0, "none")
    llm_free = 0.0  # simulated time at which the LLM is free again
    tts = _TTSWorker(voice, clock)
    i, last = 0, len(partials) - 1
    while engine.speculating and i < last and llm_free < partials[last][0]:  # stop once the final input is in
        llm_free = max(llm_free, partials[i][0])
        j = max(k for k in range(i, last) if partials[k][0] <= llm_free)  # newest partial that has arrived
        res.partials_skipped += j - i
        t0, began = clock(), llm_free
        first = engine.speculate(partials[j][1], lambda: began + clock() - t0 >= partials[last][0])
        spent = clock() - t0
        llm_free += spent
        res.speculative_s += spent
        res.partials_used += 1
        i = j + 1
        if opts.presynthesize and first is not None:
            tts.submit(llm_free, first)
    t_end = partials[last][0]
    start = max(llm_free, t_end)  # the LLM may still be busy with a partial when the input ends
    t0 = clock()
    first = engine.finish(partials[last][1])
    text_at = start + clock() - t0
    res.llm_s = text_at - start
    tts.advance(text_at)
    if first.text in tts.done:  # this exact sentence was pre-synthesised (never a rejected candidate's sentence)
        first_audio, ready = tts.done[first.text]
        audio_at = max(text_at, ready)
    else:
        first_audio, audio_at = tts.synthesize_now(first.text, text_at)
    res.tts_s = audio_at - text_at
    res.speculative_s += tts.speculative_s
    res.wasted_tts_s = sum(len(a) for t, (a, _) in tts.done.items() if t != first.text) / voice.sample_rate
    res.ttfs_s, res.audio_latency_s = text_at - t_end, audio_at - t_end
    res.reply_ids = engine.complete()
    res.reply = lm.decode(res.reply_ids)
    res.first_sentence, res.first_audio = first.text, first_audio
    res.outcome, res.accepted_tokens, res.nfe_to_first_sentence = first.outcome, first.accepted_tokens, first.nfe
    res.wasted_tokens = engine.wasted_tokens
    return res


class _TTSWorker:
    """The simulation's TTS worker: one synthesis at a time, each timed for real. A sentence submitted while a
    synthesis runs waits; a newer one replaces it before it starts (latest wins); a running one finishes."""

    def __init__(self, voice, clock) -> None:
        self.voice, self.clock = voice, clock
        self.free = 0.0  # when the running synthesis ends (simulated s)
        self.done: dict = {}  # sentence -> (audio, ready_at) of every synthesis started
        self.pending: Optional[tuple[float, str]] = None  # (submitted_at, sentence), not started
        self.speculative_s = 0.0

    def _run(self, sentence: str, start: float) -> tuple[np.ndarray, float]:
        t0 = self.clock()
        audio = self.voice.synthesize(sentence) if sentence else np.zeros(0, np.float32)
        spent = self.clock() - t0
        self.free = max(self.free, start) + spent
        return audio, self.free

    def advance(self, now: float) -> None:
        """Start the pending sentence if the worker is free by ``now``."""
        if self.pending is not None and self.free <= now:
            at, sentence = self.pending
            self.pending = None
            t0 = self.clock()
            self.done[sentence] = self._run(sentence, at)
            self.speculative_s += self.clock() - t0

    def submit(self, at: float, sentence: str) -> None:
        self.advance(at)
        if sentence not in self.done:
            self.pending = (at, sentence)
            self.advance(at)

    def synthesize_now(self, sentence: str, at: float) -> tuple[np.ndarray, float]:
        """The final sentence: after the running synthesis, nothing pending any more."""
        self.pending = None
        return self._run(sentence, at)


def _complete(lm: CausalLM, prompt: list[int], reply: list[int], cap: int) -> list[int]:
    """Greedy-continue ``reply`` to a stop token or ``cap`` tokens."""
    return reply + lm.generate(prompt + reply, max(0, cap - len(reply)))
