"""The typed options of every decoding method, importable without torch (a Ray job's driver parses and checks them,
then hands them to actors that load the models; faster-whisper's typed options are the model).

:class:`DecodeOptions` is what ``rayspec transcribe`` / ``python -m jobs.transcribe`` / Serve / ``rayspec.load``
decode with; :class:`SpeculationOptions` (the ``draft`` method), :class:`SSDOptions`, :class:`MedusaOptions` and
:class:`BeamOptions` are its parts. :data:`METHOD_SUMMARIES` names the methods (``--method``); their implementations
are :data:`rayspec.methods.METHODS`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import numpy as np

from .common import DEFAULT_MAX_TOKENS_PER_SECOND
from .fallback import FallbackOptions

if TYPE_CHECKING:  # annotations only: importing either costs torch's import
    import torch

    from ..spec_decode.acceptance import AcceptanceRule

METHOD_SUMMARIES: dict[str, str] = {
    "ar": "target greedy, one target pass per token",
    "draft": "a draft model proposes tokens (SpecASR; token trees with --tree), the target verifies them in one pass; "
             "output identical to ar",
    "ssd": "the CTC head's hypothesis is gated by entropy, verified by the target in one pass, and decoding falls back "
           "from the verified prefix (lossy unless --exact and --tau-ctc 0)",
    "ctc-draft": "the CTC head's hypothesis is the draft of every round, re-aligned after each correction of the "
                 "target; output identical to ar, no draft model",
    "medusa": "Medusa heads on the target's own hidden state propose a sparse token tree, verified in one pass; greedy "
              "acceptance is identical to ar, --acceptance typical is lossy",
}
"""``--method`` name -> one sentence for ``--help`` (the implementations: :data:`rayspec.methods.METHODS`)."""
TIMESTAMPS = ("none", "segment", "word")
"""Values of ``--timestamps``."""
MEL_PADDINGS = ("silence", "zeros")
"""Values of ``--mel-padding``: how a stock Whisper's 30 s window of log-mel features is filled after the audio
(:meth:`~rayspec.models.whisper.WhisperASR.features`)."""
STATIC_STEP_MODES = ("auto", "on", "off")
"""Values of ``--static-steps`` (:mod:`rayspec.runner.static_step`)."""
DEFAULT_MAX_BATCH = 64
"""The largest batch bucket with static decoder steps and CUDA graphs by default (``--max-graph-batch``)."""
# on a CPU, speculation pays only while the batch is small: a verification pass's cost grows with its rows x draft
# nodes (whisper-base, 2 threads, 16 rows: 37 / 58 / 91 / 150 ms for 1 / 2 / 4 / 10 new positions per row, one
# row: 12.7 / 13.5 / 13.0 / 16.1 ms), so above this many live rows a round verifies no draft (vLLM's
# ``disable_by_batch_size``); measured by decoding 32 LJSpeech clips at 1-16 rows, see docs/benchmarks/medusa.md
CPU_SPECULATE_MAX_ROWS = 2


@dataclass(frozen=True)
class SpeculationOptions:
    """Options of draft-model speculation (defaults: SpecASR's adaptive length and recycling, no token tree).

    The defaults were the fastest exact configuration at batch 1 and within 1% of the fastest at batch 16 with the zoo
    on a CPU (``rayspec bench --suite spec --repeats 3``, AN4 test): a draft pass there costs about a third of a
    target pass (per-call overhead dominates at these sizes), so long drafts (SpecASR used 24 tokens) and the tree's
    second drafting pass cost more than the target passes they save. On a GPU with a large target, raise
    ``max_draft`` and try ``tree``.

    Attributes:
        max_draft: most trunk tokens per round (SpecASR: 24; default 8).
        threshold: adaptive drafting stops after the first token whose draft top-1 probability is below this
            (SpecASR IV.A: 0.4); 0 drafts exactly ``max_draft`` tokens (fixed-length speculation).
        recycle: reuse the rejected draft suffix where the new draft re-joins it (IV.B).
        tree: draft branches at uncertain trunk positions and verify a token tree (IV.C).
        tree_threshold: trunk positions with top-1 probability below this are branch candidates.
        tree_branches: most branches per row and round (the least confident positions first).
        branch_max: most tokens per branch.
        vocabulary: read drafts out over the draft's own vocabulary where its config lists one (FR-Spec,
            arXiv:2502.14856; :meth:`~rayspec.models.whisper.WhisperASR.readout_logits`): a draft pass skips most of
            the output projection, the draft never proposes a token outside that vocabulary, and ``threshold``
            compares probabilities normalised over it. Off: the whole vocabulary.
    """

    max_draft: int = 8
    threshold: float = 0.4
    recycle: bool = True
    tree: bool = False
    tree_threshold: float = 0.6
    tree_branches: int = 2
    branch_max: int = 8
    vocabulary: bool = True

    def __post_init__(self):
        if self.max_draft < 1 or self.tree_branches < 0 or self.branch_max < 1:
            raise ValueError(f"invalid speculation options: {self}")

    @property
    def nodes_per_round(self) -> int:
        """Most draft tokens one row can send to verification in one round (trunk + branches)."""
        return self.max_draft + self.branch_max * (self.tree_branches if self.tree else 0)


@dataclass(frozen=True)
class SSDOptions:
    """Options of :class:`~rayspec.decoding.ssd.SSDDecoder`.

    The defaults are ``rayspec transcribe --method ssd``'s (lossy); ``SSDOptions(tau_ctc=0.0, exact=True)`` decodes
    exactly as AR.

    Attributes:
        tau_ctc: CTC gate threshold on the largest frame entropy (nats); 0 turns the gate off (default 0.7:
            calibrated for whisper-base's bundled head on its dev split, see its card).
        tau_slm: verification threshold on each token's target probability (eq. 5; default 0.2, the paper's
            high-accuracy setting, Table 1).
        exact: verify by the target's argmax alone (greedy acceptance, ``tau_slm`` not read): output == AR greedy
            when tau_ctc = 0. Requiring a probability above ``tau_slm`` as well would change no token (a rejected
            argmax is the target's next token anyway), only stop the kept prefix earlier and keep the verification
            off the greedy rule's cheaper scoring paths (the lazy projection, a static step's fused head).
        verify: run the verification pass; False sends every gate-rejected utterance to full AR from the prompt
            (the paper's "CTC gate + AR" ablation).
        fallback: "ar" (greedy: the paper's), "draft" (draft-model speculation from the prefix) or "ctc" (the
            default: the CTC hypothesis re-aligned after the prefix, verified with this rule, ``tau_slm`` and
            ``exact``, each round; with whisper-base's head the verified prefix is short, a few tokens on LJSpeech,
            so the paper's AR fallback decodes most tokens one pass each: ``bench/ssd-gate``).
        speculation: options of the draft fallback.
    """

    tau_ctc: float = 0.7
    tau_slm: float = 0.2
    exact: bool = False
    verify: bool = True
    fallback: str = "ctc"
    speculation: SpeculationOptions = SpeculationOptions()

    def __post_init__(self):
        if self.fallback not in ("ar", "draft", "ctc"):
            raise ValueError(f"fallback must be 'ar', 'draft' or 'ctc', not {self.fallback!r}")

    @property
    def rule(self) -> AcceptanceRule:
        """The verification rule: eq. 5's threshold, or with ``exact`` the greedy rule."""
        from ..spec_decode.acceptance import GREEDY, AcceptanceRule

        return GREEDY if self.exact else AcceptanceRule("threshold", tau=self.tau_slm, exact=False)


@dataclass(frozen=True)
class MedusaOptions:
    """Options of the medusa method.

    Attributes:
        heads: Medusa heads directory (default: the heads bundled for the target, if any).
        acceptance: "greedy" (exact: output == the target's greedy output) or "typical" (Medusa's typical
            acceptance, lossy).
        epsilon, delta: typical acceptance keeps a token whose probability exceeds ``min(epsilon, delta * exp(-H))``.
        tree: candidate paths of the sparse tree; None: :func:`~rayspec.decoding.medusa_proposer.default_tree` for the target's device.
    """

    heads: Optional[str] = None
    acceptance: str = "greedy"
    epsilon: float = 0.09
    delta: float = 0.3
    tree: Optional[tuple[tuple[int, ...], ...]] = None

    def __post_init__(self):
        if self.acceptance not in ("greedy", "typical"):
            raise ValueError(f"acceptance must be 'greedy' or 'typical', not {self.acceptance!r}")

    def tree_for(self, device: torch.device) -> tuple[tuple[int, ...], ...]:
        """The candidate paths in effect on ``device``."""
        from .medusa_proposer import default_tree

        return self.tree if self.tree is not None else default_tree(device)


@dataclass(frozen=True)
class BeamOptions:
    """Beam search settings (openai/whisper's ``DecodingOptions`` fields of the same names).

    Attributes:
        beam_size: beams kept per audio (1: greedy decoding's tokens).
        patience: the search of an audio stops once ``round(beam_size * patience)`` finished candidates are held
            (Kasai et al. 2022, arXiv:2204.05424); 1.0 is the usual beam search.
        length_penalty: None ranks finished candidates by summed log-probability over length; ``alpha`` in [0, 1]
            divides by Google NMT's ``((5 + length) / 6) ** alpha`` instead.

    Raises:
        ValueError: a beam size below 1 or not an integer, a patience that is not a finite number > 0 or that leaves
            no candidate (``round(beam_size * patience) < 1``), a length penalty outside [0, 1].
    """

    beam_size: int = 5
    patience: float = 1.0
    length_penalty: Optional[float] = None

    def __post_init__(self) -> None:
        if isinstance(self.beam_size, bool) or not isinstance(self.beam_size, (int, np.integer)) or self.beam_size < 1:
            raise ValueError(f"beam_size must be an integer >= 1, got {self.beam_size!r}")
        if isinstance(self.patience, bool) or not isinstance(self.patience, (int, float)) or not (
                math.isfinite(self.patience) and self.patience > 0):
            raise ValueError(f"patience must be a finite number > 0, got {self.patience!r}")
        if self.max_candidates < 1:
            raise ValueError(f"beam_size {self.beam_size} x patience {self.patience} rounds to no finished candidate")
        lp = self.length_penalty
        if lp is not None and (isinstance(lp, bool) or not isinstance(lp, (int, float)) or not 0 <= lp <= 1):
            raise ValueError(f"length_penalty must be None or a number in [0, 1], got {lp!r}")

    @property
    def max_candidates(self) -> int:
        """Finished candidates an audio collects before its search stops: ``round(beam_size * patience)``."""
        return round(self.beam_size * self.patience)


@dataclass
class DecodeOptions:
    """What decoder to run and how (see ``rayspec transcribe --help``).

    Attributes:
        method: a :data:`~rayspec.methods.METHODS` name: "ar" (target greedy), "draft" (draft-model speculative
            decoding, exact) or "ssd" (CTC gating, verification and fallback; exact only with ``ssd.exact`` and the
            gate off).
        max_tokens_per_second: cap on generated tokens per second of audio (against runaway repetition).
        speculation: options of the draft method (:class:`~rayspec.decoding.options.SpeculationOptions`).
        ssd: options of the ssd method (:class:`~rayspec.decoding.options.SSDOptions`).
        medusa: options of the medusa method (:class:`~rayspec.decoding.options.MedusaOptions`).
        vad: skip recordings without speech (empty text, route "no_speech"); long recordings are cut in pauses
            either way.
        segments: fill each row's ``segments`` column (start, end, text of every decoded segment).
        timestamps: "none", "segment" (decode with Whisper's timestamp tokens, every method under its timestamp
            rules, :mod:`rayspec.spec_decode.timestamps`; ``segments`` then holds the timed segments) or "word" (also
            ``words``: openai/whisper's word timing from the alignment heads, :func:`rayspec.timing.word_timestamps`,
            one extra target pass per batch).
        refine_words: with ``timestamps="word"``, a word start that falls in non-speech (frame energy over 15 dB below
            the row's loudest frame) moves forward to the word's first speech frame (:mod:`rayspec.activity`; never past
            the word itself); False keeps openai/whisper's recipe alone.
        long_form: how a recording longer than the model's window is decoded: "vad" (cut in pauses, the windows
            decoded independently) or "sequential" (Whisper's own algorithm, :mod:`rayspec.longform`: each window
            starts where the previous one's last complete segment ended; timed segments).
        condition_on_previous_text: with ``long_form="sequential"``, each window's prompt carries the text decoded
            before it (``<|startofprev|>``), as Whisper's ``condition_on_previous_text``.
        language: the decoder prompt's language code for multilingual models ("en"), or "auto": detected per
            segment from one decoder pass over ``<|startoftranscript|>`` (openai/whisper's ``detect_language``).
        task: "transcribe" or "translate" (into English; multilingual models).
        no_speech_threshold: a segment whose ``<|nospeech|>`` probability in the target's first pass exceeds this
            is dropped (route "no_speech"; openai/whisper's ``no_speech_threshold``, applied without its log-prob
            condition); None keeps every segment.
        compression_ratio_threshold: rows whose text's zlib compression ratio exceeds this are flagged
            ``repetitive`` (openai/whisper's hallucination statistic; the text is kept).
        speculate_max_rows: speculative methods verify drafts only in rounds with at most this many live rows; in
            larger rounds they take plain target steps (vLLM's ``disable_by_batch_size``; exact methods' tokens are
            the same either way). 0: no limit; None: the speculation rule decides per round and row from the whole round's
            measured costs (:mod:`rayspec.spec_decode.rule`), for lossless acceptance; lossy acceptance (SSD's relaxed
            threshold) and SSD's verification pass keep the device's fixed cap
            (:func:`~rayspec.spec_decode.loop.speculate_max_rows`: 2 on a CPU).
        mel_padding: how a stock Whisper's log-mel features fill its 30 s window after the audio
            (:data:`MEL_PADDINGS`): "silence" (the default) computes them over the audio padded with silence, as
            transformers' ``WhisperFeatureExtractor`` and openai/whisper's ``log_mel_spectrogram(pad_or_trim(audio))``
            do; "zeros" sets the frames from the audio's end on to 0, as openai/whisper's ``transcribe()`` and
            faster-whisper do (:meth:`~rayspec.models.whisper.WhisperASR.features`). The transcripts differ between
            the two; every method stays exact against ``ar`` at either.
        short_window_s: 0 (the default) runs a stock Whisper's encoder over its whole 30 s window, the exact
            reference; ``S > 0`` cuts each batch's window to its longest row + 2 s, at least ``S`` seconds
            (:meth:`~rayspec.models.whisper.WhisperASR.short_window`): lossy (``mode`` "lossy"), and the
            no-speech gate is off (``<|nospeech|>``'s probability rises in a short window: four AN4 clips of
            spelled words, 2.8-5 s, were dropped at 0.65-0.73; VAD still drops recordings without speech). Every
            method stays exact against ``ar`` at the same setting.
        static_steps: "auto" (static-shape decoder steps on a CUDA device with ``cuda_graphs``, none on a CPU),
            "on" (on any device; graphs only on CUDA) or "off" (:mod:`rayspec.runner.static_step`). The tokens are
            the same either way.
        cuda_graphs: capture each (batch bucket, query bucket) step as a CUDA graph when the model loads.
        max_graph_batch: the largest batch bucket with static steps and graphs; larger batches run dynamically.
        temperatures: the temperatures tried in order (openai/whisper's temperature fallback,
            :mod:`rayspec.decoding.fallback`); ``(0.0,)``: greedy only. Above 0 a row samples with the seeded
            Gumbel-max trick (:mod:`rayspec.spec_decode.gumbel`): for one ``seed`` every exact method samples the same
            tokens at any batch size.
        best_of: samples per row at a fallback temperature above 0 (the likeliest is kept).
        log_prob_threshold: fallback when a row's average log-probability is below this (None: never).
        seed: the seed of every sampled row (mixed with the utterance id, segment and attempt).
        initial_prompt: text the decoder reads before each segment (``<|startofprev|>`` + its tokens, openai/whisper's
            ``prompt`` / faster-whisper's ``initial_prompt``: vocabulary, spelling, style); None: none.
        hotwords: faster-whisper's ``hotwords``: words put in the same place, to make them likelier.
        beam_size: above 1, rows at temperature 0 decode with beam search (:mod:`rayspec.decoding.beam`,
            openai/whisper's ``BeamSearchDecoder``) instead of greedily; every method then returns the beam search's
            hypotheses: ``ctc-draft`` speculates under it exactly (each beam drafts from the CTC hypothesis,
            :mod:`rayspec.decoding.beam_speculative`) where the speculation rule says it pays
            (:func:`~rayspec.pipeline.beam_speculates`: not with its measured 1.12 steps a round) or a given
            ``speculate_max_rows`` allows all the beams, the others decode plain beam search.
        patience, length_penalty: beam search's (openai/whisper's ``patience`` and ``length_penalty``; the length
            penalty also ranks fallback samples).
        prefix: text each file's transcript starts with (faster-whisper's ``prefix``: its first segment's tokens
            are decided, the decoder goes on after them, and the text includes them); None: none.
    """

    method: str = "ar"
    max_tokens_per_second: float = DEFAULT_MAX_TOKENS_PER_SECOND
    speculation: Optional[SpeculationOptions] = None
    ssd: Optional[SSDOptions] = None
    medusa: Optional[MedusaOptions] = None
    vad: bool = True
    segments: bool = False
    timestamps: str = "none"
    refine_words: bool = True
    long_form: str = "vad"
    condition_on_previous_text: bool = True
    language: str = "en"
    task: str = "transcribe"
    no_speech_threshold: Optional[float] = 0.6
    compression_ratio_threshold: float = 2.4
    mel_padding: str = "silence"
    short_window_s: float = 0.0
    speculate_max_rows: Optional[int] = None
    static_steps: str = "auto"
    cuda_graphs: bool = True
    max_graph_batch: int = DEFAULT_MAX_BATCH
    temperatures: tuple[float, ...] = (0.0,)
    best_of: int = 5
    log_prob_threshold: Optional[float] = -1.0
    seed: int = 0
    initial_prompt: Optional[str] = None
    hotwords: Optional[str] = None
    beam_size: int = 1
    patience: float = 1.0
    length_penalty: Optional[float] = None
    prefix: Optional[str] = None

    def __post_init__(self):
        if self.prefix and self.method == "ssd":
            raise ValueError("--prefix works with ar, draft, ctc-draft and medusa, not ssd (its gate decides whole "
                             "transcripts)")
        if self.prefix and self.timestamps != "none":
            raise ValueError("--prefix needs --timestamps none")
        self.temperatures = self.fallback.temperatures  # validated (FallbackOptions)
        self.beam  # validated (BeamOptions)
        if self.method == "ssd" and self.temperatures[0] > 0:
            raise ValueError("method ssd decodes at temperature 0 first (its gate and verification are greedy); "
                             "start --temperature at 0")
        if self.method == "medusa" and self.medusa is not None and self.medusa.acceptance != "greedy" \
                and max(self.temperatures) > 0:
            raise ValueError("sampling (temperature > 0) needs --acceptance greedy")
        if self.speculate_max_rows is not None and self.speculate_max_rows < 0:
            raise ValueError(f"speculate_max_rows must be >= 0 (0: no limit), got {self.speculate_max_rows}")
        if self.static_steps not in STATIC_STEP_MODES:
            raise ValueError(f"static_steps must be one of {', '.join(STATIC_STEP_MODES)}, got {self.static_steps!r}")
        if self.max_graph_batch < 1:
            raise ValueError(f"max_graph_batch must be >= 1, got {self.max_graph_batch}")
        if self.mel_padding not in MEL_PADDINGS:
            raise ValueError(f"unknown mel_padding {self.mel_padding!r}: {' or '.join(MEL_PADDINGS)}")
        if self.short_window_s < 0:
            raise ValueError(f"short_window_s must be >= 0 (0: the full window), got {self.short_window_s}")
        if self.method not in METHOD_SUMMARIES:
            raise ValueError(f"unknown method {self.method!r}; choose from {', '.join(sorted(METHOD_SUMMARIES))}")
        if self.timestamps not in TIMESTAMPS:
            raise ValueError(f"unknown timestamps {self.timestamps!r}: {', '.join(TIMESTAMPS)}")
        if self.long_form not in ("vad", "sequential"):
            raise ValueError(f"unknown long_form {self.long_form!r}: vad or sequential")
        if self.long_form == "sequential" and self.timestamps == "word":
            raise ValueError("long_form='sequential' gives segment timestamps; word timestamps need long_form='vad'")
        if self.long_form == "sequential" and self.method == "ssd":
            raise ValueError("long_form='sequential' supports ar, draft, medusa and ctc-draft, not ssd")
        if self.task not in ("transcribe", "translate"):
            raise ValueError(f"unknown task {self.task!r}: transcribe or translate")
        if self.method == "ssd" and self.ssd is None:
            self.ssd = SSDOptions()
        if self.method == "draft" and self.speculation is None:
            self.speculation = SpeculationOptions()
        if self.method == "medusa" and self.medusa is None:
            self.medusa = MedusaOptions()

    @property
    def fallback(self) -> FallbackOptions:
        """The temperature-fallback options (:class:`~rayspec.decoding.fallback.FallbackOptions`)."""
        return FallbackOptions(tuple(self.temperatures), self.best_of, self.compression_ratio_threshold,
                               self.log_prob_threshold, self.no_speech_threshold, self.length_penalty, self.seed)

    @property
    def beam(self) -> BeamOptions:
        """The beam-search options (:class:`~rayspec.decoding.options.BeamOptions`)."""
        return BeamOptions(self.beam_size, self.patience, self.length_penalty)

    @property
    def mode(self) -> str:
        """"exact" when the output is provably the target's greedy output, else "lossy"."""
        from ..methods import METHODS

        return "exact" if METHODS[self.method].exact(self) and not self.short_window_s else "lossy"
