"""Command-line options shared by ``rayspec`` (cli.py, bench/cli.py), the Ray jobs (``jobs/``) and the Serve app.

Every decoding option and its default is defined once here (:func:`add_decode_args`); :func:`decode_options` turns
parsed arguments into :class:`~rayspec.decoding.options.DecodeOptions`, and :func:`decode_options_from` does the same for a
plain mapping (Serve's ``build_app`` arguments), so a method means the same thing everywhere.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from .batching import BatchBudget, budget_for_model
from .compute import COMPUTE_TYPES, DTYPE_NAMES, ComputeType, default_name, dtype_of, resolve

if TYPE_CHECKING:  # the CLI and a Ray job's driver parse their options without torch
    import torch

EXIT_USAGE = 2
EXIT_SOME_FAILED = 3


def add_model_args(p: argparse.ArgumentParser, target: str | None = None) -> None:
    """``--target``, its drafters and the device / compute-type flags; ``target``: the default model (None: the
    registry's :data:`~rayspec.models.registry.DEFAULT_TARGET`)."""
    g = p.add_argument_group("models")
    from .models.registry import DEFAULT_TARGET, model_names

    target = target or DEFAULT_TARGET
    g.add_argument("--target", default=target,
                   help=f"target model: {' or '.join(model_names())} (installed with rayspec[models]), a transformers "
                        "Whisper directory (save_pretrained, e.g. openai/whisper-large-v3) or a CTranslate2 / "
                        f"faster-whisper directory (converted once, cached); default {target}")
    g.add_argument("--draft", help="draft model directory for --method draft: a Whisper model with the target's "
                   "tokenizer, or a decoder-only one (WhisperForCausalLM, distil-whisper style) of the target's "
                   "width that reads the target's encoder; default: the drafter bundled for the target, if any")
    g.add_argument("--device", default="cpu", help="torch device (cpu, cuda, cuda:1); default cpu")
    g.add_argument("--compute-type", "--dtype", dest="compute_type", choices=COMPUTE_TYPES, default=default_name(),
                   help="the type the model computes in. auto (default): the fastest the hardware runs natively, "
                        "printed at start and written to each row's compute_type: float16 on a GPU, bfloat16 on a "
                        "CPU with AMX-BF16 or AVX-512 BF16 (whisper-base on a 2-core Xeon with AMX: 1.8x float32's "
                        "speed, WER 3.38%% vs 3.32%%), int8 on another x86 CPU with AVX2 (linear layers in int8, "
                        "the output projection in float16 weights), float32 elsewhere. float32 is the exact reference "
                        "(the transcripts of earlier releases); every exact method equals ar at any type. Default: "
                        "$RAYSPEC_COMPUTE_TYPE if set, else auto")
    g.add_argument("--encoder-dtype", choices=sorted(DTYPE_NAMES), default=None,
                   help="run the encoder in this dtype, its states cast back to --compute-type for the decoder "
                        "(e.g. --compute-type float32 --encoder-dtype bfloat16: a bfloat16 encoder with a float32 "
                        "decoder); every method stays exact against ar at the same setting. Default: --compute-type")
    g.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch's default)")


def add_decode_args(p: argparse.ArgumentParser) -> None:
    from .decoding.options import (CPU_SPECULATE_MAX_ROWS, DEFAULT_MAX_BATCH, MEL_PADDINGS, METHOD_SUMMARIES,
                                   STATIC_STEP_MODES, SpeculationOptions, SSDOptions)

    g = p.add_argument_group("decoding")
    g.add_argument("--method", choices=[AUTO_METHOD, *sorted(METHOD_SUMMARIES)], default=AUTO_METHOD,
                   help=" ".join(f"{name}: {summary}." for name, summary in METHOD_SUMMARIES.items()) +
                   f" {AUTO_METHOD} (default): ctc-draft where the target has a CTC head (bundled for whisper-base, or "
                   "given with --ctc) and the speech is English (--language en, --task transcribe), else ar: ar's "
                   "transcripts in fewer target passes where a head drafts (in float32 and bfloat16 alike)")
    g.add_argument("--speculate-max-rows", type=_max_rows, default="auto", metavar="ROWS",
                   help="speculative methods verify drafts only in decoder rounds with at most ROWS live rows; larger "
                        "rounds are plain target steps (as vLLM's disable_by_batch_size; exact methods' transcripts are "
                        "the same either way). 'all': speculate at any batch size. Default auto: each round speculates where "
                        "its measured cost per emitted token (drafting, verification, scoring, host time) is lower "
                        "than a plain step's, and a row that has not speculated yet starts only where its expected "
                        "remaining tokens pay back the start (lossy acceptance and SSD's verification pass: "
                        f"{CPU_SPECULATE_MAX_ROWS} rows on a CPU)")
    g.add_argument("--max-tokens-per-second", type=float, default=30.0,
                   help="cap on generated tokens per second of audio, against runaway repetition (default 30)")
    g.add_argument("--language", default="en",
                   help="language code of the decoder prompt for multilingual models (en, fr, de, ...), or auto: "
                        "detected per segment from one decoder pass, as Whisper does (default en; English-only "
                        "models take en or auto)")
    g.add_argument("--task", choices=["transcribe", "translate"], default="transcribe",
                   help="transcribe, or translate into English (multilingual models; default transcribe)")
    g.add_argument("--no-speech-threshold", type=float, default=0.6,
                   help="drop a segment whose <|nospeech|> probability in the target's first pass exceeds this "
                        "(route no_speech; openai/whisper's no_speech_threshold without its average-log-probability "
                        "condition; default 0.6, 1 keeps everything)")
    g.add_argument("--compression-ratio-threshold", type=float, default=2.4,
                   help="flag rows whose text's zlib compression ratio exceeds this (column repetitive: text that "
                        "repeats itself, a likely hallucination; the text is kept). Default 2.4, as Whisper")
    g.add_argument("--mel-padding", choices=MEL_PADDINGS, default="silence",
                   help="how a 30 s Whisper window's log-mel features continue after a shorter clip: silence (the "
                        "default; transformers' feature extractor) or zeros (openai/whisper's transcribe() and "
                        "faster-whisper: the features they decode). The transcripts differ; every method stays exact "
                        "against ar at either")
    g.add_argument("--short-window", type=float, default=0.0, metavar="SECONDS",
                   help="lossy speed-up for short clips: cut the encoder's 30 s window to each batch's longest clip "
                        "+ 2 s, at least SECONDS (whisper.cpp's audio_ctx, chosen per batch). whisper-base: 10 kept "
                        "LJSpeech's WER at 2.6x the speed but hurt 2-5 s clips; 20 gave 1.6x at a small cost (see "
                        "docs/benchmarks/whisper.md). Turns the no-speech gate off. Default 0: the full window, the "
                        "exact reference")
    g.add_argument("--temperature", default="0", type=_temperatures, metavar="T[,T...]",
                   help="sampling temperature(s). One value: 0 decodes greedily (the default), above 0 samples with "
                        "--seed (every exact method samples the same tokens at any batch size). Several, e.g. "
                        "0,0.2,0.4,0.6,0.8,1.0 (openai/whisper's and faster-whisper's default): temperature fallback, "
                        "a row whose text repeats itself (--compression-ratio-threshold) or whose average "
                        "log-probability is below --log-prob-threshold is decoded again at the next temperature, "
                        "--best-of samples kept the likeliest; the row's temperature column says which was used (with "
                        "--long-form sequential, window by window as openai/whisper's transcribe does)")
    g.add_argument("--beam-size", type=int, default=1,
                   help="beam search with this many beams (openai/whisper's and faster-whisper's beam_size; 5 is "
                        "their default) at temperature 0; 1: greedy (default). Tokens equal openai/whisper's beam "
                        "search on the same weights. Every method then returns the beam search's hypotheses "
                        "(ctc-draft speculates under it, exactly, where --speculate-max-rows allows all the beams: not by "
                        "default on a CPU, where it measured 0.81x plain beam search)")
    g.add_argument("--patience", type=float, default=1.0,
                   help="beam search stops once beam-size x patience finished candidates are held (default 1.0)")
    g.add_argument("--length-penalty", type=float, default=None,
                   help="rank finished beams (and fallback samples) by log-probability / ((5 + length) / 6) ** "
                        "PENALTY instead of / length (default: / length, as Whisper)")
    g.add_argument("--best-of", type=int, default=5,
                   help="samples per row at a fallback temperature above 0; the likeliest is kept (default 5)")
    g.add_argument("--log-prob-threshold", type=float, default=-1.0,
                   help="with temperature fallback, decode a row again when its average log-probability is below "
                        "this (default -1.0, as Whisper)")
    g.add_argument("--seed", type=int, default=0,
                   help="seed of sampled rows; mixed with each file's id and segment, so a file's text does not "
                        "depend on its neighbours, the batch size or the method (default 0)")
    g.add_argument("--initial-prompt", metavar="TEXT",
                   help="text the decoder reads before each segment, as openai/whisper's prompt and "
                        "faster-whisper's initial_prompt: names, spellings, punctuation style (default none)")
    g.add_argument("--prefix", metavar="TEXT",
                   help="text each file's transcript starts with (faster-whisper's prefix: decoding goes on after "
                        "it, and the text includes it; not with --method ssd or timestamps)")
    g.add_argument("--hotwords", metavar="WORDS",
                   help="words made likelier by putting them before each segment (faster-whisper's hotwords)")
    d = SpeculationOptions()
    g.add_argument("--draft-max", type=int, default=d.max_draft,
                   help=f"longest draft per round (SpecASR IV.A; default {d.max_draft}; SpecASR used 24)")
    g.add_argument("--draft-threshold", type=float, default=d.threshold,
                   help="adaptive drafting stops at the first draft token whose probability is below this "
                        f"(SpecASR IV.A; default {d.threshold}; 0 = fixed length --draft-max)")
    g.add_argument("--draft-vocabulary", action=argparse.BooleanOptionalAction, default=d.vocabulary,
                   help="read the draft out over its own vocabulary, the tokens of its training transcripts, where "
                        "its config lists one (FR-Spec: most of the output projection skipped; the output is the "
                        "target's either way; default on)")
    g.add_argument("--recycle", action=argparse.BooleanOptionalAction, default=d.recycle,
                   help=f"draft sequence recycling (SpecASR IV.B; default {'on' if d.recycle else 'off'})")
    g.add_argument("--tree", action=argparse.BooleanOptionalAction, default=d.tree,
                   help="the two-pass sparse token tree (SpecASR IV.C; default "
                        f"{'on' if d.tree else 'off: on a CPU its second drafting pass costs more than it saves'})")
    g.add_argument("--tree-threshold", type=float, default=d.tree_threshold,
                   help="trunk positions whose top-1 probability is below this get a 2nd-best branch "
                        f"(default {d.tree_threshold})")
    g.add_argument("--tree-branches", type=int, default=d.tree_branches,
                   help=f"most branches per token tree (default {d.tree_branches})")
    c, s = p.add_argument_group("ssd (CTC gating, verification, fallback)"), SSDOptions()
    c.add_argument("--ctc", help="CTC head directory; default: the CTC head bundled for the target, if any")
    c.add_argument("--tau-ctc", type=float, default=s.tau_ctc,
                   help="accept the CTC hypothesis with no target pass if every frame's entropy (nats) is below "
                        f"this; 0 = gate off (default {s.tau_ctc}: calibrated for whisper-base's bundled head on "
                        "its dev split, see its card; calibrate your own head with the table in its training summary)")
    c.add_argument("--tau-slm", type=float, default=s.tau_slm,
                   help="verification accepts a token whose target probability exceeds this "
                        f"(default {s.tau_slm}; with --fallback ctc every round is verified this way; not read "
                        "with --exact)")
    c.add_argument("--exact", action=argparse.BooleanOptionalAction, default=s.exact,
                   help="verify by the target's argmax instead (greedy acceptance; --tau-slm is not read): with "
                        f"--tau-ctc 0 the output then equals ar (default {'on' if s.exact else 'off'})")
    c.add_argument("--fallback", choices=["ar", "draft", "ctc"], default=s.fallback,
                   help="decoder after the verified prefix: ctc (default): the rest of the CTC hypothesis "
                        "re-aligned after each correction and verified as the first pass was (--tau-slm, --exact) "
                        "every round; greedy ar (the paper's: one target pass per token after the prefix); or "
                        "draft-model speculation")
    m = p.add_argument_group("medusa (heads on the target's hidden state)")
    m.add_argument("--medusa", help="Medusa heads directory; default: the heads bundled for the target, if any")
    m.add_argument("--acceptance", choices=["greedy", "typical"], default="greedy",
                   help="greedy: output identical to ar; typical: Medusa's typical acceptance (lossy, faster)")
    m.add_argument("--typical-epsilon", type=float, default=0.09,
                   help="typical acceptance keeps tokens with probability > min(epsilon, delta * exp(-entropy))")
    m.add_argument("--typical-delta", type=float, default=0.3, help="see --typical-epsilon")
    e = p.add_argument_group("device (GPU) engine")
    e.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=True,
                   help="on a CUDA device, run decoder steps at static shapes (KV slots, batch and query-length "
                        "buckets) captured as CUDA graphs when the model loads (default on; the tokens are the same "
                        "either way). --no-cuda-graphs: dynamic steps, as on a CPU")
    e.add_argument("--max-graph-batch", type=int, default=DEFAULT_MAX_BATCH, metavar="ROWS",
                   help="largest batch bucket with static steps and graphs (1, 2, 4, ... up to ROWS; larger batches "
                        "run dynamically; default 64)")
    e.add_argument("--static-steps", choices=STATIC_STEP_MODES, default="auto",
                   help="static-shape decoder steps: auto (on CUDA with --cuda-graphs), on (any device, e.g. to test "
                        "them on a CPU, where they are slower), off (default auto)")
    b = p.add_argument_group("batching")
    b.add_argument("--batch-tokens", type=int, default=BatchBudget.tokens,
                   help="token budget per batch: rows x (padded encoder positions + expected tokens); a stock "
                        "Whisper's row holds its whole 30 s window, 1,500 positions (whisper-base: ~15 rows, about "
                        f"40 MB of decoder cache each, computed); default {BatchBudget.tokens}")
    b.add_argument("--max-batch", type=int, default=BatchBudget.max_rows,
                   help=f"most utterances per batch (default {BatchBudget.max_rows})")
    b.add_argument("--no-continuous", action="store_true",
                   help="decode the planned batches one after another. By default (in-process runs; ctc-draft "
                        "always runs batch by batch, measured faster) a finished row's slot is refilled from the next "
                        "batch before the next decoder pass (continuous batching; same output; ssd pools the rows "
                        "that fail verification across batches)")
    b.add_argument("--max-audio-seconds", type=float, default=None,
                   help="reject longer files (default 14400 = 4 h). Files longer than the model's window (30 s) are "
                        "cut in pauses, decoded as segments and re-joined")
    a = p.add_argument_group("audio")
    a.add_argument("--no-vad", action="store_true",
                   help="decode every file, even without speech (default: silence and noise give empty text, "
                        "route no_speech, with no decoder pass)")
    a.add_argument("--segments", action="store_true",
                   help="fill the 'segments' column: start_s, end_s and text of each decoded segment")
    a.add_argument("--timestamps", choices=["none", "segment", "word"], default="none",
                   help="segment: decode with Whisper's timestamp tokens (every method stays exact against ar under "
                        "Whisper's timestamp rules) and fill 'segments' with the timed segments; word: also 'words' "
                        "(word, start_s, end_s, probability) from the alignment heads' cross-attention (openai/whisper's "
                        "method, one extra target pass per batch). Default none")
    a.add_argument("--refine-words", action=argparse.BooleanOptionalAction, default=True,
                   help="with --timestamps word, move a word start that falls in non-speech forward to the word's "
                        "first speech frame (frame energy within 15 dB of the loudest; default on; --no-refine-words "
                        "keeps openai/whisper's recipe alone)")
    a.add_argument("--long-form", choices=["vad", "sequential"], default="vad",
                   help="files longer than the model's 30 s window: vad cuts them in pauses and decodes the pieces "
                        "independently (default); sequential is Whisper's own algorithm: 30 s windows, each starting "
                        "where the previous one's last complete segment ended, all files' windows in one continuous "
                        "batch (timed segments; not with --method ssd)")
    a.add_argument("--condition-on-previous-text", action=argparse.BooleanOptionalAction, default=True,
                   help="with --long-form sequential, prompt each window with the text decoded before it, as "
                        "Whisper does (default on)")


