"""Audio through FFmpeg: clips re-encoded in the formats users have (phone m4a, browser webm, mp4 video, mp3, stereo
44.1 kHz m4a), transcribed beside the originals; libsndfile's and FFmpeg's decoding speed; the memory of a long file.

    python -m rayspec.bench.media ljspeech/clips.jsonl --skip 200 --clips 20 -o bench/media

Needs the media extra (PyAV: ``pip install 'rayspec[media]'``), which also encodes the clips (:func:`encode`, used by
the tests too). Writes ``<output>/bench-media.md``: per format, failures and WER against the same clips as read from
the manifest; decoding seconds per format and decoder; with ``--long-minutes``, the peak RSS of ``rayspec transcribe``
on a 1-minute and a long m4a made by looping the clips.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

FORMATS = {
    # name: (suffix, container, codec, rate in Hz or None for the clip's own, channels, with a video track,
    #        bit rate in bit/s or None for the encoder's default)
    "m4a": (".m4a", "ipod", "aac", None, 1, False, None),
    "webm": (".webm", "webm", "libopus", 48000, 1, False, None),
    "mp4-video": (".mp4", "mp4", "aac", None, 1, True, None),
    "mp3": (".mp3", "mp3", "libmp3lame", None, 1, False, 64_000),  # lame's default at 22 kHz is 24 kbit/s
    "m4a-stereo-44k": (".m4a", "ipod", "aac", 44100, 2, False, None),
}
"""The formats :func:`encode` writes, as phones (m4a/AAC), browsers (MediaRecorder's webm/Opus), cameras and screen
recorders (mp4 with a video track) and podcasts (mp3) make them."""


def encode(samples: np.ndarray, rate: int, kind: str, video: bool | None = None) -> bytes:
    """Encode a waveform as one of :data:`FORMATS` with PyAV (FFmpeg's encoders at their default bit rates).

    Args:
        samples: float32 mono waveform ``[num_samples]`` in [-1, 1]; rate: its rate in Hz (resampled by the encoder
            where the format has its own); kind: a key of :data:`FORMATS`; video: override the format's video track
            (False: an mp4 with audio only; True on an ``mp4``: a 64x64 black video beside it).

    Returns:
        The encoded file's bytes.

    Raises:
        ImportError: PyAV is not installed (``pip install 'rayspec[media]'``).
    """
    import av

    _, container, codec, out_rate, channels, with_video, bit_rate = FORMATS[kind]
    with_video = with_video if video is None else video
    buf = io.BytesIO()
    if out_rate and out_rate != rate:
        import soxr

        samples, rate = soxr.resample(samples.astype(np.float32), rate, out_rate), out_rate
    with av.open(buf, "w", format=container) as out:
        audio = out.add_stream(codec, rate=rate, layout="stereo" if channels == 2 else "mono")
        if bit_rate:
            audio.bit_rate = bit_rate
        picture = out.add_stream("mpeg4", rate=10) if with_video else None  # every stream before the first packet
        if picture is not None:
            picture.width = picture.height = 64
            picture.pix_fmt = "yuv420p"
        planes = np.ascontiguousarray(np.stack([samples.astype(np.float32)] * channels))
        frame = av.AudioFrame.from_ndarray(planes, format="fltp", layout=audio.layout.name)
        frame.sample_rate, frame.pts = rate, 0
        out.mux(audio.encode(frame))
        out.mux(audio.encode(None))
        if picture is not None:
            black = np.zeros((64, 64, 3), np.uint8)
            for k in range(max(1, int(10 * len(samples) / rate))):
                still = av.VideoFrame.from_ndarray(black, format="rgb24")
                still.pts = k
                out.mux(picture.encode(still))
            out.mux(picture.encode(None))
    return buf.getvalue()


def _write_formats(utts, folder: str) -> list[dict]:
    """Every clip as FLAC (the original), WAV and each of :data:`FORMATS` under ``folder``: manifest rows, the
    format as the corpus."""
    import shutil

    import soundfile as sf

    rows = []
    for u in utts:
        samples, rate = sf.read(u.audio, dtype="float32")
        for kind, suffix in [("flac", ".flac"), ("wav", ".wav")] + [(k, f[0]) for k, f in FORMATS.items()]:
            path = os.path.join(folder, kind, u.id + suffix)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            if kind == "flac":
                shutil.copyfile(u.audio, path)
            elif kind == "wav":
                sf.write(path, samples, rate, subtype="PCM_16")
            else:
                with open(path, "wb") as f:
                    f.write(encode(samples, rate, kind))
            rows.append({"id": f"{kind}/{u.id}", "audio": path, "text": u.text, "corpus": kind})
    return rows


def _whole_file(path: str) -> np.ndarray:
    """The decoding this module is measured against: libsndfile reads the whole file, then one down-mix and one
    resampling (soxr HQ) over it (rayspec's path before chunked decoding)."""
    import soundfile as sf
    import soxr

    data, rate = sf.read(path, dtype="float32", always_2d=True)
    return soxr.resample(data.mean(axis=1), rate, 16000, quality="HQ")


def decoding_seconds(paths: list[str], decoders: list[str], repeats: int = 5) -> dict[str, float]:
    """Seconds to decode every file of ``paths`` to 16 kHz mono with each of ``decoders`` (names of
    ``rayspec.audio.DECODERS``, or "whole-file": :func:`_whole_file`): the least of ``repeats`` passes, the decoders
    taking turns (so that a busy moment of the machine does not fall on one decoder's passes only)."""
    from ..audio import load_audio

    best = {d: float("inf") for d in decoders}
    for _ in range(repeats):
        for decoder in decoders:
            t0 = time.perf_counter()
            for p in paths:
                _whole_file(p) if decoder == "whole-file" else load_audio(p, 16000, decoder=decoder)
            best[decoder] = min(best[decoder], time.perf_counter() - t0)
    return best


def long_m4a(utts, minutes: float, path: str, gap_s: float = 0.5) -> None:
    """Write an m4a (AAC, :func:`encode`) of ``minutes`` made by looping the clips of ``utts`` (manifest rows with
    FLAC ``audio``), each followed by ``gap_s`` seconds of silence, at the clips' own rate."""
    import soundfile as sf

    clips = [sf.read(u.audio, dtype="float32") for u in utts]
    rate = clips[0][1]
    gap = np.zeros(int(gap_s * rate), np.float32)
    one = np.concatenate([x for c, _ in clips for x in (c, gap)])
    need = int(minutes * 60 * rate)
    samples = np.tile(one, need // len(one) + 1)[:need]
    del one
    with open(path, "wb") as f:
        f.write(encode(samples, rate, "m4a"))


PEAK = ("import atexit, sys; atexit.register(lambda: print('peak_rss_kib', [line.split()[1] for line in "
        "open('/proc/self/status') if line.startswith('VmHWM:')][0], file=sys.stderr)); ")
"""``python -c`` code printing the process's peak RSS to stderr at exit (then the code it runs): Linux's ``VmHWM``,
this program's own (``ru_maxrss`` would count the parent's memory at the fork too)."""
RUN = {"decode": "from rayspec.audio import load_audio; print(f'{len(load_audio(sys.argv[1])) / 16000:.1f} s decoded')",
       "transcribe": "from rayspec.cli import main; sys.exit(main(['transcribe', *sys.argv[1:]]))"}
"""What a child process runs on a file (its path, then options): decode it to 16 kHz, or ``rayspec transcribe`` it."""


def _peak_rss(step: str, args: list[str]) -> tuple[int, float, str]:
    """Run ``step`` of :data:`RUN` in a child process: its peak RSS in bytes, wall seconds and last output line."""
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", PEAK + RUN[step], *args], capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    peak = [line.split()[1] for line in out.stderr.splitlines() if line.startswith("peak_rss_kib ")]
    if out.returncode or not peak:
        raise RuntimeError(f"{step} {' '.join(args)} failed: {out.stderr.strip()[-2000:]}")
    return int(peak[-1]) * 1024, seconds, (out.stdout.strip().splitlines() or [""])[-1]


def _formats_section(utts, tmp: str, target: str) -> list[str]:
    """Markdown: every format's failures and WER against the originals, then each decoder's speed on them."""
    import shutil

    from ..manifest import read_manifest
    from ..pipeline import Transcriber
    from ..runs import run_corpus
    from ..scoring import score_results

    rows = _write_formats(utts, tmp)
    manifest = os.path.join(tmp, "formats.jsonl")
    with open(manifest, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    out = os.path.join(tmp, "formats.parquet")
    summary = run_corpus(read_manifest(manifest), Transcriber(target), out)
    scores = score_results(out)["corpora"]
    flac = scores["flac"]["wer"]
    lines = ["| format | files | failed | WER % | vs FLAC (points) | bytes (all files) |", "|---|---|---|---|---|---|"]
    for kind in ["flac", "wav", *FORMATS]:
        s, size = scores[kind], sum(os.path.getsize(r["audio"]) for r in rows if r["corpus"] == kind)
        lines.append(f"| {kind} | {s['n']} | {s['errors']} | {100 * s['wer']:.2f} | {100 * (s['wer'] - flac):+.2f} | "
                     f"{size:,} |")
    lines += ["", f"{summary.written} rows, {summary.failed} failed; WER after Whisper's English normalizer.", "",
              "## Decoding seconds (all files of a format to 16 kHz mono, least of 5 passes taken in turns, one run)",
              "",
              "| format | libsndfile, whole file (before) | libsndfile, chunked | chunked / before | PyAV (FFmpeg) "
              "| PyAV / libsndfile | ffmpeg executable |", "|---|---|---|---|---|---|---|"]
    cell = lambda x: "-" if x is None else f"{x:.3f}"  # noqa: E731
    ratio = lambda a, b: "-" if a is None or b is None else f"{a / b:.2f}x"  # noqa: E731
    for kind in ["wav", "flac", "mp3", "m4a", "webm"]:
        paths = [r["audio"] for r in rows if r["corpus"] == kind]
        native = ["whole-file", "libsndfile"] if kind in ("wav", "flac", "mp3") else []
        t = decoding_seconds(paths, native + ["pyav"] + (["ffmpeg"] if shutil.which("ffmpeg") else []))
        before, sf_s, av_s, ff_s = (t.get(d) for d in ("whole-file", "libsndfile", "pyav", "ffmpeg"))
        lines.append(f"| {kind} | {cell(before)} | {cell(sf_s)} | {ratio(sf_s, before)} | {cell(av_s)} | "
                     f"{ratio(av_s, sf_s)} | {cell(ff_s)} |")
    return lines


def _long_section(utts, tmp: str, minutes: float, target: str, threads: int, steps: list[str]) -> list[str]:
    """Markdown: the peak RSS of child processes decoding and transcribing a 1-minute and a ``minutes`` m4a."""
    lines = [f"## Peak RSS of a child process decoding, then transcribing ({target}) one m4a looped from the clips",
             "", "| file | step | peak RSS MiB | wall s | output |", "|---|---|---|---|---|"]
    options = ["--target", target] + (["--threads", str(threads)] if threads else [])
    for length in (1.0, minutes):
        path = os.path.join(tmp, f"long-{length:g}min.m4a")
        long_m4a(utts, length, path)
        for step, extra in [("decode", []), ("transcribe", ["-o", path + ".parquet", "-q", *options])]:
            if step in steps:
                rss, seconds, last = _peak_rss(step, [path, *extra])
                lines.append(f"| {length:g} min | {step} | {rss / 2**20:.0f} | {seconds:.0f} | "
                             f"{last.split(' -> ')[0]} |")
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m rayspec.bench.media", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("manifest", help="manifest of clips with references (their FLACs are the originals)")
    p.add_argument("--skip", type=int, default=0, help="manifest rows skipped first")
    p.add_argument("--clips", type=int, default=20, help="clips used (after --skip)")
    p.add_argument("--target", default="whisper-base", help="model transcribing them (default whisper-base)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--no-formats", action="store_true", help="skip the formats' WER and decoding speed")
    p.add_argument("--long-minutes", type=float, default=0,
                   help="also decode and transcribe an m4a this long and a 1-minute one in child processes, and "
                        "report their peak RSS (0: skip)")
    p.add_argument("--long-target", default="whisper-tiny.en", help="the model of the long-file runs")
    p.add_argument("--long-steps", nargs="+", choices=list(RUN), default=list(RUN), help="what the long-file runs do")
    p.add_argument("-o", "--output", default="bench/media", help="folder of bench-media.md")
    args = p.parse_args(argv)
    import torch

    from ..manifest import read_manifest

    if args.threads:
        torch.set_num_threads(args.threads)
    utts = read_manifest(args.manifest)[args.skip: args.skip + args.clips]
    os.makedirs(args.output, exist_ok=True)
    model = "" if args.no_formats else f", {args.target}"
    lines = [f"# Audio through FFmpeg: {len(utts)} clips ({utts[0].id} .. {utts[-1].id}){model}", ""]
    with tempfile.TemporaryDirectory(prefix="rayspec-media-") as tmp:
        if not args.no_formats:
            lines += _formats_section(utts, tmp, args.target) + [""]
        if args.long_minutes:
            lines += _long_section(utts, tmp, args.long_minutes, args.long_target, args.threads, args.long_steps)
    text = "\n".join(lines) + "\n"
    with open(os.path.join(args.output, "bench-media.md"), "w") as f:
        f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
