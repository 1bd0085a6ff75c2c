"""Model adapters (Ray-free): :class:`~rayspec.models.whisper.WhisperASR` over the Whisper family and its ragged KV
cache (:mod:`rayspec.models.cache`), the drafters (CTC head, Medusa heads) and the model registry
(:mod:`rayspec.models.registry`). The package imports nothing itself, so the registry loads without torch."""
