"""The synthesis flags and the options they make, in a module without PyTorch: the command line builds its parser
from them without importing the TTS models (``rayspec transcribe`` does not pay for them at start-up)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

METHODS = ("target", "sd", "ssd", "pcg")
# draft tokens per round when not given, chosen on 30 dev sentences of the teacher data (scripts/tts_dev_defaults.py):
# pcg at theta 0.8 emitted 4.1 frames per target pass with 5 against 3.2 with 3 (batch 1: 1.82x against 1.57x
# target-only); sd, which rejects more, keeps the PCG paper's 3
DEFAULT_LOOKAHEAD = {"target": 0, "sd": 3, "ssd": 3, "pcg": 5}
# the speaking rate when not given (phone durations scale by 1 / speed; 1 = the teacher's pace) and the temperature
# (SamplingOptions), chosen on 100 dev sentences of the teacher data x 3 seeds (scripts/tts_dev_defaults.py --sweep,
# bench/tts-dev/sweep.md): pcg read 19.0% Whisper WER at rate 1 / temperature 0.6, 17.0% at 1 / 0.45 and 16.5% at
# 0.85 / 0.45 (0.6 points, within the seeds' noise, for 18% more frames), so the rate stays the teacher's
DEFAULT_SPEED = 1.0


@dataclass(frozen=True)
class SamplingOptions:
    """How speech tokens are sampled.

    Attributes:
        method: "target" (target-only sampling), "sd" (exact speculative sampling), "ssd" (relaxed by ``beta``) or
            "pcg" (group-level acceptance over similarity groups at ``theta``).
        temperature: softmax temperature of target and draft (> 0; the default: see :data:`DEFAULT_SPEED`'s note).
        lookahead: draft tokens per round (the paper's gamma; PCG paper: 3); None: the method's default
            (:data:`DEFAULT_LOOKAHEAD`: 5 for pcg, 3 for sd and ssd).
        beta: ``ssd``'s additive relaxation.
        theta: ``pcg``'s cosine threshold for the groups (> 1 makes every group one token: ``sd``).
        groups: ``pcg``'s token vectors: "codec" (the Lyra latent each coarse token stands for) or "target" (the
            target's input embeddings, as the PCG paper).
    """

    method: str = "pcg"
    temperature: float = 0.45
    lookahead: Optional[int] = None
    beta: float = 0.3
    theta: float = 0.8
    groups: str = "codec"

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"unknown sampling method {self.method!r}; choose from {', '.join(METHODS)}")
        if self.temperature <= 0:
            raise ValueError("temperature must be > 0")
        if self.lookahead is None:
            object.__setattr__(self, "lookahead", DEFAULT_LOOKAHEAD[self.method])
        if self.lookahead < 0 or (self.method != "target" and self.lookahead == 0):
            raise ValueError("lookahead must be >= 1 for speculative methods")
        if self.groups not in ("codec", "target"):
            raise ValueError("groups must be 'codec' or 'target'")


AUDIO_FORMATS = {"wav": ("WAV", "PCM_16"), "flac": ("FLAC", "PCM_16"), "opus": ("OGG", "OPUS"),
                 "mp3": ("MP3", "MPEG_LAYER_III")}


def add_synthesis_args(p) -> None:
    """The synthesis flags shared by ``rayspec synthesize``, ``jobs.synthesize`` and ``rayspec serve-tts``."""
    g = p.add_argument_group("models")
    g.add_argument("--tts-target", help="TTS target directory (default: the bundled zoo tts-target)")
    g.add_argument("--tts-draft", help="TTS draft directory (default: the bundled zoo tts-draft)")
    g.add_argument("--codec", help="Lyra v2 codec directory (default: the bundled one)")
    s = p.add_argument_group("sampling")
    s.add_argument("--method", choices=["target", "sd", "ssd", "pcg"], default="pcg",
                   help="target: target-only sampling (the baseline); sd: speculative sampling, exact in "
                        "distribution; ssd: relaxed by --beta (lossy); pcg: group-level acceptance over acoustic "
                        "similarity groups at --theta (exact per group; default)")
    s.add_argument("--temperature", type=float, default=SamplingOptions.temperature,
                   help=f"sampling temperature (default {SamplingOptions.temperature:g}, chosen for pcg on dev "
                        "sentences: bench/tts-dev/sweep.md)")
    s.add_argument("--lookahead", type=int, default=None,
                   help="draft tokens per round (default: 5 for pcg, 3 for sd and ssd)")
    s.add_argument("--beta", type=float, default=0.3, help="ssd: acceptance relaxation (default 0.3)")
    s.add_argument("--theta", type=float, default=SamplingOptions.theta,
                   help=f"pcg: cosine threshold of the groups (default {SamplingOptions.theta})")
    s.add_argument("--groups", choices=["codec", "target"], default="codec",
                   help="pcg: group tokens by the Lyra latents they stand for (default) or the target's embeddings")
    s.add_argument("--seed", type=int, default=0, help="base seed; with the row id it fixes each row's audio")
    s.add_argument("--speed", type=float, default=DEFAULT_SPEED,
                   help=f"speaking rate 0.25..4 (default {DEFAULT_SPEED:g}, the teacher voice's pace)")
    s.add_argument("--batch-size", type=int, default=16, help="sentences per target batch (default 16)")
    s.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default: rayspec synthesize all cores but one, which the vocoder thread "
                        "uses; jobs.synthesize's actors their --actor-cpus)")


def sampling_from_args(args) -> SamplingOptions:
    """:class:`SamplingOptions` from ``rayspec synthesize``'s parsed arguments."""
    return SamplingOptions(method=args.method, temperature=args.temperature, lookahead=args.lookahead,
                           beta=args.beta, theta=args.theta, groups=args.groups)
