"""Screenshots of two rendered pages of the documentation site (home, the methods benchmark) in headless Chromium.

    python scripts/docs_screenshots.py [--chromium /usr/bin/chromium] [-o docs/images]

Builds the site into a temporary folder, serves it on a loopback port and drives Debian's ``chromium`` (``apt-get
install chromium``) with ``--headless --screenshot``; writes ``screenshot-home.png`` and ``screenshot-benchmark.png``.
"""

import argparse
import functools
import http.server
import os
import subprocess
import sys
import tempfile
import threading

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = {"screenshot-home.png": "", "screenshot-benchmark.png": "benchmarks/methods.html"}
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
         "--disable-sync", "--no-first-run", "--hide-scrollbars", "--window-size=1440,1000"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--chromium", default="/usr/bin/chromium")
    p.add_argument("-o", "--output", default=os.path.join(ROOT, "docs", "images"))
    args = p.parse_args(argv)
    os.makedirs(args.output, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        site = os.path.join(tmp, "site")
        # not --strict: the screenshots this script makes are themselves images of the site
        subprocess.run([sys.executable, "-m", "mkdocs", "build", "-q", "-d", site], cwd=ROOT, check=True,
                       env=dict(os.environ, NO_MKDOCS_2_WARNING="1"))
        handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=site)
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        try:
            for name, page in PAGES.items():
                out = os.path.join(args.output, name)
                url = f"http://127.0.0.1:{server.server_address[1]}/{page}"
                subprocess.run([args.chromium, *FLAGS, f"--user-data-dir={tmp}/profile", f"--screenshot={out}", url],
                               check=True, capture_output=True, timeout=120)
                print(f"{url} -> {out}")
        finally:
            server.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
