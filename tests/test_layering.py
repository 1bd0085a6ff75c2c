"""The library (rayspec/) never imports Ray; Ray lives in actors/ and jobs/."""

import pkgutil
import subprocess
import sys

import rayspec


def test_no_library_module_imports_ray():
    modules = [m.name for m in pkgutil.walk_packages(rayspec.__path__, "rayspec.") if ".zoo" not in m.name]
    code = ("import importlib, sys\n"
            f"for m in {modules!r}:\n"
            "    importlib.import_module(m)\n"
            "loaded = sorted(m for m in sys.modules if m == 'ray' or m.startswith('ray.'))\n"
            "assert not loaded, loaded\n")
    subprocess.run([sys.executable, "-c", code], check=True)
