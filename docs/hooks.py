"""MkDocs hook: serve the repository's ``bench/`` folder (tables, CSVs, plots) as part of the site.

The benchmark pages include their tables from ``bench/`` (pymdownx.snippets) and show its plots; MkDocs only serves
files under ``docs/``, so every file under ``bench/`` is added to the build as ``bench/<path>`` (no copy is kept in
the repository). A page links them relative to itself, e.g. ``../bench/methods/bench-methods.png`` from
``docs/benchmarks/``. The mirrored Markdown files are rendered as pages of their own (not in the navigation).
"""

from pathlib import Path

from mkdocs.structure.files import File, InclusionLevel

ROOT = Path(__file__).resolve().parent.parent
MIRRORED = ("bench",)


def on_files(files, config):
    for top in MIRRORED:
        for path in sorted((ROOT / top).rglob("*")):
            if path.is_file() and not path.name.startswith("."):
                uri = path.relative_to(ROOT).as_posix()
                if files.get_file_from_path(uri) is None:
                    files.append(File.generated(config, uri, abs_src_path=str(path),
                                                inclusion=InclusionLevel.NOT_IN_NAV))
    return files


# -- mkdocstrings: the docstrings' Sphinx roles -------------------------------------------------------------------
import re  # noqa: E402

import griffe  # noqa: E402

ROLE = re.compile(r":(?:class|meth|func|attr|data|mod|exc|obj):`(~?)([^`]+)`")


def _role_as_code(match: re.Match) -> str:
    tilde, target = match.groups()
    return f"`{target.rsplit('.', 1)[-1] if tilde else target}`"


class SphinxRoles(griffe.Extension):
    """Render the docstrings' Sphinx cross-reference roles (``:class:`~rayspec.pipeline.Transcriber```) as inline
    code (``Transcriber``; with ``~`` the last component), as Sphinx shows them; the Google-style sections are
    mkdocstrings' own."""

    def on_instance(self, *, obj, **kwargs) -> None:
        if obj.docstring is not None:
            obj.docstring.value = ROLE.sub(_role_as_code, obj.docstring.value)
