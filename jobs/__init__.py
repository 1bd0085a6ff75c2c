"""Entrypoints for ``ray job submit --working-dir . -- python -m jobs.<name>``."""
