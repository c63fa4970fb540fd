"""Every notebook in a real browser: JupyterLab + Chromium, as a learner would use it.

For each notebook: open it, Run All, and fail on an error output (outside cells tagged
raises-exception), on a widget that did not render ("Error displaying widget", "model not
found", "Loading widget") and on any browser console error. Then use every widget: move its
first slider with the keyboard (`.widget-slider .noUi-handle`), click its buttons labelled
"launch" or "run", and check that the plot it drives changes (the bytes behind the <img>) and
that it shows no error. A screenshot of each notebook lands in build/screenshots/; the paths
and timings are printed at the end. The notebooks named in GACCUM_COLAB_LESSONS run in kernels
that Accelerate takes for Colab's; each notebook is saved, as Run All left it, to
build/browser/executed/, where `make browser` checks what the Colab ones printed.

Run with `make browser`; see conftest.py for the settings.
"""

from __future__ import annotations

import contextlib
import json
import re
import time

from jupyter_pages import error_outputs, wait_until

OPEN_TIMEOUT_MS = 60_000
# How long a plot may take to redraw after a slider moved, and a launch button to answer (real processes).
SLIDER_TIMEOUT_S = 30
LAUNCH_TIMEOUT_S = 180
BAD_TEXT = re.compile(r"Error displaying widget|model not found|Failed to load model class|"
                      r"Loading widget|Could not render", re.IGNORECASE)
BUTTON_LABEL = re.compile(r"launch|\brun\b", re.IGNORECASE)
NOTEBOOK = ".jp-NotebookPanel:not(.lm-mod-hidden)"


def _execution_timeout_s(nb: dict) -> float:
    return float(nb.get("metadata", {}).get("execution", {}).get("timeout", 300))


def _code_cells_to_run(nb: dict) -> int:
    return sum(1 for c in nb["cells"] if c["cell_type"] == "code" and "".join(c["source"]).strip()
               and "skip-execution" not in c.get("metadata", {}).get("tags", []))


def _prompts(page) -> list[str]:
    return page.eval_on_selector_all(f"{NOTEBOOK} .jp-CodeCell .jp-InputPrompt",
                                     "nodes => nodes.map(n => n.textContent.trim())")


def _kernel_idle(page) -> bool:
    return page.locator(f"{NOTEBOOK} .jp-Notebook-ExecutionIndicator[data-status='idle']").count() > 0


def _kernel_ready(page) -> bool:
    """The status bar names a kernel and says it is idle (the toolbar says "idle" before any kernel exists)."""
    texts = page.locator(".jp-StatusBar-TextItem").all_inner_texts()
    return _kernel_idle(page) and any(re.search(r"\| Idle$", t.strip()) and not t.startswith("No Kernel")
                                      for t in texts)


def _wait_idle(page, timeout_s: float, what: str) -> None:
    """The kernel is idle and stays idle for a moment (a click may take a little while to reach it)."""
    def settled():
        if not _kernel_idle(page):
            return False
        time.sleep(0.5)
        return _kernel_idle(page)
    wait_until(settled, timeout_s, what)


def _menu(page, menu: str, item: str) -> None:
    """Click menu > item in JupyterLab's menu bar, as a learner would."""
    page.locator(".lm-MenuBar-item", has_text=re.compile(f"^{menu}$")).click()
    label = page.locator(".lm-Menu-itemLabel", has_text=re.compile(f"^{item}$"))
    page.locator(".lm-Menu-item", has=label).click()


def _run_all(page, timeout_s: float) -> None:
    """Run > Run All Cells, then wait until no cell is queued and the kernel is idle (it stops at an error)."""
    _menu(page, "Run", "Run All Cells")
    wait_until(lambda: any(re.fullmatch(r"\[(\*|\d+)\]:", p) for p in _prompts(page)), 15,
                "Run All to start (no cell was queued)")

    def finished():
        if any("*" in p for p in _prompts(page)) or not _kernel_idle(page):
            return False
        time.sleep(0.5)  # idle between two cells is not the end: it must stay idle with nothing queued
        return not any("*" in p for p in _prompts(page)) and _kernel_idle(page)
    try:
        wait_until(finished, timeout_s, "Run All to finish")
    except AssertionError as exc:  # say where it stopped: a hang is otherwise hard to find again
        raise AssertionError(f"{exc}; {_where_it_stopped(page)}") from None


