"""Whisper's timestamp mode inside the verify loop: the timestamp rules at every verified tree node, and a proposer
wrapper that lets drafters trained on text alone speculate through timestamp tokens.

The rules are openai/whisper's ``ApplyTimestampRules`` (decoding.py; the same as transformers'
``WhisperTimeStampLogitsProcessor`` and faster-whisper's), applied after the suppress lists to the logits that
predict the token after a node, given the row's sampled tokens up to and including that node:

* ``<|notimestamps|>`` is never sampled;
* timestamps come in pairs: after a timestamp that follows a text token (a segment's end) the next token is a
  timestamp or EOT; after two timestamps (or a first one) it is text;
* timestamps do not decrease, and a segment is not empty: after a segment's end timestamp ``t`` the next is at least
  ``t``, otherwise at least the last timestamp + 1;
* the first sampled token is a timestamp of at most ``max_initial_timestamp`` (1.0 s);
* where the summed probability of the timestamp tokens exceeds that of every single text token, a timestamp is
  forced (text tokens banned).

In the verify loop a node's preceding tokens are the row's emitted tokens plus the draft tokens on its tree path, so
every node gets its own bounds (:func:`rule_bounds`, on the host from the tree layout the loop already holds; no
device read) and the logits of all nodes are masked in one vectorised step (:func:`apply_rules`). Every method's
greedy verification then keeps exactly the tokens ``ar`` emits, timestamp tokens included.

A row is in timestamp mode when its prompt lacks ``<|notimestamps|>`` (Whisper's own convention), so rows with and
without timestamps can share a batch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch

from .tree import DraftTree

MAX_INITIAL_TIMESTAMP_S = 1.0  # openai/whisper's DecodingOptions.max_initial_timestamp
TIMESTAMP_PRECISION_S = 0.02  # seconds per timestamp token (<|0.00|> .. <|30.00|>)
EXTRA_NODES = 2  # most nodes TimestampProposer adds to a proposal (a timestamp and an EOS branch)


@dataclass(frozen=True)
class TimestampTokens:
    """The token ids the timestamp rules read.

    Attributes:
        no_timestamps: ``<|notimestamps|>``; begin: ``<|0.00|>``, the first timestamp token (timestamps are
            ``begin .. vocab_size - 1``, :data:`TIMESTAMP_PRECISION_S` apart); eot: ``<|endoftext|>``;
        vocab_size: the model's vocabulary size; max_initial: the largest first timestamp, in timestamp steps.
    """

    no_timestamps: int
    begin: int
    eot: int
    vocab_size: int
    max_initial: int = round(MAX_INITIAL_TIMESTAMP_S / TIMESTAMP_PRECISION_S)

    def in_timestamp_mode(self, prompt: Sequence[int]) -> bool:
        """Whether a row with decoder prompt ``prompt`` decodes with timestamps (no ``<|notimestamps|>`` in it)."""
        return self.no_timestamps not in prompt

    def seconds(self, token: int) -> float:
        """The time a timestamp token stands for, in seconds."""
        return (token - self.begin) * TIMESTAMP_PRECISION_S


def _root_state(tokens: Sequence[int], begin: int) -> tuple[int, bool, bool, int]:
    """(sampled count, last is a timestamp, the one before is a timestamp or absent, last timestamp or -1)."""
    m = len(tokens)
    last_ts = m >= 1 and tokens[-1] >= begin
    prev_ts = m < 2 or tokens[-2] >= begin
    last_val = next((t for t in reversed(tokens) if t >= begin), -1)
    return m, last_ts, prev_ts, last_val


def rule_bounds(layout: dict, sampled: Sequence[Sequence[int]], on: Sequence[bool], tt: TimestampTokens
                ) -> np.ndarray:
    """Per tree node, what the timestamp rules allow after it.

    Args:
        layout: the trees' padded host layout (:meth:`~rayspec.spec_decode.tree.TokenTrees.padded`: ``tokens``,
            ``parents``, ``roots``, ``sizes``); the root of row ``b`` is its newest token.
        sampled: per row, the tokens sampled so far (after the prompt, up to and including the root).
        on: per row, whether it decodes with timestamps.

    Returns:
        int64 ``[4, B, Q]``: ``text_hi`` (token ids below it are banned), ``ts_lo``, ``ts_hi`` (timestamp tokens
        outside ``[ts_lo, ts_hi]`` are banned) and ``on`` (1 where the rules apply: root and draft nodes of rows in
        timestamp mode; elsewhere the bounds ban nothing).
    """
    tokens, parents, roots, sizes = layout["tokens"], layout["parents"], layout["roots"], layout["sizes"]
    b, q = tokens.shape
    begin = tt.begin
    m = np.full((b, q), -1, dtype=np.int64)
    last_ts = np.zeros((b, q), dtype=bool)
    prev_ts = np.ones((b, q), dtype=bool)
    last_val = np.full((b, q), -1, dtype=np.int64)
    live = np.zeros((b, q), dtype=bool)
    rows = np.arange(b)
    for k in range(b):
        if on[k]:
            r = int(roots[k])
            m[k, r], last_ts[k, r], prev_ts[k, r], last_val[k, r] = _root_state(sampled[k], begin)
            live[k, r] = True
    on_rows = np.asarray(on, dtype=bool)
    for j in range(int(roots.min()) + 1, q):  # parents come first: one pass in node order
        draft = on_rows & (j > roots) & (j < sizes)
        if not draft.any():
            continue
        p = np.maximum(parents[:, j], 0)
        tok = tokens[:, j]
        is_ts = tok >= begin
        mp = m[rows, p]
        m[:, j] = np.where(draft, mp + 1, m[:, j])
        last_ts[:, j] = np.where(draft, is_ts, last_ts[:, j])
        prev_ts[:, j] = np.where(draft, (mp == 0) | last_ts[rows, p], prev_ts[:, j])
        last_val[:, j] = np.where(draft, np.where(is_ts, tok, last_val[rows, p]), last_val[:, j])
        live[:, j] = draft
    first = m == 0
    seg_end = last_ts & ~prev_ts  # a timestamp after text: the next is a timestamp or EOT
    text_hi = np.where(first, begin, np.where(seg_end, tt.eot, 0))
    ts_hi = np.where(first, begin + tt.max_initial, np.where(last_ts & prev_ts, begin - 1, tt.vocab_size - 1))
    ts_lo = np.where(last_val < 0, begin, np.where(seg_end, last_val, last_val + 1))
    off = ~live
    text_hi[off], ts_lo[off], ts_hi[off] = 0, 0, tt.vocab_size
    return np.stack([text_hi, ts_lo, ts_hi, live.astype(np.int64)])


def apply_rules(logits: torch.Tensor, bounds: np.ndarray, tt: TimestampTokens, host_cut: Optional[bool] = None
                ) -> torch.Tensor:
    """Mask logits ``[B, Q, V]`` (suppress lists applied) with the timestamp rules, IN PLACE; returns ``logits``.

    Args:
        logits: float ``[B, Q, V]``, contiguous; banned tokens get ``-inf``.
        bounds: int64 ``[4, B, Q]`` on the host, from :func:`rule_bounds`.
        host_cut: write the text bans as host-decided slices (default: on a CPU) or as one masked write.

    The forced-timestamp rule compares the log of the timestamps' summed probability with the best text token's log
    probability (openai/whisper computes both after ``log_softmax``; the normaliser cancels, so logits are compared).
    Only the timestamp columns (1,501 of Whisper's 51,865) are masked elementwise; the text bans are prefixes of the
    vocabulary (``[0, eot)`` after a segment's end, ``[0, begin)`` at the first position or where a timestamp is
    forced), written as slices. On a CPU the forced rows are read to the host (free there) and only their prefixes
    written; elsewhere one masked write over the text columns avoids a device read.
    """
    text_hi, ts_lo, ts_hi, on = bounds.reshape(4, -1)
    nodes = np.flatnonzero(on)
    if not len(nodes):
        return logits
    v, begin, eot = logits.shape[-1], tt.begin, tt.eot
    flat = logits.view(-1, v)
    dev = logits.device
    pick = torch.from_numpy(nodes).to(dev, non_blocking=True)
    stamps = flat[:, begin:].index_select(0, pick)  # [N, T] the timestamp logits of the nodes the rules apply to
    ids = torch.arange(v - begin, device=dev)
    lo = torch.from_numpy(ts_lo[nodes] - begin).to(dev, non_blocking=True)[:, None]
    hi = torch.from_numpy(ts_hi[nodes] - begin).to(dev, non_blocking=True)[:, None]
    stamps.masked_fill_((ids < lo) | (ids > hi), float("-inf"))
    flat[:, tt.no_timestamps].index_fill_(0, pick, float("-inf"))
    cut = text_hi[nodes]  # 0, eot or begin: the banned text prefix
    cut_t = torch.from_numpy(cut).to(dev, non_blocking=True)
    low = flat[:, :eot].amax(-1).index_select(0, pick)  # best ordinary text token (before the prefix ban)
    high = flat[:, eot:begin].amax(-1).index_select(0, pick)  # best special token (usually all suppressed)
    text_best = torch.where(cut_t == 0, torch.maximum(low, high), torch.where(cut_t == eot, high, float("-inf")))
    force = stamps.float().logsumexp(-1) > text_best.float()  # [N]
    flat[:, begin:].index_copy_(0, pick, stamps)
    if host_cut if host_cut is not None else dev.type == "cpu":
        cut = np.where(force.numpy(), begin, cut)
        for n, c in zip(nodes.tolist(), cut.tolist()):
            if c:
                flat[n, :c] = float("-inf")
    else:
        final = torch.where(force, begin, cut_t)[:, None]  # [N, 1]
        text = flat[:, :begin].index_select(0, pick)
        text.masked_fill_(torch.arange(begin, device=dev) < final, float("-inf"))
        flat[:, :begin].index_copy_(0, pick, text)
    return logits


class TimestampProposer:
    """Wraps a proposer whose drafter knows only text (every bundled one) for rows in timestamp mode.

    The drafter sees each row as it would without timestamps: the prompt with ``<|notimestamps|>`` and the emitted
    text tokens (timestamps dropped), and proposes text. Around that the wrapper adds the timestamp pattern the
    target most often emits: a row's first token ``<|0.00|>``, and after a segment's end timestamp ``t`` (which must
    be followed by a timestamp or EOT) the next segment's start ``t`` again, with EOT as a second branch. The
    drafter's tree hangs under the added timestamp; the verifier decides as for any draft, so the output stays the
    target's. Where the drafter proposes EOS after text, a segment's end timestamp must usually come first: a
    second branch proposes the target's likeliest timestamp at the end of the last verified path (from the
    feedback; the time a segment ending there would end) followed by EOS. Feedback is mapped back to the drafter's
    own nodes. Rows not in timestamp mode pass through unchanged.
    Other attributes (``admit``, ``needs_hidden``, ``needs_cross``) are the wrapped proposer's.

    A prompt that carries previous text (``<|startofprev|> ... <|startoftranscript|> ...``, Whisper's long-form
    conditioning) is shown to the drafter from ``<|startoftranscript|>`` on.

    Args:
        inner: the wrapped proposer; tt: the target's timestamp tokens; prompt: the target's prompt with
            ``<|notimestamps|>`` (what the drafter sees; it starts with ``<|startoftranscript|>``); eos: the
            target's EOS id.
    """

    def __init__(self, inner, tt: TimestampTokens, prompt: Sequence[int], eos: int) -> None:
        self.inner, self.tt, self.prompt_len, self.eos = inner, tt, len(prompt), eos
        self.sot = prompt[0]
        self._added: dict = {}  # row key -> (timestamp nodes before the drafter's tree, end of the drafter's nodes)
        self._stamp: dict = {}  # row key -> the target's likeliest timestamp at the end of its last kept path

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def propose(self, requests, *args):
        tt, p = self.tt, self.prompt_len
        views, added = [], {}
        for r in requests:
            seq = r.seq if r.seq[0] == self.sot else r.seq[r.seq.index(self.sot):]  # without previous text
            if tt.no_timestamps in seq[:p]:
                views.append(dataclasses.replace(r, seq=seq) if seq is not r.seq else r)
                continue
            gen = seq[p - 1 :]
            pre = []
            if not gen:  # a new row (a refilled slot keeps its key): no guess of an earlier row's
                self._stamp.pop(r.index, None)
            if r.speculate:
                if not gen:
                    pre = [tt.begin]
                elif gen[-1] >= tt.begin and len(gen) >= 2 and gen[-2] < tt.begin:
                    pre = [gen[-1]]
            added[r.index] = (pre, bool(gen))
            text = [t for t in gen if t < tt.begin]
            views.append(dataclasses.replace(r, seq=seq[: p - 1] + [tt.no_timestamps] + text,
                                             room=max(1, r.room - len(pre))))
        props = self.inner.propose(views, *args)
        self._added = {}
        out = []
        for r, prop in zip(requests, props):
            pre, started = added.get(r.index, (None, False))
            if pre is None:
                out.append(prop)
                continue
            n = len(pre)
            tokens = list(pre) + list(prop.tree.tokens)
            parents = list(range(-1, n - 1)) + [q + n if q >= 0 else n - 1 for q in prop.tree.parents]
            guess = self._stamp.get(r.index)
            ends = [i for i, t in enumerate(tokens) if t == self.eos and i >= n] if guess is not None else []
            if ends:  # the drafter ends the text: a segment's end timestamp, then EOS, as the other branch
                under = parents[ends[0]]
                if (tokens[under] if under >= 0 else r.seq[-1]) < tt.begin:
                    parents += [under, len(tokens)]
                    tokens += [guess, self.eos]
            if n and started:  # after a segment's end: EOT is the other choice
                tokens.append(self.eos)
                parents.append(-1)
            self._added[r.index] = (n, n + len(prop.tree))  # the drafter's nodes: n .. n + len - 1
            out.append(prop if len(tokens) == len(prop.tree) else
                       dataclasses.replace(prop, tree=DraftTree(tuple(tokens), tuple(parents))))
        return out

    def update(self, feedback) -> None:
        mapped = []
        for f in feedback:
            if f.timestamp is not None:
                self._stamp[f.index] = f.timestamp
            n, size = self._added.get(f.index, (0, None))
            if size is not None:  # keep the drafter's own nodes of the kept path (the added ones are not its)
                path = f.accepted
                inner = path[n:] if path[:n] == list(range(n)) else []
                f = dataclasses.replace(f, accepted=[a - n for a in inner if a < size])
            mapped.append(f)
        self.inner.update(mapped)


def wrap_proposer(proposer, tt: Optional[TimestampTokens], prompt: Sequence[int], eos: int):
    """``proposer`` wrapped in :class:`TimestampProposer` (None and models without timestamps: as it is)."""
    if proposer is None or tt is None:
        return proposer
    return TimestampProposer(proposer, tt, prompt, eos)
