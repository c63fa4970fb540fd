"""The library is read by learners: small, in small modules, apart from the machinery (issue 12).

Three packages: ``gaccum_lib`` (the subject), ``gaccum_check`` (the verifier of your loop) and
``gaccum_course`` (figures, explorers, exercises, the lesson map). Dependencies point one way:
course -> check -> lib.
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("gaccum_lib", "gaccum_check", "gaccum_course")
LIBRARY_BUDGET = 3300  # lines, all of gaccum_lib's Python files together (2323 before lesson 10's three modules, 680)
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
    allowed = {"gaccum_lib": {"gaccum_lib"}, "gaccum_check": {"gaccum_lib", "gaccum_check"},
               "gaccum_course": set(PACKAGES)}
    wrong = sorted((m, d) for m, deps in _graph().items() for d in deps
                   if d.split(".")[0] not in allowed[m.split(".")[0]])
    assert wrong == []
    # and the check itself sees such an edge: gaccum_course.widgets imports gaccum_lib.simulate
    assert "gaccum_lib.simulate" in _graph()["gaccum_course.widgets"]


def test_every_module_is_short_enough_to_read():
    lengths = {p.relative_to(ROOT).as_posix(): len(p.read_text().splitlines()) for p in _modules().values()}
    assert {name: n for name, n in lengths.items() if n > MODULE_CAP} == {}
    assert lengths["gaccum_lib/launch.py"] <= LAUNCH_CAP


def test_the_library_fits_its_budget():
    total = sum(len(p.read_text().splitlines()) for p in (ROOT / "gaccum_lib").rglob("*.py"))
    assert 1000 < total <= LIBRARY_BUDGET  # the lower bound: the files were found at all
