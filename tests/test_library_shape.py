"""The library is read by learners: small, in small modules, apart from the machinery.

Four packages: ``gaccum_lib`` (the subject), ``gaccum_launch`` (real processes from a notebook:
machinery, kept apart), ``gaccum_check`` (the verifier of your loop) and ``gaccum_course``
(figures, explorers, exercises, the lesson map). Dependencies point one way:
course -> check -> lib -> launch. Importing any of them changes nothing outside it.
"""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("gaccum_lib", "gaccum_launch", "gaccum_check", "gaccum_course")
LIBRARY_BUDGET = 2500  # lines, all of gaccum_lib's Python files together: what a learner opens
MODULE_CAP = 400
LAUNCH_CAP = 300


def _modules():
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            name = ".".join(path.with_suffix("").relative_to(ROOT).parts).removesuffix(".__init__")
            found[name] = path
    return found


def _imports(name: str, path: Path) -> set[str]:
    """Every module ``name`` imports, relative or absolute, function-level imports too (they close circles too)."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level:
            parts = package.split(".")
            target = ".".join(parts[:len(parts) - node.level + 1] + ([node.module] if node.module else []))
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in PACKAGES:
            target = node.module
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.split(".")[0] in PACKAGES}
            continue
        else:
            continue
        found |= {target} | {f"{target}.{alias.name}" for alias in node.names}
    return found


def _graph():
    modules = _modules()
    return {m: {d for d in _imports(m, p) if d in modules and d != m} for m, p in modules.items()}


def test_no_import_circle_in_the_three_packages():
    # A package's __init__ re-exports its modules on purpose (its public API): edges into it are fine,
    # circles through modules are the trouble.
    graph = {m: {d for d in deps if d not in PACKAGES} for m, deps in _graph().items() if m not in PACKAGES}
    circles, done = [], set()

    def visit(module, path):
        if module in path:
            circles.append(path[path.index(module):] + [module])
            return
        if module in done:
            return
        for dependency in sorted(graph.get(module, ())):
            visit(dependency, path + [module])
        done.add(module)

    for module in sorted(graph):
        visit(module, [])
    assert circles == []


def test_the_library_imports_neither_the_checker_nor_the_course():
    allowed = {"gaccum_launch": {"gaccum_launch"}, "gaccum_lib": {"gaccum_lib", "gaccum_launch"},
               "gaccum_check": {"gaccum_lib", "gaccum_launch", "gaccum_check"}, "gaccum_course": set(PACKAGES)}
    wrong = sorted((m, d) for m, deps in _graph().items() for d in deps
                   if d.split(".")[0] not in allowed[m.split(".")[0]])
    assert wrong == []
    # and the check itself sees such an edge: gaccum_course.widgets imports gaccum_lib.simulate
    assert "gaccum_lib.simulate" in _graph()["gaccum_course.widgets"]


def test_every_module_is_short_enough_to_read():
    lengths = {p.relative_to(ROOT).as_posix(): len(p.read_text().splitlines()) for p in _modules().values()}
    assert {name: n for name, n in lengths.items() if n > MODULE_CAP} == {}
    assert lengths["gaccum_launch/processes.py"] <= LAUNCH_CAP


def test_the_library_fits_its_budget():
    total = sum(len(p.read_text().splitlines()) for p in (ROOT / "gaccum_lib").rglob("*.py"))
    assert 1000 < total <= LIBRARY_BUDGET  # the lower bound: the files were found at all


# Reaching into other libraries, or changing the importing process, is what the packages must not do:
# private Matplotlib internals, CPU pinning, a frozen garbage collector, bytecode guessing, DeepSpeed's
# private op table.
FORBIDDEN = ("FT2Font._layout", "_render_glyph", "_update_ticks", "_get_ticklabel_bboxes", "_autotitlepos",
             "_twinned_axes", "_major_tick_kw", "legend._loc", "_lastKey", "sched_setaffinity", "gc.freeze",
             "co_names", "__compatible_ops__", "_prctl_pr_set_pdeathsig")


def test_no_package_reaches_into_private_internals():
    found = sorted((path.relative_to(ROOT).as_posix(), name) for path in _modules().values()
                   for name in FORBIDDEN if name in path.read_text())
    assert found == []


IMPORT_AND_REPORT = """
import gc, os, sys, torch
threads, cpus = torch.get_num_threads(), os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
import gaccum_lib, gaccum_launch, gaccum_check, gaccum_course, gaccum_course.widgets
after = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
print(gc.get_freeze_count(), gc.isenabled(), torch.get_num_threads() == threads, after == cpus)
"""


@pytest.mark.slow
def test_importing_the_packages_changes_nothing_outside_them():
    result = subprocess.run([sys.executable, "-c", IMPORT_AND_REPORT], cwd=ROOT, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == ["0", "True", "True", "True"]
