"""Speech synthesis: phones, the Lyra codec, forced alignment and speculative speech-token decoding."""
