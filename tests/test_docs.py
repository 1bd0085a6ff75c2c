"""The documentation: the site builds with `mkdocs build --strict`, and the README's figures are the bench files'.

Every figure in README.md outside code is a link to the bench file it comes from, titled with where in that file:
``[1.57x](bench/peers-real/bench-peers.md "faster-whisper 1.2.1; 1 @ rayspec / engine")`` reads "in a table of that
file, the row whose cells include ``faster-whisper 1.2.1`` and ``1``, in the column headed ``rayspec / engine``". The
test finds exactly that cell and compares it with the link's text, so a row added to the headline table is checked as
soon as its numbers are links.
"""

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
LINK = re.compile(r'\[([^\]]*)\]\(([^)\s]+)(?:\s+"([^"]*)")?\)')
FIGURE = re.compile(r"(?<![\w.])\d+(?:[.,]\d+)?\s?(?:x|%|ms|s|GB|GiB|MB)(?![\w/])")  # a speed-up, a rate, a time
LABEL_COLUMNS = 2  # the headline table's first columns name the row (device, batch); every other figure is a link


def _readme() -> str:
    with open(README, encoding="utf-8") as f:
        return f.read()


def _prose(text: str) -> str:
    """The text outside fenced code blocks and HTML comments."""
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    return re.sub(r"<!--.*?-->", "", text, flags=re.S)


def _cells(line: str) -> list[str]:
    line = line.strip().replace("\\|", "\0")
    return [c.strip().replace("\0", "|") for c in line.strip("|").split("|")]


def _tables(text: str) -> list[list[list[str]]]:
    """Markdown tables of ``text``: each a list of rows (the header first), each row its cells."""
    tables, rows = [], []
    for line in text.splitlines() + [""]:
        if line.lstrip().startswith("|"):
            if not re.fullmatch(r"\|?\s*:?-+:?\s*(\|\s*:?-+:?\s*)*\|?", line.strip()):
                rows.append(_cells(line))
        elif rows:
            tables.append(rows)
            rows = []
    return tables


def _plain(cell: str) -> str:
    return cell.replace("**", "").replace("`", "").strip()


def _bench_value(path: str, where: str) -> str:
    """The cell ``where`` ("KEY; KEY @ COLUMN") names in the bench file at ``path`` (relative to the repository)."""
    keys, sep, column = where.rpartition(" @ ")
    assert sep, f"{path}: link title {where!r} is not 'ROW KEY; ROW KEY @ COLUMN'"
    keys = [k.strip() for k in keys.split(";") if k.strip()]
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        tables = _tables(f.read())
    found = []
    for table in tables:
        header = [_plain(c) for c in table[0]]
        if column not in header:
            continue
        assert header.count(column) == 1, f"{path}: a table has {header.count(column)} columns headed {column!r}"
        for row in table[1:]:
            plain = [_plain(c) for c in row]
            if all(k in plain for k in keys):
                found.append(plain[header.index(column)])
    assert len(found) == 1, f"{path}: {len(found)} cells match {where!r} (want exactly one)"
    return found[0]


def _checked_links(text: str) -> list[tuple[str, str, str]]:
    return [(label, path, title) for label, path, title in LINK.findall(text) if path.startswith("bench/")]


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """The site, built once for this module's tests with `mkdocs build --strict`."""
    site = tmp_path_factory.mktemp("docs") / "site"
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(site)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, env=dict(os.environ, NO_MKDOCS_2_WARNING="1"))
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return site


def test_site_builds_strict(site):
    """`mkdocs build --strict`: a broken link, a missing include or a bad API reference fails."""
    page = (site / "benchmarks" / "methods.html").read_text(encoding="utf-8")
    assert "<table>" in page and "bench-methods.png" in page
    assert (site / "bench" / "methods" / "bench-methods.png").is_file()  # the plots are served (docs/hooks.py)
    assert "rayspec.pipeline.Transcriber" in (site / "api" / "library.html").read_text(encoding="utf-8")


def test_readme_is_short_and_opens_with_the_two_commands():
    text = _readme()
    assert len(text.splitlines()) < 200
    first_code = re.search(r"```bash\n(.*?)```", text, flags=re.S).group(1)
    setup, tests = [line for line in first_code.splitlines() if line.startswith("python3 -m venv")]
    assert setup.endswith("python -m jobs.transcribe -o results/samples.parquet")
    assert tests.endswith("python -m pytest tests")
    with open(os.path.join(ROOT, ".ci", "run"), encoding="utf-8") as f:
        assert f.read().rstrip().endswith("python -m pytest tests")  # CI runs the README's test command


