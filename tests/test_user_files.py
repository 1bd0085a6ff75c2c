"""What a reader sees names nothing only the project's own machines have: no ``../shared`` folder, no machine paths,
no words of the team's process ("this wave"), and every "see X" in a ``--help`` text names something that exists.

The user-facing files: the README, changelog and citation, the site (``docs/``, ``mkdocs.yml`` and the bench files
its pages include), ``examples/``, and the code whose docstrings and help texts users read (``rayspec/``, its model
cards, ``actors/``, ``jobs/``).
"""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TEXT_SUFFIXES = {".md", ".py", ".yml", ".yaml", ".sh", ".txt", ".html", ".css", ".cff", ".json", ".toml"}
FORBIDDEN = {
    "the ../shared folder (a reader does not have it; name the public source: docs/data.md)": r"\.\./shared\b",
    "a path of the project's own machines": r"/work/(?:main|shared|wt)\b|/root/|rayspec-cpu\.lock|/tmp/(?:gpu|lj\d+)\b",
    "a working note ($OUT is a device call's output folder)": r"\$OUT\b|\bsession (?:that built|lent)\b",
    "a word of the team's process": r"\b(?:this|that|next|last|previous|earlier|later)\s+wave\b|\bwave's\b",
}


def _walk(top: str) -> list[Path]:
    base = ROOT / top
    if base.is_file():
        return [base]
    return sorted(p for p in base.rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES
                  and "__pycache__" not in p.parts)


def _included_bench_files() -> list[Path]:
    """The bench files the site's pages include inline (``--8<-- "bench/..."``)."""
    found = set()
    for page in _walk("docs"):
        if page.suffix == ".md":
            found.update(re.findall(r'--8<-- "(bench/[^"<>]+)"', page.read_text(encoding="utf-8")))
    return [ROOT / p for p in sorted(found) if (ROOT / p).is_file()]


def user_files() -> list[Path]:
    files = []
    for top in ("README.md", "CHANGELOG.md", "CITATION.cff", "mkdocs.yml", "docs", "examples", "rayspec", "actors",
                "jobs"):
        if (ROOT / top).exists():
            files += _walk(top)
    return files + _included_bench_files()


def test_user_files_name_nothing_of_our_machines_or_process():
    problems = []
    for path in user_files():
        for lineno, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            for what, pattern in FORBIDDEN.items():
                if re.search(pattern, line, flags=re.I):
                    problems.append(f"{path.relative_to(ROOT)}:{lineno}: {what}: {line.strip()[:100]}")
    assert not problems, "\n".join(problems)


def test_the_check_catches_what_it_is_for():
    caught = ["python -m jobs.transcribe ../shared/data/an4/test.jsonl", "flock /tmp/rayspec-cpu.lock rayspec",
              "tables under $OUT/gpu", "before this wave's engine", "/work/main/.venv/bin/python"]
    passed = ["the wave file", "a waveform", "shared storage", "/tmp/an4.parquet", "the voice session"]
    assert all(any(re.search(p, s, flags=re.I) for p in FORBIDDEN.values()) for s in caught)
    assert not any(re.search(p, s, flags=re.I) for p in FORBIDDEN.values() for s in passed)
    assert _broken_references("the README's medusa benchmark") and _broken_references("see the README).")
    assert _broken_references("see docs/benchmarks/nothing.md") == ["docs/benchmarks/nothing.md"]
    assert not _broken_references("see docs/benchmarks/medusa.md, the README's quick start, bench/cli.py")


def _help_texts() -> list[str]:
    """Every description, epilog and option help of ``rayspec``'s parser, its subcommands and the Ray jobs'."""
    import argparse
    import importlib

    from rayspec.cli import build_parser

    todo = [build_parser()] + [importlib.import_module(f"jobs.{name}").build_parser()
                               for name in ("transcribe", "transcribe_data", "synthesize", "scaling", "ray_bench", "ray_e2e")]
    texts = []
    while todo:
        parser = todo.pop()
        texts += [parser.description or "", parser.epilog or ""]
        for action in parser._actions:
            texts.append(action.help or "")
            if isinstance(action, argparse._SubParsersAction):
                todo += list(action.choices.values())
    return [" ".join(t.split()) for t in texts if t]


def _readme_headings() -> list[str]:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    return [h.strip().lower() for h in re.findall(r"^##+\s+(.*)$", text, flags=re.M)]


def _broken_references(text: str) -> list[str]:
    """The references of ``text`` that point nowhere: a repository file (``docs/...md``, ``scripts/...``) that does
    not exist, a README section its headings lack, or the README as a whole (it is a short front page now: name the
    docs page instead)."""
    bad = [path for path in re.findall(r"\b((?:docs|bench|scripts|examples|rayspec|actors|jobs)/[\w./-]*\w)", text)
           if "." in path.rsplit("/", 1)[-1] and not any((base / path).exists() for base in (ROOT, ROOT / "rayspec"))]
    for ref in re.findall(r"README(?:'s ([\w -]+?)(?= section| table| benchmark|[),;.]))?", text):
        if not ref:
            bad.append("the README as a whole")
        elif not any(ref.lower() in h for h in _readme_headings()):
            bad.append(f"the README's {ref!r} (no such section)")
    return bad


def test_help_references_name_pages_that_exist():
    """Every "see X" of a --help text names a page, file or README section that exists."""
    bad = []
    for text in _help_texts():
        for ref in re.findall(r"\bsee ([^;)]+)", text, flags=re.I):
            bad += [f"{problem}: ...see {ref[:80]}" for problem in _broken_references(ref)]
    assert not bad, "\n".join(bad)


def test_docstrings_point_at_files_and_sections_that_exist():
    bad = []
    for path in user_files():
        if path.suffix == ".py":
            text = " ".join(path.read_text(encoding="utf-8").split())
            bad += [f"{path.relative_to(ROOT)}: {problem}" for problem in _broken_references(text)]
    assert not bad, "\n".join(bad)
