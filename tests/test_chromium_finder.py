"""tests/browser/chromium.py: how `make test` gets its browser (found, installed, or a clear stop)."""

import importlib.util
from pathlib import Path

SPEC = importlib.util.spec_from_file_location("chromium", Path(__file__).parent / "browser" / "chromium.py")
chromium = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(chromium)


def _fake_browser(folder: Path, name: str) -> Path:
    path = folder / name
    path.write_text("#!/bin/sh\n")
    path.chmod(0o755)
    return path


def test_gaccum_chromium_wins_and_must_be_an_executable(tmp_path, monkeypatch):
    chosen = _fake_browser(tmp_path, "my-chrome")
    monkeypatch.setenv("GACCUM_CHROMIUM", str(chosen))
    assert chromium.find() == str(chosen)
    monkeypatch.setenv("GACCUM_CHROMIUM", str(tmp_path / "missing"))
    assert chromium.find() is None
    assert chromium.provide() is None  # a wrong GACCUM_CHROMIUM is never papered over by an install


def test_a_chrome_on_the_path_is_found(tmp_path, monkeypatch):
    monkeypatch.delenv("GACCUM_CHROMIUM", raising=False)
    monkeypatch.setattr(chromium, "PATHS", ())
    monkeypatch.setenv("PATH", str(tmp_path))
    assert chromium.find() is None
    chrome = _fake_browser(tmp_path, "google-chrome")
    assert chromium.find() == str(chrome)


def test_nothing_found_and_nothing_to_install_with_stops_naming_the_fix(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("GACCUM_CHROMIUM", raising=False)
    monkeypatch.setattr(chromium, "PATHS", ())
    monkeypatch.setenv("PATH", str(tmp_path))  # no apt-get, no sudo, no browser
    assert chromium.main(["--provide"]) == 1
    message = capsys.readouterr().err
    assert "Chrome/Chromium not found" in message and "apt-get install -y chromium" in message
    assert "GACCUM_CHROMIUM" in message
