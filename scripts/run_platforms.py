"""Every lesson on the software learners really have: `make floors` (several minutes and PyPI; not in `make test`).

    python scripts/run_platforms.py                     # floors, colab, kaggle
    python scripts/run_platforms.py --only colab

For each platform below: a venv of its Python holding what the platform ships (build/platforms/NAME), a
fresh wheel of the suite, and every lesson copied to a folder outside the repository and run under nbmake
in a kernel that Accelerate takes for Colab's (tests/colab/kernel_startup.py; Kaggle's kernel is told by
its KAGGLE_* variable instead). Lesson 00 runs first and alone: its install cell installs the suite from
the wheel, as it would from GitHub on Colab, and the other lessons then find it. Afterwards torch,
accelerate, transformers and ipywidgets must be the versions the platform shipped, and DeepSpeed absent.
The findings go to benchmarks/PLATFORMS.md (generated: the platforms, their versions, each lesson's result).

- floors: the lowest versions pyproject.toml admits, on the lowest Python it admits.
- colab: Colab's published runtime of late 2026.
- kaggle: Kaggle's image is Colab's with ipywidgets 8.1.5, on Python 3.12. Its exact torch, accelerate
  and transformers releases could not be read from here: this stand-in takes Colab's, on Kaggle's Python
  and widgets.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BUILD = ROOT / "build" / "platforms"
REPORT = ROOT / "benchmarks" / "PLATFORMS.md"
KEPT = ("torch", "accelerate", "transformers", "ipywidgets")
RUNNER = ("ipykernel", "nbmake", "pytest", "pytest-xdist")
COLAB = {"torch": "2.11.0", "accelerate": "1.14.0", "transformers": "5.15.0", "ipywidgets": "7.7.1",
         "notebook": "6.5.7", "matplotlib": "3.10.0"}


def floors() -> dict:
    """pyproject.toml's floors as exact versions: `torch>=2.6` is torch 2.6.0."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    found = {}
    for requirement in project["dependencies"]:
        name, version = re.fullmatch(r"([A-Za-z0-9_.-]+)>=([0-9.]+)", requirement.split(";")[0].strip()).groups()
        found[name] = version + ".0" * (2 - version.count("."))
    return found


PLATFORMS = {
    "floors": {"python": tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"][2:],
               "packages": floors(), "kernel": "colab"},
    "colab": {"python": "3.13", "packages": COLAB, "kernel": "colab"},
    "kaggle": {"python": "3.12", "packages": {**COLAB, "ipywidgets": "8.1.5", "notebook": "7.0.6"}, "kernel": "kaggle"},
}


def interpreter(version: str) -> str:
    """pyenv's python<version>, else python<version> on the PATH."""
    root = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv"))
    candidates = sorted(root.glob(f"versions/{version}.*/bin/python"), reverse=True) + [Path(f"python{version}")]
    for candidate in candidates:
        if shutil.which(str(candidate)) and subprocess.run([str(candidate), "-c", ""]).returncode == 0:
            return str(candidate)
    raise SystemExit(f"no Python {version} found (pyenv or PATH): install it to run this platform")


def run(command, **kwargs) -> subprocess.CompletedProcess:
    result = subprocess.run([str(c) for c in command], capture_output=True, text=True, **kwargs)
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(map(str, command[:5]))} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    return result


def clean_env(**extra) -> dict:
    keep = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV", "GACCUM", "DS_"))}
    return {**keep, "PYTHONDONTWRITEBYTECODE": "", **extra}


def versions(python: Path) -> dict:
    script = ("import importlib.metadata as m, json; names = %r\n"
              "def v(n):\n    try: return m.version(n)\n    except m.PackageNotFoundError: return None\n"
              "print(json.dumps({n: v(n) for n in names}))") % (list(KEPT) + ["deepspeed", "gaccum_lib"])
    return json.loads(run([python, "-c", script]).stdout)


def platform_venv(name: str, spec: dict) -> Path:
    venv = BUILD / name
    stamp = venv / ".installed"
    wanted = json.dumps(spec, sort_keys=True)
    if not (stamp.exists() and stamp.read_text() == wanted):
        shutil.rmtree(venv, ignore_errors=True)
        print(f">> {name}: a venv of Python {spec['python']} with {spec['packages']}", flush=True)
        run([interpreter(spec["python"]), "-m", "venv", venv])
        pins = [f"{p}=={v}" for p, v in spec["packages"].items()]
        run([venv / "bin" / "python", "-m", "pip", "install", "--quiet", *pins, *RUNNER], env=clean_env())
        stamp.write_text(wanted)
    return venv / "bin" / "python"


