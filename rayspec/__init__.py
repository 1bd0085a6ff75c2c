"""rayspec: batch speech recognition with exact, batched speculative decoding.

The package is Ray-free: ``rayspec.audio``, ``rayspec.manifest``, ``rayspec.models``, ``rayspec.decoding``,
``rayspec.batching``, ``rayspec.results``, ``rayspec.metrics`` and ``rayspec.train`` import and run without a Ray
cluster. The Ray layer lives in the top-level ``actors`` and ``jobs`` packages.
"""

__version__ = "0.1.0"


def load(*args, **kwargs):
    """``rayspec.load("whisper-base", method="draft")``: a model to ``transcribe`` files or arrays with, from Python
    (:func:`rayspec.api.load`; imported on first use, so ``import rayspec`` stays light)."""
    from .api import load as _load

    return _load(*args, **kwargs)
