"""Headless Chromium for the browser tests (the chat page, the documentation site offline)."""

import os
import shutil

import pytest


def chromium() -> str:
    """A Chromium for a page test: $RAYSPEC_CHROMIUM or one on PATH (Debian's package: apt-get install chromium);
    skips the test if there is none. CI sets RAYSPEC_REQUIRE_BROWSER=1, so a missing browser fails there instead of
    skipping."""
    required = os.environ.get("RAYSPEC_REQUIRE_BROWSER") == "1"
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        if required:
            raise
        pytest.skip("playwright is not installed (pip install 'rayspec[test]')")
    exe = os.environ.get("RAYSPEC_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        assert not required, "RAYSPEC_REQUIRE_BROWSER=1 but no Chromium on PATH"
        pytest.skip("no Chromium installed (apt-get install chromium)")
    return exe
