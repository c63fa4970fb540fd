"""Find a Chrome or Chromium for the browser test, installing Debian's Chromium where we may.

    python tests/browser/chromium.py            # print the executable, or exit 1 saying how to get one
    python tests/browser/chromium.py --provide  # the same, but first apt-get install chromium where possible

`make browser` (part of `make test`) runs it with --provide, so a fresh machine needs no set-up
step of its own. The browser is never downloaded by Playwright (`playwright install` cannot
reach its servers here, and a second browser build is not what users run): it is the
system's Chromium or Chrome, or whatever GACCUM_CHROMIUM points at.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable", "chrome")
PATHS = ("/usr/bin/chromium", "/usr/bin/chromium-browser", "/snap/bin/chromium", "/usr/bin/google-chrome",
         "/Applications/Chromium.app/Contents/MacOS/Chromium",
         "/Applications/Google Chrome.app/Contents/MacOS/Google Chrome")
HOW = ("Install Debian's Chromium (`sudo apt-get install -y chromium`), or point GACCUM_CHROMIUM at a Chrome or "
       "Chromium executable. Never `playwright install`: it downloads a browser of its own.")


def _executable(path: str) -> bool:
    return bool(path) and os.path.isfile(path) and os.access(path, os.X_OK)


def find() -> str | None:
    """GACCUM_CHROMIUM if set, else the first Chrome/Chromium on the PATH or in the usual places."""
    chosen = os.environ.get("GACCUM_CHROMIUM", "")
    if chosen:
        return chosen if _executable(chosen) else None
    for candidate in [shutil.which(name) or "" for name in NAMES] + list(PATHS):
        if _executable(candidate):
            return candidate
    return None


def _apt_prefix() -> list[str] | None:
    """How to run apt-get here: directly as root, through passwordless sudo, or not at all."""
    if sys.platform != "linux" or shutil.which("apt-get") is None:
        return None
    if os.geteuid() == 0:
        return []
    if shutil.which("sudo") and subprocess.run(["sudo", "-n", "true"], capture_output=True).returncode == 0:
        return ["sudo", "-n"]
    return None


def provide() -> str | None:
    found = find()
    if found or os.environ.get("GACCUM_CHROMIUM"):
        return found
    prefix = _apt_prefix()
    if prefix is None:
        return None
    print(">> installing Chromium (apt-get install chromium), once", file=sys.stderr, flush=True)
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for command in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", "chromium"]):
        done = subprocess.run(prefix + command, env=env, stdout=subprocess.DEVNULL)
        if done.returncode != 0:
            print(f"chromium.py: {' '.join(command)} failed (exit {done.returncode})", file=sys.stderr)
            return None
    return find()


def main(argv: list[str]) -> int:
    found = provide() if "--provide" in argv else find()
    if found is None:
        print(f"Chrome/Chromium not found, so the notebooks cannot be tested in a real browser. {HOW}",
              file=sys.stderr)
        return 1
    print(found)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