def _where_it_stopped(page) -> str:
    """The code cell still running, and every kernel's processes with their state (a hung launch shows here)."""
    import psutil

    running = [i for i, p in enumerate(_prompts(page)) if "*" in p]
    processes = []
    for kernel in psutil.process_iter(["cmdline"]):
        with contextlib.suppress(psutil.Error):
            if any("ipykernel_launcher" in part for part in kernel.info["cmdline"] or []):
                family = [kernel, *kernel.children(recursive=True)]
                processes += [f"{p.pid} {p.name()} {p.status()} cpu {sum(p.cpu_times()[:2]):.1f} s" for p in family]
    return f"code cell {running[0] if running else '?'} (0-based, code cells only) was running; processes: {processes}"


def _save_and_read(page, lab, name: str) -> dict:
    """Save the notebook (our copy), wait until the file is rewritten, and read back its outputs."""
    path = lab.root / name
    before = path.stat().st_mtime_ns
    _menu(page, "File", "Save Notebook")

    def saved():
        if path.stat().st_mtime_ns == before:
            return None
        try:
            return json.loads(path.read_text())
        except json.JSONDecodeError:  # caught half-written: try again
            return None
    return wait_until(saved, 30, "the notebook to be saved")


def _notebook_text(page) -> str:
    return page.locator(f"{NOTEBOOK} .jp-Notebook").inner_text()


# The bytes behind an <img> (a blob: URL for ipywidgets' Image) as a SHA-256, so that "the plot
# changed" means new pixels, not just a new URL.
IMAGE_DIGEST_JS = """async img => {
  if (!img.src) return '';
  const data = await (await fetch(img.src)).arrayBuffer();
  const digest = await crypto.subtle.digest('SHA-256', data);
  return Array.from(new Uint8Array(digest)).map(b => b.toString(16).padStart(2, '0')).join('');
}"""


WIDGET_MIME = "application/vnd.jupyter.widget-view+json"


def _widget_outputs(page):
    """Outputs of the notebook's cells that hold a rendered widget (nested outputs of widgets excluded)."""
    return page.locator(f"{NOTEBOOK} .jp-Cell-outputArea > .jp-OutputArea-child > "
                        ".jp-OutputArea-output:has(> .jupyter-widgets:not(.widget-error))")


def _widget_views(nb: dict) -> int:
    return sum(1 for c in nb["cells"] for o in c.get("outputs", []) if WIDGET_MIME in o.get("data", {}))


def _exercise_widgets(page, record: dict) -> None:
    """Use every widget output as a learner would, and check that it answers.

    In each output: move the first slider one step with the keyboard, then click every button
    labelled "launch" or "run" (an explorer with such a button recomputes only on the click).
    What it drives must change -- its image if it has one, else its text -- and it must show no
    error afterwards.
    """
    outputs = _widget_outputs(page)
    for i in range(outputs.count()):
        output = outputs.nth(i)
        handles, images = output.locator(".widget-slider .noUi-handle"), output.locator("img")
        buttons = output.locator("button.jupyter-button")
        launches = [buttons.nth(j) for j in range(buttons.count())
                    if BUTTON_LABEL.search(buttons.nth(j).inner_text() or buttons.nth(j).get_attribute("title") or "")]
        if handles.count() == 0 and not launches:
            continue
        image = images.first if images.count() else None
        before = image.evaluate(IMAGE_DIGEST_JS) if image else output.inner_text()
        assert before, f"widget output {i}: its plot is empty before it was used"
        done = []
        if handles.count():
            handle = handles.first
            handle.scroll_into_view_if_needed()
            now, top = (float(handle.get_attribute(a) or 0) for a in ("aria-valuenow", "aria-valuemax"))
            handle.focus()
            handle.press("ArrowLeft" if now >= top else "ArrowRight")
            done.append("moved its first slider")
            record["sliders"] = record.get("sliders", 0) + 1
        for button in launches:
            label = button.inner_text().strip()
            if launches[0] is not button:
                _wait_idle(page, LAUNCH_TIMEOUT_S, f"the kernel to finish before clicking {label!r}")
            button.scroll_into_view_if_needed()
            button.click()
            done.append(f"clicked {label!r}")
            record["buttons"] = record.get("buttons", 0) + 1
        timeout = LAUNCH_TIMEOUT_S if launches else SLIDER_TIMEOUT_S

        def changed(image=image, output=output, before=before):
            now = image.evaluate(IMAGE_DIGEST_JS) if image else output.inner_text()
            return now not in ("", before)
        try:
            wait_until(changed, timeout, "an answer", interval_s=0.3)
            _wait_idle(page, timeout, "the kernel to finish")
        except AssertionError as exc:
            raise AssertionError(f"widget output {i}: {' and '.join(done)}, but its {'plot' if image else 'text'} "
                                 f"did not change within {timeout} s. It shows:\n{output.inner_text()}") from exc
        text = output.inner_text()
        bad = BAD_TEXT.search(text) or re.search(r"Traceback|\u26a0", text)
        assert not bad, f"widget output {i}: {' and '.join(done)}, and it shows {bad.group(0)!r}:\n{text[-3000:]}"