def run_platform(name: str, spec: dict, wheel: Path) -> dict:
    python = platform_venv(name, spec)
    run([python, "-m", "pip", "uninstall", "--quiet", "--yes", "gaccum_lib"], env=clean_env())  # a fresh install
    before = versions(python)
    work = Path(tempfile.mkdtemp(prefix=f"gaccum-{name}-"))
    lessons = work / "lessons"
    shutil.copytree(ROOT / "notebooks", lessons)
    startup = work / "ipython" / "profile_default" / "startup"
    startup.mkdir(parents=True)
    kernel_env = {"GACCUM_SOURCE": str(wheel), "IPYTHONDIR": str(work / "ipython")}
    if spec["kernel"] == "colab":
        shutil.copy(ROOT / "tests" / "colab" / "kernel_startup.py", startup)
    else:
        kernel_env["KAGGLE_KERNEL_RUN_TYPE"] = "Interactive"
    env = clean_env(**kernel_env)
    results = {}
    first, *rest = sorted(lessons.glob("*.ipynb"))
    for group, workers in (([first], []), (rest, ["-n", "2"])):
        start = time.perf_counter()
        outcome = subprocess.run([python, "-m", "pytest", "--nbmake", "--overwrite", "-q", "-p", "no:cacheprovider",
                                  "-rA", *workers, *group], cwd=work, env=env, capture_output=True, text=True)
        print(f">> {name}: {len(group)} lesson(s) in {time.perf_counter() - start:.0f} s", flush=True)
        for path in group:
            passed = re.search(rf"PASSED \S*{re.escape(path.name)}", outcome.stdout) is not None
            results[path.name] = "passed" if passed else "FAILED"
        if outcome.returncode != 0:
            (BUILD / f"{name}-{len(results)}.log").write_text(outcome.stdout + outcome.stderr)
    after = versions(python)
    changed = {p: (before[p], after[p]) for p in KEPT if before[p] != after[p]}
    shutil.rmtree(work, ignore_errors=True)
    return {"python": spec["python"], "shipped": {p: before[p] for p in KEPT}, "lessons": results,
            "changed_by_install": changed, "deepspeed_after": after["deepspeed"], "suite": after["gaccum_lib"]}


def write_report(found: dict) -> str:
    lines = ["# Lessons on learners' platforms", "",
             "Generated by `make floors` (scripts/run_platforms.py); do not edit. Each lesson ran under nbmake in",
             "a kernel Accelerate takes for the platform's, the suite installed by the lessons' own install cell.",
             ""]
    for name, r in found.items():
        passed = sum(v == "passed" for v in r["lessons"].values())
        lines += [f"## {name} ({r.get('date', '')})", "",
                  f"- Python {r['python']}; as shipped: " + ", ".join(f"{p} {v}" for p, v in r["shipped"].items()),
                  f"- lessons passed: {passed} of {len(r['lessons'])}"
                  + ("" if passed == len(r["lessons"]) else "; failed: "
                     + ", ".join(k for k, v in r["lessons"].items() if v != "passed")),
                  "- the install cell changed: " + (", ".join(f"{p} {a} -> {b}" for p, (a, b) in
                                                            r["changed_by_install"].items()) or "none of "
                                                   + ", ".join(KEPT)),
                  f"- DeepSpeed after the install: {r['deepspeed_after'] or 'not installed'}", ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default=",".join(PLATFORMS), help=f"comma-separated subset of {', '.join(PLATFORMS)}")
    args = parser.parse_args(argv)
    chosen = [p.strip() for p in args.only.split(",") if p.strip()]
    unknown = sorted(set(chosen) - set(PLATFORMS))
    if unknown:
        parser.error(f"--only: unknown platform(s) {unknown}; choose from {', '.join(PLATFORMS)}")
    BUILD.mkdir(parents=True, exist_ok=True)
    dist = Path(tempfile.mkdtemp(prefix="gaccum-wheel-"))
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--quiet", "-w", dist, ROOT])
    [wheel] = dist.glob("gaccum_lib-*.whl")
    saved = BUILD / "results.json"
    found = json.loads(saved.read_text()) if saved.exists() else {}
    for name in chosen:
        found[name] = {**run_platform(name, PLATFORMS[name], wheel), "date": time.strftime("%Y-%m-%d")}
        saved.write_text(json.dumps(found, indent=2) + "\n")
    found = {name: found[name] for name in PLATFORMS if name in found}
    REPORT.write_text(write_report(found))
    print(f"wrote {REPORT.relative_to(ROOT)}")
    bad = [n for n in chosen if found[n]["changed_by_install"] or found[n]["deepspeed_after"]
           or any(v != "passed" for v in found[n]["lessons"].values())]
    if bad:
        print(f"not clean on: {', '.join(bad)} (see {REPORT.relative_to(ROOT)} and build/platforms/*.log)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
