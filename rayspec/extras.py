"""Optional packages: each feature beyond transcription imports its packages where it runs, through :func:`require`,
so ``pip install rayspec`` (transcription, Ray jobs, Serve, Parquet) needs none of them, and a missing one is a
one-line error naming the pip extra that brings it (the CLI prints :class:`MissingExtra` as such, exit status 2).

| extra | packages | features |
|---|---|---|
| ``tts`` | ai-edge-litert, gruut-lang-en, python-crfsuite, inflect, onnxruntime, pocketsphinx, the Piper voice | speech synthesis (``rayspec synthesize``, ``serve --tts``), its G2P, codec and judge |
| ``chat`` | ``tts`` + gguf, accelerate | voice chat's GGUF LLM (``rayspec chat``, ``serve --chat``) |
| ``train`` | onnx | Piper's durations for ``rayspec train tts-data`` |
| ``peers`` | faster-whisper, ctranslate2, tiktoken | ``rayspec bench --suite peers`` (the engines and the stock Whisper models) |
"""

from __future__ import annotations

import importlib


class MissingExtra(ModuleNotFoundError):
    """A package of a pip extra that the chosen feature needs is not installed (a user error, not a bug)."""


def extra_hint(extra: str, feature: str) -> str:
    """``"<feature> needs the <extra> extra: pip install 'rayspec[<extra>]'"``."""
    return f"{feature} needs the {extra} extra: pip install 'rayspec[{extra}]'"


def require(module: str, extra: str, feature: str):
    """Import ``module``, a package of the pip extra ``extra`` that ``feature`` (words for the user) needs.

    Returns:
        The module.

    Raises:
        MissingExtra: ``module`` (or its top-level package) is not installed; its message is :func:`extra_hint`.
        A module missing deeper inside an installed package is re-raised as it is (a broken install, not an extra).
    """
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        if not e.name or not (module + ".").startswith(e.name + "."):
            raise
        raise MissingExtra(extra_hint(extra, feature), name=e.name) from e
