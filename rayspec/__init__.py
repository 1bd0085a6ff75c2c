"""rayspec: batch speech recognition with exact, batched speculative decoding.

The package is Ray-free: ``rayspec.audio``, ``rayspec.manifest``, ``rayspec.models``, ``rayspec.decoding``,
``rayspec.batching``, ``rayspec.results``, ``rayspec.metrics`` and ``rayspec.train`` import and run without a Ray
cluster. The Ray layer lives in the top-level ``actors`` and ``jobs`` packages.
"""

__version__ = "0.1.0"