def _temperatures(value) -> str:
    """``--temperature``: comma-separated temperatures >= 0, increasing (kept as text; see :func:`temperatures`)."""
    try:
        temperatures(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return str(value)


def temperatures(value) -> tuple[float, ...]:
    """``--temperature`` as a tuple of floats: "0,0.2,0.4" -> (0.0, 0.2, 0.4); a number or a sequence as it is.

    Raises:
        ValueError: an empty or malformed list, a negative temperature, or temperatures not increasing.
    """
    from .decoding.fallback import FallbackOptions

    if isinstance(value, (int, float)):
        items = [float(value)]
    elif isinstance(value, str):
        try:
            items = [float(x) for x in value.replace(" ", "").split(",") if x]
        except ValueError:
            raise ValueError(f"expected temperatures like 0 or 0,0.2,0.4,0.6,0.8,1.0, got {value!r}") from None
    else:
        items = [float(x) for x in value]
    return FallbackOptions(tuple(items)).temperatures


def _max_rows(value: str) -> str:
    """``--speculate-max-rows``: "auto", "all" or a positive row count (kept as text; see :func:`max_rows_value`)."""
    if value not in ("auto", "all") and not (value.isdigit() and int(value) > 0):
        raise argparse.ArgumentTypeError(f"expected auto, all or a positive number of rows, got {value!r}")
    return value


def max_rows_value(value: str):
    """``--speculate-max-rows`` as :attr:`~rayspec.decoding.options.DecodeOptions.speculate_max_rows`: None (auto), 0 (all)
    or the row count.

    Raises:
        ValueError: anything else.
    """
    try:
        value = _max_rows(str(value).strip().lower())
    except argparse.ArgumentTypeError as exc:
        raise ValueError(f"speculate_max_rows: {exc}") from None
    return None if value == "auto" else 0 if value == "all" else int(value)


def speculation_options(args):
    from .decoding.options import SpeculationOptions

    return SpeculationOptions(
        max_draft=args.draft_max, threshold=args.draft_threshold, recycle=args.recycle,
        vocabulary=args.draft_vocabulary, tree=args.tree, tree_threshold=args.tree_threshold,
        tree_branches=args.tree_branches,
    )


AUTO_METHOD = "auto"
"""``--method``'s default: :func:`resolve_method` picks the method where the target is known."""


def resolve_method(method: str, target: Optional[str], ctc: Optional[str] = None, language: str = "en",
                   task: str = "transcribe") -> str:
    """The method ``--method`` names: ``method`` itself, except :data:`AUTO_METHOD`, which is ``ctc-draft`` where the
    target has a CTC head (``ctc``, a head's directory, or one bundled for ``target``, a registry name; see
    :data:`~rayspec.models.registry.DRAFTERS`) and the speech is English transcription (the bundled head drafts
    English tokens), else ``ar``. ``ctc-draft`` is exact (``ar``'s transcripts in fewer target passes, the speculation
    rule deciding each round whether drafts pay), in float32 and in bfloat16 (see ``WhisperASR.batch_invariant``).
    With no target named (None) auto is ``ar``."""
    if method != AUTO_METHOD:
        return method
    from .models.registry import DRAFTERS

    has_head = bool(ctc) or "ctc" in DRAFTERS.get(target or "", {})
    return "ctc-draft" if has_head and language == "en" and task == "transcribe" else "ar"


def decode_options(args, target: Optional[str] = None):
    """:class:`~rayspec.decoding.options.DecodeOptions` from parsed CLI arguments; ``--method auto`` resolved for
    ``target`` (default: ``args.target`` where the parser has model flags; :func:`resolve_method`)."""
    from .decoding.options import DecodeOptions, MedusaOptions, SSDOptions

    method = resolve_method(args.method, target or getattr(args, "target", None), args.ctc, args.language, args.task)
    ssd = SSDOptions(args.tau_ctc, args.tau_slm, args.exact, True, args.fallback, speculation_options(args))
    medusa = MedusaOptions(args.medusa, args.acceptance, args.typical_epsilon, args.typical_delta)
    return DecodeOptions(method, args.max_tokens_per_second,
                         speculation_options(args) if method == "draft" else None,
                         ssd if method == "ssd" else None, medusa if method == "medusa" else None,
                         vad=not args.no_vad, segments=args.segments, timestamps=args.timestamps,
                         refine_words=args.refine_words, long_form=args.long_form, condition_on_previous_text=args.condition_on_previous_text,
                         language=args.language, task=args.task,
                         no_speech_threshold=args.no_speech_threshold,
                         compression_ratio_threshold=args.compression_ratio_threshold,
                         mel_padding=args.mel_padding, short_window_s=args.short_window,
                         speculate_max_rows=max_rows_value(args.speculate_max_rows),
                         static_steps=args.static_steps, cuda_graphs=args.cuda_graphs,
                         max_graph_batch=args.max_graph_batch, temperatures=temperatures(args.temperature),
                         best_of=args.best_of, log_prob_threshold=args.log_prob_threshold, seed=args.seed,
                         initial_prompt=args.initial_prompt, hotwords=args.hotwords, beam_size=args.beam_size,
                         patience=args.patience, length_penalty=args.length_penalty, prefix=args.prefix)


@dataclass(frozen=True)
class TranscriberSpec:
    """Everything that builds a :class:`~rayspec.pipeline.Transcriber`, parsed once from the command line
    (:func:`transcriber_spec`) and handed down typed: to this process, or to Ray actors that build their own.

    Attributes:
        target, draft, ctc: model names or directories (None: the drafters bundled for the target).
        device: torch device; compute_type: ``--compute-type`` as given (``auto`` is resolved where the model loads:
            each actor on its own node); encoder_dtype: ``--encoder-dtype`` or None.
        options: the decoding options; limits: audio limits (None: the defaults); threads: torch CPU threads (0:
            torch's default).
    """

    target: Optional[str]
    draft: Optional[str]
    ctc: Optional[str]
    device: str
    compute_type: str
    options: object  # DecodeOptions (imported lazily: the CLI starts without the pipeline)
    encoder_dtype: Optional[torch.dtype] = None
    limits: Optional[object] = None  # AudioLimits
    threads: int = 0

    def kwargs(self, device: Optional[str] = None) -> dict:
        """:class:`~rayspec.pipeline.Transcriber`'s keyword arguments, on ``device`` if given; the compute type is
        passed unresolved (the Transcriber resolves ``auto`` where it loads)."""
        return {"target": self.target, "draft": self.draft, "ctc": self.ctc, "options": self.options,
                "device": device or self.device, "dtype": self.compute_type, "limits": self.limits,
                "encoder_dtype": self.encoder_dtype}


def transcriber_spec(args) -> TranscriberSpec:
    """The :class:`TranscriberSpec` of parsed ``rayspec transcribe`` / ``python -m jobs.transcribe`` arguments.

    Raises:
        ValueError: decoding options that do not go together (see :class:`~rayspec.decoding.options.DecodeOptions`).
    """
    return TranscriberSpec(args.target, args.draft, args.ctc, args.device, args.compute_type, decode_options(args),
                           encoder_dtype(args), limits_from_args(args), args.threads)


def build_transcriber(args, announce: bool = False):
    """A :class:`~rayspec.pipeline.Transcriber` from parsed CLI arguments; ``announce``: print the compute type
    chosen (:func:`compute_type`) and, for ``--method auto``, the method."""
    import torch

    from .pipeline import Transcriber

    spec = transcriber_spec(args)
    if announce and args.method == AUTO_METHOD:
        why = ("the target's CTC head drafts, the target verifies" if spec.options.method == "ctc-draft" else
               "no CTC head drafts for this target or language")
        print(f"rayspec: method {spec.options.method} (auto: {why})", file=sys.stderr)
    if spec.threads:
        torch.set_num_threads(spec.threads)
    return Transcriber(**dict(spec.kwargs(), dtype=compute_type(args, announce=announce).name))


def compute_type(args, device: Optional[str] = None, announce: bool = False) -> ComputeType:
    """``--compute-type`` resolved on ``device`` (default ``--device``); ``announce``: print the choice to stderr
    in one line (``rayspec: compute type bfloat16 (auto: this CPU has AMX-BF16)``).

    Raises:
        ValueError: an unknown compute type.
    """
    chosen = resolve(args.compute_type, device or args.device)
    if announce:
        print(f"rayspec: compute type {chosen.name} ({chosen.reason})", file=sys.stderr)
    return chosen


def encoder_dtype(args):
    """``--encoder-dtype`` as a torch dtype, or None (the encoder runs in ``--dtype``)."""
    return dtype_of(args.encoder_dtype) if getattr(args, "encoder_dtype", None) else None


def limits_from_args(args):
    """:class:`~rayspec.audio.AudioLimits` from ``--max-audio-seconds``, or None for the defaults."""
    from .audio import AudioLimits

    return AudioLimits(max_seconds=args.max_audio_seconds) if args.max_audio_seconds else None


def budget_from_args(args, config):
    """The batch budget of ``--batch-tokens`` / ``--max-batch`` for the target whose transformers ``config`` is
    given (its encoder geometry: :func:`~rayspec.batching.budget_for_model`)."""
    return budget_for_model(BatchBudget(tokens=args.batch_tokens, max_rows=args.max_batch), config)


def print_summary(summary, output: str) -> None:
    for uid, err in summary.failures[:20]:
        print(f"  failed {uid}: {err}", file=sys.stderr)
    startup = f" after {summary.startup_s:.1f} s of start-up" if summary.startup_s else ""
    print(f"{summary.written} utterances written ({summary.skipped} already done), {summary.failed} failed, "
          f"{summary.audio_s:.1f} s of audio in {summary.wall_s:.1f} s{startup} (RTFx {summary.rtfx:.1f}) -> {output}")


def user_errors() -> tuple:
    """Exceptions that are the user's input, not a bug: reported in one line with exit status 2."""
    from .manifest import ManifestError
    from .models.errors import ModelLoadError
    from .results import OutputLockedError
    from .tts.codec import CodecError
    from .tts.phones import TextError

    # ModuleNotFoundError: an optional package a chosen feature needs (each such import names the pip command)
    return ManifestError, ModelLoadError, OutputLockedError, FileNotFoundError, CodecError, TextError, \
        ModuleNotFoundError


def run_command(func, args, prog: str = "rayspec") -> int:
    """Run ``func(args)``; a :func:`user_errors` exception prints ``<prog>: error: <message>`` and returns 2."""
    try:
        return func(args)
    except user_errors() as exc:
        message = exc.args[0] if isinstance(exc, FileNotFoundError) and exc.args else exc
        print(f"{prog}: error: {message}", file=sys.stderr)
        return EXIT_USAGE


def _decode_defaults() -> argparse.Namespace:
    """The decoding flags at their defaults."""
    parser = argparse.ArgumentParser(add_help=False)
    add_decode_args(parser)
    return parser.parse_args([])


def decode_option_names() -> set[str]:
    """The option names :func:`decode_options_from` takes (the CLI's decoding flags, with underscores)."""
    return set(vars(_decode_defaults()))


def decode_options_from(values: dict, target: Optional[str] = None):
    """:class:`~rayspec.decoding.options.DecodeOptions` from a mapping of option names (``method``, ``tau_ctc``, ...; see
    :func:`decode_option_names`), every other option at the CLI's default. Strings are converted to the option's
    type (environment variables arrive as strings; "1"/"true"/"yes"/"on" are true). ``method`` auto (the default)
    is resolved for ``target`` (:func:`resolve_method`; None: ``ar``).

    Raises:
        ValueError: an option name the CLI does not have, or a value of the wrong type.
    """
    args = _decode_defaults()
    unknown = set(values) - set(vars(args))
    if unknown:
        raise ValueError(f"unknown decoding options {sorted(unknown)}; see rayspec transcribe --help")
    for key, value in values.items():
        default = getattr(args, key)
        if key == "temperature" and not isinstance(value, str):  # a number or a sequence of numbers
            value = ",".join(str(float(v)) for v in (value if isinstance(value, (list, tuple)) else [value]))
        if key == "length_penalty" and value is not None:
            value = float(value)
        if isinstance(default, bool) and isinstance(value, str):
            value = value.strip().lower() in ("1", "true", "yes", "on")
        elif default is not None and value is not None:
            value = type(default)(value)
        setattr(args, key, value)
    return decode_options(args, target)
