"""`pip install rayspec` without extras transcribes: with every package of the feature extras hidden (as if not
installed), the transcription path (the CLI, scoring, the Ray job's and Serve's modules) runs and every module imports
(optional packages are imported where their feature runs); a feature that needs an extra says which, in one line."""

import os
import subprocess
import sys
from importlib import metadata

import pytest

from rayspec.extras import MissingExtra, require

FEATURE_EXTRAS = ("tts", "chat", "peers", "train", "plot", "espeak", "media")
"""Extras of features beyond transcription (``models`` holds weights; ``docs`` and ``test`` are tooling)."""
ROOT = os.path.join(os.path.dirname(__file__), "..")


def optional_modules() -> set[str]:
    """Top-level import names of the installed distributions that the feature extras list in pyproject.toml."""
    tomllib = pytest.importorskip("tomllib")
    from packaging.requirements import Requirement

    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        extras = tomllib.load(f)["project"]["optional-dependencies"]
    names = {Requirement(r).name for e in FEATURE_EXTRAS for r in extras.get(e, ()) if Requirement(r).name != "rayspec"}
    canon = {n.lower().replace("_", "-") for n in names}
    return {module for module, dists in metadata.packages_distributions().items()
            if any(d.lower().replace("_", "-") in canon for d in dists)}


HIDE = """
import sys
HIDDEN = set(sys.argv[1].split(","))


class Hidden:
    # an import finder that finds none of HIDDEN: for importlib and transformers' checks, they are not installed
    def __init__(self, finder):
        self.finder = finder

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in HIDDEN or not hasattr(self.finder, "find_spec"):
            return None
        return self.finder.find_spec(name, path, target)

    def __getattr__(self, attr):
        return getattr(self.finder, attr)


sys.meta_path[:] = [Hidden(f) for f in sys.meta_path]
"""


def _run_hidden(code: str, *args: str) -> subprocess.CompletedProcess:
    hidden = optional_modules()
    assert {"onnxruntime", "pocketsphinx", "gguf", "accelerate", "ai_edge_litert", "gruut_lang_en", "pycrfsuite",
            "inflect", "tiktoken"} <= hidden
    return subprocess.run([sys.executable, "-c", HIDE + code, ",".join(sorted(hidden)), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)


def test_transcription_runs_without_any_feature_extra(tmp_path, samples_manifest, tiny_target):
    code = """
import rayspec, rayspec.pipeline, rayspec.cli, rayspec.results
from rayspec.cli import main

manifest, out, target = sys.argv[2:5]
assert main(["transcribe", manifest, "-o", out, "--target", target, "--max-tokens-per-second", "4", "-q"]) == 0
assert main(["score", out]) == 0
import actors.serve_app
actors.serve_app.build_app({"target": target})
loaded = sorted(m for m in sys.modules if m.partition(".")[0] in HIDDEN)
assert not loaded, loaded

import importlib, pkgutil, actors, jobs
for package in (rayspec, actors, jobs):
    for module in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
        if ".zoo" not in module.name:
            importlib.import_module(module.name)
loaded = sorted(m for m in sys.modules if m.partition(".")[0] in HIDDEN)
assert not loaded, loaded
"""
    run = _run_hidden(code, samples_manifest, str(tmp_path / "out.parquet"), tiny_target.model.name_or_path)
    assert run.returncode == 0, run.stderr[-3000:]


def test_a_missing_extra_is_a_one_line_error(tmp_path):
    texts = tmp_path / "texts.txt"
    texts.write_text("Hello there.\n")
    code = """
from rayspec.cli import main

raise SystemExit(main(["synthesize", sys.argv[2], "-o", sys.argv[3], "-q"]))
"""
    run = _run_hidden(code, str(texts), str(tmp_path / "tts"))
    assert run.returncode == 2, run.stderr[-3000:]
    assert run.stderr.count("\n") == 1 and "needs the tts extra: pip install 'rayspec[tts]'" in run.stderr


def test_require_names_the_extra(tmp_path, monkeypatch):
    with pytest.raises(MissingExtra, match=r"the widget needs the tts extra: pip install 'rayspec\[tts\]'"):
        require("rayspec_no_such_module.sub", "tts", "the widget")
    (tmp_path / "rayspec_probe.py").write_text("import rayspec_no_such_dependency\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ModuleNotFoundError) as broken:  # installed, but it misses a module: not an extra's fault
        require("rayspec_probe", "tts", "the widget")
    assert not isinstance(broken.value, MissingExtra) and broken.value.name == "rayspec_no_such_dependency"
    assert require("json", "tts", "the widget").dumps([]) == "[]"
