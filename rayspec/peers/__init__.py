"""Peer engines for ``rayspec bench --suite peers``: each engine runs in its own process (its own Python
environment for vLLM) and reports the same JSON, so start-up and peak memory are measured per engine."""