def test_notebook_in_browser(notebook, page, lab, results, screenshots, executed, colab_kernels, request):
    """`notebook` is every notebook under test (conftest.py parametrizes it)."""
    name = notebook.name
    source = json.loads(notebook.read_text())
    record = {"notebook": name, "lab_log": str(lab.log), "colab": notebook.stem in colab_kernels}
    results.append(record)
    request.node.user_properties.append(("browser", record))  # what a pytest-xdist worker reports back
    console_errors = []
    page.on("console", lambda m: m.type == "error" and console_errors.append(f"console: {m.text} ({m.location})"))
    page.on("pageerror", lambda e: console_errors.append(f"page error: {e}"))
    try:
        start = opened = time.monotonic()
        # A workspace of its own, reset: no tab of an earlier notebook comes back with it.
        page.goto(f"{lab.url}/lab/workspaces/{notebook.stem}/tree/{name}?reset&token={lab.token}",
                  wait_until="domcontentloaded")
        page.wait_for_selector(f"{NOTEBOOK} .jp-Notebook", timeout=OPEN_TIMEOUT_MS)
        wait_until(lambda: _kernel_ready(page), OPEN_TIMEOUT_MS / 1000, "the notebook's kernel to be ready")
        record["open_s"] = time.monotonic() - start

        start = time.monotonic()
        _run_all(page, _execution_timeout_s(source))
        record["run_s"] = time.monotonic() - start
        saved = _save_and_read(page, lab, name)
        (executed / name).write_text(json.dumps(saved, indent=1))
        assert error_outputs(saved) == [], "error outputs after Run All"
        # Counted in the saved file, not the page: a collapsed cell (source hidden) shows no input prompt.
        ran = sum(1 for c in saved["cells"] if c["cell_type"] == "code" and c.get("execution_count"))
        expected = _code_cells_to_run(source)
        assert ran >= expected, f"Run All ran {ran} of {expected} code cells"
        views = _widget_views(saved)
        try:  # widget views render asynchronously, a moment after the kernel went idle
            wait_until(lambda: _widget_outputs(page).count() == views, 15, f"{views} widget(s) to render")
        finally:
            bad = BAD_TEXT.search(_notebook_text(page))
            assert not bad, f"the notebook shows {bad.group(0)!r} after Run All"

        _exercise_widgets(page, record)
        bad = BAD_TEXT.search(_notebook_text(page))
        assert not bad, f"the notebook shows {bad.group(0)!r} after using its widgets"
        assert error_outputs(_save_and_read(page, lab, name)) == [], "error outputs after using the widgets"
        assert console_errors == [], "the browser console reported errors"
        record["total_s"] = time.monotonic() - opened
    finally:
        screenshots.mkdir(parents=True, exist_ok=True)
        shot = screenshots / f"{notebook.stem}.png"
        try:
            _screenshot(page, shot)
            record["screenshot"] = str(shot)
        except Exception as exc:  # noqa: BLE001 - a failed screenshot must not hide the test's own failure
            record["screenshot"] = f"(none: {exc})"
        with contextlib.suppress(OSError):  # a dead server must not hide the test's own failure
            lab.shutdown_kernels()


def _screenshot(page, path) -> None:
    """The whole notebook in one picture: make the window as tall as the notebook, scroll to the top, shoot."""
    scroller = f"{NOTEBOOK} .jp-WindowedPanel-outer"
    height = page.evaluate("s => (document.querySelector(s) || {scrollHeight: 0}).scrollHeight", scroller)
    page.set_viewport_size({"width": 1280, "height": int(min(max(900, height + 150), 12_000))})
    page.evaluate("s => { const n = document.querySelector(s); if (n) n.scrollTop = 0; }", scroller)
    page.wait_for_timeout(300)
    page.screenshot(path=str(path))
