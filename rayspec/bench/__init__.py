"""``rayspec bench``: one module per suite, all writing through :func:`rayspec.bench.tables.write_table`.

* :mod:`.asr`: spec, medusa, ssd (speculative ASR methods against AR, NFE and wall clock side by side)
* :mod:`.whisper`: real Whisper on rayspec's engine against transformers and CTranslate2
* :mod:`.peers`: rayspec against faster-whisper, CTranslate2, transformers and vLLM
* :mod:`.tts`: speculative speech synthesis
* :mod:`.voicechat`: PredGen against the plain cascade
* :mod:`.timestamps`: word times against true boundaries (:mod:`.timestamps_data`: the Piper set, long recordings),
  the cost of timestamps per method, long-form decoding, beside faster-whisper
* :mod:`.cli`: the arguments and the dispatch (a suite's module is imported only when it runs)
"""
