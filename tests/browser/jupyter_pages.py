"""What both browser tests need of a Jupyter server: its REST API, stopping it, waiting, reading errors.

Shared by conftest.py (JupyterLab, `make browser`) and test_classic_notebook.py (classic Notebook 6,
`make floors`); pytest puts this folder on sys.path.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

ANSI = re.compile(r"\x1b\[[0-9;]*m")


class Server:
    """A running Jupyter server: its URL, token, folder of notebook copies, process, log, and REST helpers."""

    def __init__(self, url: str, token: str, root: Path, process: subprocess.Popen, log: Path):
        self.url, self.token, self.root, self.process, self.log = url, token, root, process, log

    def api(self, method: str, path: str):
        request = urllib.request.Request(f"{self.url}{path}", method=method,
                                         headers={"Authorization": f"token {self.token}"})
        with urllib.request.urlopen(request, timeout=10) as response:
            body = response.read()
        return json.loads(body) if body else None

    def shutdown_kernels(self) -> None:
        """End every session and kernel (one notebook's kernel must not slow the next down)."""
        for session in self.api("GET", "/api/sessions"):
            self.api("DELETE", f"/api/sessions/{session['id']}")
        for kernel in self.api("GET", "/api/kernels"):
            self.api("DELETE", f"/api/kernels/{kernel['id']}")

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])


def stop(process: subprocess.Popen) -> None:
    """Stop a server (its process group) and every process it started, even if it hangs: kernels run in
    sessions of their own, so a process-group kill misses them, and so do the processes a launch cell forks."""
    import psutil

    if process.poll() is not None:
        return
    started = []
    with contextlib.suppress(psutil.Error):
        started = psutil.Process(process.pid).children(recursive=True)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)  # the server shuts its kernels down on the way out
    try:
        process.wait(timeout=15)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=10)
    for child in started:
        # psutil checks that the pid still names the process it saw (same start time): a reused id is spared.
        with contextlib.suppress(psutil.Error):
            child.kill()


def wait_until(predicate, timeout_s: float, what: str, interval_s: float = 0.2):
    """``predicate()``'s first truthy value, polled every ``interval_s``; an AssertionError past ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(interval_s)


def error_outputs(nb: dict) -> list[str]:
    """Every error output of a saved notebook, but in cells tagged raises-exception, with its last trace lines."""
    found = []
    for index, cell in enumerate(nb["cells"]):
        if "raises-exception" in cell.get("metadata", {}).get("tags", []):
            continue
        for output in cell.get("outputs", []):
            if output.get("output_type") == "error":
                trace = ANSI.sub("", "\n".join(output.get("traceback", [])[-3:]))
                found.append(f"cell {index}: {output.get('ename')}: {output.get('evalue')}\n{trace}")
    return found
