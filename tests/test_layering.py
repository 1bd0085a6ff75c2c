"""The library (rayspec/) never imports Ray; Ray lives in actors/ and jobs/; no import cycles; a Ray job's driver
imports no torch."""

import os
import pkgutil
import subprocess
import sys

import rayspec

ROOT = os.path.join(os.path.dirname(__file__), "..")


def test_no_library_module_imports_ray():
    modules = [m.name for m in pkgutil.walk_packages(rayspec.__path__, "rayspec.") if ".zoo" not in m.name]
    code = ("import importlib, sys\n"
            f"for m in {modules!r}:\n"
            "    importlib.import_module(m)\n"
            "loaded = sorted(m for m in sys.modules if m == 'ray' or m.startswith('ray.'))\n"
            "assert not loaded, loaded\n")
    subprocess.run([sys.executable, "-c", code], check=True)


def _imports(path, module, top_level_only):
    """Modules of the rayspec package that ``module`` (its source at ``path``) imports."""
    import ast

    tree = ast.parse(open(path).read())
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    if top_level_only:  # module level, including ``if TYPE_CHECKING:`` blocks
        nodes = [n for top in nodes for n in (ast.walk(top) if isinstance(top, ast.If) else [top])]
    package = module.rsplit(".", 1)[0] if not path.endswith("__init__.py") else module
    out = set()
    for n in nodes:
        if isinstance(n, ast.ImportFrom):
            base = n.module or ""
            if n.level:
                parts = package.split(".")[: len(package.split(".")) - n.level + 1]
                base = ".".join(parts + ([base] if base else []))
            if base.startswith("rayspec"):
                out.add(base)
                out.update(f"{base}.{a.name}" for a in n.names)
        elif isinstance(n, ast.Import):
            out.update(a.name for a in n.names if a.name.startswith("rayspec"))
    return out


def test_module_level_imports_form_no_cycle():
    """Data flows one way through the library: no two modules import each other at module level (lazy imports
    inside functions aside), and methods.py (the method registry) never imports pipeline.py at all."""
    infos = [m for m in pkgutil.walk_packages(rayspec.__path__, "rayspec.") if ".zoo" not in m.name]
    paths = {m.name: m.module_finder.find_spec(m.name).origin for m in infos}
    graph = {name: _imports(path, name, True) & set(paths) for name, path in paths.items()}
    seen, done = set(), set()

    def visit(node, stack):
        seen.add(node)
        for nxt in graph[node]:
            assert nxt not in stack, f"import cycle: {' -> '.join(stack[stack.index(nxt):] + [nxt])}"
            if nxt not in done:
                visit(nxt, stack + [nxt])
        done.add(node)

    for name in graph:
        if name not in done:
            visit(name, [name])
    assert "rayspec.pipeline" not in _imports(paths["rayspec.methods"], "rayspec.methods", False)


def test_the_ray_job_driver_plans_without_torch():
    # the driver parses and checks the options, reads the manifest and the model's config and plans the batches; torch
    # (2 s) and transformers (1.5 s) load in the actors only
    code = """
import sys
from jobs.transcribe import build_parser
from rayspec.models.registry import read_config, resolve_model
from rayspec.options import budget_from_args, transcriber_spec
for argv in ([], ["--method", "ssd", "--beam-size", "5", "--temperature", "0,0.4"], ["--method", "medusa"]):
    args = build_parser().parse_args(argv)
    spec = transcriber_spec(args)
    budget = budget_from_args(args, read_config(resolve_model("whisper-base")))
heavy = sorted(m for m in ("torch", "transformers", "pandas") if m in sys.modules)
assert not heavy, heavy
"""
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]