def test_readme_headline_figures_equal_their_bench_files():
    text = _readme()
    headline = re.search(r"\[start:headline\].*?-->(.*?)<!--.*?\[end:headline\]", text, flags=re.S).group(1)
    (table,) = _tables(headline)
    links = 0
    for row in table[1:]:
        for cell in row[LABEL_COLUMNS:]:
            rest = LINK.sub("", cell)
            assert not re.search(r"\d", rest), f"headline cell {cell!r}: a figure without its bench-file link"
            for label, path, where in _checked_links(cell):
                assert where, f"headline link {label!r} -> {path} names no row and column (its title)"
                assert _plain(label) == _bench_value(path, where), f"{label!r} is not {path}'s {where!r}"
                links += 1
    assert links >= 20


def test_every_readme_figure_is_a_checked_link():
    prose = _prose(_readme())
    for label, path, where in _checked_links(prose):
        if FIGURE.search(label) or re.fullmatch(r"[\d.,/]+", _plain(label)):
            assert where, f"README figure {label!r} -> {path}: the link's title must name its row and column"
            assert _plain(label) == _bench_value(path, where), f"{label!r} is not {path}'s {where!r}"
    unlinked = FIGURE.findall(LINK.sub("", prose))
    assert not unlinked, f"README figures without a bench-file link: {unlinked}"


def test_outputs_page_lists_every_parquet_column():
    from rayspec.results import SCHEMA

    with open(os.path.join(ROOT, "docs", "transcription", "outputs.md"), encoding="utf-8") as f:
        page = f.read()
    missing = [name for name in SCHEMA.names if f"`{name}`" not in page]
    assert not missing, f"docs/transcription/outputs.md does not describe the columns {missing}"


def test_bench_value_finds_exactly_one_cell():
    assert _bench_value("bench/methods/bench-methods.md", "draft; 1 @ NFE/utt") == "6.12"
    with pytest.raises(AssertionError, match="2 cells"):
        _bench_value("bench/methods/bench-methods.md", "draft @ NFE/utt")  # batch 1 and 16


def test_site_reads_from_disk(site):
    """Offline: pages are files (links land on pages, not folder listings), search has its index as a script, and
    no page loads a script or style from the network (mermaid is bundled)."""
    page = (site / "architecture.html").read_text(encoding="utf-8")
    assert 'href="getting-started.html"' in (site / "index.html").read_text(encoding="utf-8")
    assert (site / "search" / "search_index.js").is_file()  # MkDocs Material's offline plugin
    assert (site / "javascripts" / "mermaid.min.js").is_file() and (site / "javascripts" / "LICENSE.mermaid").is_file()
    for html in (site / "architecture.html", site / "index.html", site / "ray" / "index.html"):
        text = html.read_text(encoding="utf-8")
        remote = re.findall(r'<(?:script|link)[^>]+(?:src|href)="(https?:[^"]+)"', text)
        assert not remote, f"{html.name} loads {remote}"
    assert 'class="mermaid"' in page


def test_architecture_diagrams_render_offline_in_chromium(site):
    """Headless Chromium opens the built architecture page from disk with every network request refused, finds each
    mermaid diagram drawn as SVG (not left as its `flowchart` source), and gets search results."""
    from browser import chromium

    exe = chromium()  # skips the test where there is no browser (CI has one)
    from playwright.sync_api import sync_playwright

    page_file = site / "architecture.html"
    diagrams = page_file.read_text(encoding="utf-8").count('class="mermaid"')
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=exe, headless=True, args=[
            "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking"])
        try:
            page = browser.new_page()
            page.route("**/*", lambda route: route.continue_() if route.request.url.startswith("file:")
                       else route.abort())
            # Material draws each diagram into a closed shadow root: open them so the test can look inside
            page.add_init_script("const attach = Element.prototype.attachShadow; Element.prototype.attachShadow = "
                                 "function (init) { return attach.call(this, {...init, mode: 'open'}); };")
            page.goto(page_file.as_uri())
            drawn = "[...document.querySelectorAll('div.mermaid')].filter(d => d.shadowRoot && " \
                    "d.shadowRoot.querySelector('svg')).length"
            page.wait_for_function(f"{drawn} >= {diagrams}", timeout=60000)
            source_left = page.evaluate("[...document.querySelectorAll('pre.mermaid, .mermaid code')]"
                                        ".map(e => e.textContent).join(' ')")
            page.fill("input.md-search__input", "speculative")  # search runs from disk too
            page.wait_for_function("document.querySelectorAll('.md-search-result__item').length > 0", timeout=30000)
        finally:
            browser.close()
    assert diagrams >= 2 and "flowchart" not in source_left
