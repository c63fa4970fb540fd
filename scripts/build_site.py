"""Execute every lesson and render a static, offline site: build/site/index.html + one page per notebook.

    python scripts/build_site.py                                  # execute notebooks/*.ipynb, render build/site/
    python scripts/build_site.py --executed build/executed --out /tmp/site   # render notebooks executed already

How:

1. The notebooks are copied to a work folder (build/site-run/) and executed there with nbclient,
   two at a time, each kernel in that folder -- as under `make notebooks`, so a lesson that looks
   at its siblings finds them. nbclient keeps the widgets' last state (``store_widget_state``).
2. Each widget output is replaced by static HTML built from that saved state: an explorer shows
   its last plot (the Image model's PNG), its caption and the values its controls had. No
   JavaScript, so no "Loading widget..." placeholder and nothing fetched from a CDN.
3. Pages are rendered with nbconvert's "lab" template, minus every script it would load from
   the internet (require.js, MathJax, mermaid, the widget manager). Math stays as TeX source.
4. Every picture gets alt text: a matplotlib figure's comes from its titles, axis labels and
   legend (recorded in the kernel while the lesson runs); an explorer's from its title, caption
   and settings; anything else names the lesson and section it sits in.

The index lists the lessons of gaccum_course.lessons.LESSONS in order (title, aim, a learner's time), then
any notebook the map does not list yet. `make html` runs this, then tests/test_site.py on it.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import html
import importlib.util
import json
import os
import re
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parents[1]
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
WIDGET_STATE = "application/vnd.jupyter.widget-state+json"
DEFAULT_TIMEOUT_S = 600
ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


class SiteError(RuntimeError):
    """The site cannot be built as promised (a notebook failed, a widget has no saved state...)."""


# ----------------------------------------------------------------------------------------------
# Which notebooks, in which order
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Page:
    notebook: str       # file name, e.g. 01_why_accumulate.ipynb
    title: str
    aim: str
    time: str
    in_map: bool        # listed in gaccum_course.lessons.LESSONS

    @property
    def html_name(self) -> str:
        return Path(self.notebook).stem + ".html"


def _first_heading(path: Path) -> str:
    nb = json.loads(path.read_text())
    for cell in nb["cells"]:
        if cell["cell_type"] == "markdown":
            match = re.search(r"^#\s+(.+)$", "".join(cell["source"]), flags=re.M)
            if match:
                return match.group(1).strip()
    return path.stem


def _lessons() -> tuple:
    """gaccum_course.lessons.LESSONS, read without importing the package (and torch with it)."""
    spec = importlib.util.spec_from_file_location("_gaccum_lessons", ROOT / "gaccum_course" / "lessons.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module.LESSONS


def pages_for(folder: Path) -> list[Page]:
    """The lessons of the map in order, then notebooks the map does not list (yet), by name."""
    lessons = _lessons()
    on_disk = sorted(p.name for p in folder.glob("*.ipynb"))
    missing = [lesson.notebook for lesson in lessons if lesson.notebook not in on_disk]
    if missing:
        raise SiteError(f"the lesson map lists {missing}, not found in {folder}")
    pages = [Page(x.notebook, x.title, x.aim, x.time_text, True) for x in lessons]
    listed = {x.notebook for x in lessons}
    pages += [Page(name, _first_heading(folder / name), "", "", False) for name in on_disk if name not in listed]
    return pages


# ----------------------------------------------------------------------------------------------
# Execution
# ----------------------------------------------------------------------------------------------

# Run silently in each kernel before the first cell (no output, no execution count): matplotlib
# figures get alt text in their output metadata, described from what the figure itself says.
# Run in every kernel that executes a lesson for the site (also `make notebooks`' kernels, as an IPython
# start-up script): matplotlib figures get alt text from their titles, labels and legends.
KERNEL_SETUP = (Path(__file__).resolve().parent / "site_alt_text.py").read_text()


def _execute(path: str) -> tuple[str, float, str | None]:
    """Execute one notebook in place (its folder is the kernel's working directory)."""
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError, CellTimeoutError

    class SiteClient(NotebookClient):
        async def async_start_new_kernel_client(self):
            client = await super().async_start_new_kernel_client()
            reply = await client.execute_interactive(KERNEL_SETUP, silent=True, store_history=False,
                                                     timeout=60, output_hook=lambda _msg: None)
            if reply["content"]["status"] != "ok":
                raise SiteError(f"kernel setup failed: {reply['content']}")
            return client

    start = time.monotonic()
    nb = nbformat.read(path, as_version=4)
    timeout = nb.metadata.get("execution", {}).get("timeout", DEFAULT_TIMEOUT_S)
    client = SiteClient(nb, timeout=timeout, kernel_name="python3", store_widget_state=True,
                        resources={"metadata": {"path": str(Path(path).parent)}})
    try:
        client.execute()
    except (CellExecutionError, CellTimeoutError) as exc:
        return path, time.monotonic() - start, ANSI.sub("", str(exc))[-4000:]
    nbformat.write(nb, path)
    return path, time.monotonic() - start, None


def execute_all(source: Path, workdir: Path, names: list[str], jobs: int) -> dict[str, float]:
    """Copy every notebook of ``source`` to ``workdir`` and execute ``names`` there; fail on any error."""
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    for notebook in source.glob("*.ipynb"):
        shutil.copy(notebook, workdir / notebook.name)
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # as the tests run them: tiny models, shared cores
    seconds, failures = {}, []
    with concurrent.futures.ProcessPoolExecutor(max_workers=max(1, jobs)) as pool:
        for path, took, error in pool.map(_execute, [str(workdir / n) for n in names]):
            name = Path(path).name
            seconds[name] = took
            print(f"   executed {name:<36} {took:6.1f} s{'  FAILED' if error else ''}", flush=True)
            if error:
                failures.append(f"{name}:\n{error}")
    if failures:
        raise SiteError("notebooks failed to run:\n\n" + "\n\n".join(failures))
    return seconds


# ----------------------------------------------------------------------------------------------
# Widgets -> static HTML, from the saved widget state
# ----------------------------------------------------------------------------------------------

BOXES = {"VBoxModel": "column", "BoxModel": "column", "GridBoxModel": "column", "HBoxModel": "row",
         "AccordionModel": "column", "TabModel": "column", "StackModel": "column"}
TEXTS = {"HTMLModel", "HTMLMathModel", "LabelModel"}
SELECTIONS = {"DropdownModel", "RadioButtonsModel", "ToggleButtonsModel", "SelectModel", "SelectionSliderModel"}
MULTI_SELECTIONS = {"SelectMultipleModel", "SelectionRangeSliderModel"}


def _plain(markup: str) -> str:
    """Text of an HTML fragment, on one line."""
    return " ".join(html.unescape(re.sub(r"<[^>]+>", " ", markup or "")).split())


def _format_number(value, spec: str | None) -> str:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return str(value)
    try:
        return format(value, spec) if spec else str(value)
    except (ValueError, TypeError):  # a d3-format spec Python does not know
        return str(value)


class WidgetRenderer:
    """Static HTML for the widget views of one executed notebook, from its saved widget state."""

    def __init__(self, nb, fallback_alt: str):
        widgets = nb.metadata.get("widgets", {}).get(WIDGET_STATE, {})
        self.models = {}
        for model_id, entry in widgets.get("state", {}).items():
            state = dict(entry.get("state", {}))
            for buffer in entry.get("buffers", []):  # binary traits (an Image's value) are saved apart
                if len(buffer.get("path", [])) == 1 and buffer.get("encoding") == "base64":
                    state[buffer["path"][0]] = {"base64": buffer["data"]}
            self.models[model_id] = (entry.get("model_name", ""), state)
        self.fallback_alt = fallback_alt

    def model(self, ref: str):
        model_id = ref.removeprefix("IPY_MODEL_")
        if model_id not in self.models:
            raise SiteError(f"widget model {model_id} has no saved state (closed before the notebook ended?)")
        return self.models[model_id]

    def hidden(self, state: dict) -> bool:
        layout = state.get("layout")
        if not isinstance(layout, str) or layout.removeprefix("IPY_MODEL_") not in self.models:
            return False
        _, values = self.model(layout)
        return values.get("display") == "none" or values.get("visibility") == "hidden"

    def view(self, model_id: str) -> str:
        body = self.render(model_id, self.fallback_alt)
        return (f'<div class="gaccum-widget">{body}<p class="gaccum-widget-note">The last state of an interactive '
                f"widget: run the notebook in JupyterLab to use it.</p></div>")

    # --- one model --------------------------------------------------------------------------
    def render(self, ref: str, alt: str) -> str:
        name, state = self.model(ref)
        if self.hidden(state):
            return ""
        if name in BOXES:
            return self.box(name, state, alt)
        if name in TEXTS:
            value = state.get("value", "")
            content = html.escape(value) if name == "LabelModel" else value
            return f'<div class="gaccum-text">{self.label(state)}{content}</div>' if content else ""
        if name == "ImageModel":
            return self.image(state, alt)
        if name == "OutputModel":
            return self.outputs(state.get("outputs", []), alt)
        if name == "ButtonModel":
            text = html.escape(state.get("description", "") or state.get("tooltip", "") or "button")
            return f'<button class="gaccum-button" type="button" disabled>{text}</button>'
        if "value" in state or "index" in state:
            return self.control(name, state)
        return ""

    def label(self, state: dict) -> str:
        description = _plain(state.get("description", ""))
        return f'<span class="gaccum-label">{html.escape(description)}</span> ' if description else ""

    def control(self, name: str, state: dict) -> str:
        value = state.get("value")
        labels = state.get("_options_labels", [])
        if name in SELECTIONS:
            index = state.get("index")
            text = labels[index] if isinstance(index, int) and 0 <= index < len(labels) else "(none)"
        elif name in MULTI_SELECTIONS:
            text = ", ".join(labels[i] for i in state.get("index", []) if 0 <= i < len(labels))
        elif name in {"CheckboxModel", "ToggleButtonModel"}:
            text = "on" if value else "off"
        elif isinstance(value, list):
            spec = state.get("readout_format")
            text = " to ".join(_format_number(v, spec) for v in value)
        else:
            text = _format_number(value, state.get("readout_format"))
        return (f'<span class="gaccum-control">{self.label(state)}'
                f'<span class="gaccum-value">{html.escape(str(text))}</span></span>')

    def image(self, state: dict, alt: str) -> str:
        value = state.get("value")
        if not isinstance(value, dict) or not value.get("base64"):
            return ""
        kind = {"jpg": "jpeg", "svg": "svg+xml"}.get(state.get("format", "png"), state.get("format", "png"))
        size = "".join(f' {a}="{html.escape(str(state[a]))}"' for a in ("width", "height") if state.get(a))
        return (f'<img class="gaccum-widget-image" src="data:image/{kind};base64,{value["base64"]}"'
                f' alt="{html.escape(alt, quote=True)}"{size}>')

    def box(self, name: str, state: dict, alt: str) -> str:
        children = [c for c in state.get("children", []) if isinstance(c, str)]
        if name == "StackModel":
            index = state.get("selected_index")
            children = [children[index]] if isinstance(index, int) and 0 <= index < len(children) else []
        # An image's alt text: what its box says around it (an explorer's title and caption) and the
        # values of the controls next to it.
        words, settings = [], []
        for child in children:
            child_name, child_state = self.model(child)
            if child_name in TEXTS and _plain(child_state.get("value", "")):
                words.append(_plain(child_state.get("value", "")))
            elif child_name in BOXES:
                for grandchild in child_state.get("children", []):
                    g_name, g_state = self.model(grandchild)
                    if g_name not in TEXTS | set(BOXES) | {"ImageModel", "OutputModel", "ButtonModel"} and (
                            "value" in g_state or "index" in g_state):
                        settings.append(_plain(self.control(g_name, g_state)))
        if words or settings:
            alt = "Plot: " + " ".join(w.rstrip(".") + "." for w in words)
            alt += f" Settings: {', '.join(settings)}." if settings else ""
        titles = state.get("titles") or state.get("_titles") or []
        parts = []
        for i, child in enumerate(children):
            rendered = self.render(child, alt)
            if name in {"TabModel", "AccordionModel"} and i < len(titles) and titles[i]:
                rendered = f'<div class="gaccum-tab-title">{html.escape(str(titles[i]))}</div>{rendered}'
            parts.append(rendered)
        return f'<div class="gaccum-box gaccum-{BOXES[name]}">{"".join(parts)}</div>'

    def outputs(self, outputs: list, alt: str) -> str:
        parts = []
        for output in outputs:
            kind = output.get("output_type")
            if kind == "stream":
                text = "".join(output.get("text", ""))
                parts.append(f'<pre class="gaccum-stream">{html.escape(ANSI.sub("", text))}</pre>')
            elif kind == "error":
                parts.append(f'<pre class="gaccum-stream">{html.escape(output.get("ename", ""))}: '
                             f'{html.escape(output.get("evalue", ""))}</pre>')
            else:
                data = output.get("data", {})
                if WIDGET_VIEW in data:
                    parts.append(self.render(data[WIDGET_VIEW]["model_id"], alt))
                elif "text/html" in data:
                    parts.append("".join(data["text/html"]))
                elif "image/png" in data:
                    own = output.get("metadata", {}).get("image/png", {}).get("alt") or alt
                    parts.append(f'<img src="data:image/png;base64,{"".join(data["image/png"]).strip()}"'
                                 f' alt="{html.escape(own, quote=True)}">')
                elif "text/plain" in data:
                    parts.append(f'<pre class="gaccum-stream">{html.escape("".join(data["text/plain"]))}</pre>')
        return "".join(parts)


def _cell_context(nb, page_title: str):
    """For each cell: the alt text to fall back on (the lesson and the section the cell sits in)."""
    heading = ""
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            found = re.findall(r"^#{1,6}\s+(.+)$", cell.source, flags=re.M)
            heading = _plain(found[-1]) if found else heading
            continue
        comment = next((line.lstrip("# ").strip() for line in cell.source.splitlines()
                        if line.startswith("#") and line.lstrip("# ").strip()), "")
        where = f'lesson "{page_title}"' + (f', section "{heading}"' if heading else "")
        yield cell, f"Plot from {where}" + (f": {comment}" if comment else "") + "."


def make_static(nb, page_title: str) -> int:
    """Replace every widget view by static HTML, give every PNG alt text; return the widgets replaced."""
    replaced = 0
    for cell, fallback_alt in _cell_context(nb, page_title):
        renderer = WidgetRenderer(nb, fallback_alt)
        for output in cell.get("outputs", []):
            data = output.get("data", {})
            if WIDGET_VIEW in data:
                try:
                    static = renderer.view(data[WIDGET_VIEW]["model_id"])
                except SiteError as exc:
                    raise SiteError(f"{page_title}, cell {cell.get('execution_count')}: {exc}") from None
                output["data"] = {"text/html": static}
                output["metadata"] = {}
                replaced += 1
            elif "image/png" in data:
                metadata = output.setdefault("metadata", {}).setdefault("image/png", {})
                if not str(metadata.get("alt", "")).strip():
                    metadata["alt"] = fallback_alt
    nb.metadata.pop("widgets", None)  # nothing left for a widget manager to load
    return replaced


# ----------------------------------------------------------------------------------------------
# Rendering
# ----------------------------------------------------------------------------------------------

SITE_CSS = """
body { max-width: 1100px; margin: 0 auto; padding: 0 1rem; }
nav.gaccum-nav { display: flex; gap: 1.5rem; padding: 0.8rem 0; border-bottom: 1px solid #ddd;
  font-family: var(--jp-ui-font-family, sans-serif); font-size: 0.95rem; }
nav.gaccum-nav a { color: #0072B2; }
.gaccum-widget { border: 1px solid #ddd; border-radius: 4px; padding: 0.5rem; margin: 0.3rem 0; }
.gaccum-box.gaccum-row { display: flex; flex-wrap: wrap; gap: 0.4rem 1.2rem; align-items: center; }
.gaccum-box.gaccum-column { display: flex; flex-direction: column; gap: 0.3rem; }
.gaccum-control { font-family: var(--jp-ui-font-family, sans-serif); font-size: 0.9rem; }
.gaccum-label { color: #555; }
.gaccum-value { font-weight: 600; }
.gaccum-widget img { max-width: 100%; height: auto; }
.gaccum-widget-note { color: #666; font-size: 0.8rem; margin: 0.3rem 0 0; }
.gaccum-stream { margin: 0; }
"""

# nbconvert's lab page, minus every script it would fetch from a CDN, with alt text on pictures,
# the site's navigation and a few styles for the static widgets.
TEMPLATE = r"""{%- extends 'lab/index.html.j2' -%}
{%- block html_head_js -%}{%- endblock html_head_js -%}
{%- block jupyter_widgets -%}{%- endblock jupyter_widgets -%}
{%- block html_head_js_mathjax -%}{%- endblock html_head_js_mathjax -%}
{%- block html_head_js_mermaidjs -%}{%- endblock html_head_js_mermaidjs -%}
{%- block extra_css -%}<style type="text/css">{{ resources.gaccum_css }}</style>{%- endblock extra_css -%}
{%- block body_header -%}
{{ super() }}
{{ resources.gaccum_nav }}
{%- endblock body_header -%}
{%- block body_footer -%}
{{ resources.gaccum_nav }}
{{ super() }}
{%- endblock body_footer -%}
{% block data_png scoped %}
<div class="jp-RenderedImage jp-OutputArea-output {{ extra_class }}">
<img src="data:image/png;base64,{{ output.data['image/png'] | escape_html }}"
 alt="{{ output.metadata.get('image/png', {}).get('alt', '') | escape_html }}">
</div>
{%- endblock data_png %}
{% block data_jpg scoped %}
<div class="jp-RenderedImage jp-OutputArea-output {{ extra_class }}">
<img src="data:image/jpeg;base64,{{ output.data['image/jpeg'] | escape_html }}"
 alt="{{ output.metadata.get('image/jpeg', {}).get('alt', '') | escape_html }}">
</div>
{%- endblock data_jpg %}
"""


def _exporter():
    import jinja2
    from nbconvert import HTMLExporter

    return HTMLExporter(template_name="lab", extra_loaders=[jinja2.DictLoader({"gaccum_site.html.j2": TEMPLATE})],
                        template_file="gaccum_site.html.j2")


def _nav(pages: list[Page], index: int) -> str:
    links = ['<a href="index.html">All lessons</a>']
    if index > 0:
        before = pages[index - 1]
        links.append(f'<a href="{before.html_name}" rel="prev">&larr; {html.escape(before.title)}</a>')
    if index + 1 < len(pages):
        after = pages[index + 1]
        links.append(f'<a href="{after.html_name}" rel="next">{html.escape(after.title)} &rarr;</a>')
    return f'<nav class="gaccum-nav" aria-label="lessons">{"".join(links)}</nav>'


def render_page(nb, pages: list[Page], index: int, exporter=None) -> tuple[str, int]:
    """The HTML page of an executed notebook, and how many widgets it shows as static HTML."""
    page = pages[index]
    nb.metadata["title"] = f"{page.title} · gaccum"
    widgets = make_static(nb, page.title)
    exporter = exporter or _exporter()
    body, _ = exporter.from_notebook_node(nb, resources={"metadata": {"name": page.title},
                                                         "gaccum_nav": _nav(pages, index), "gaccum_css": SITE_CSS})
    return body, widgets


def render_index(pages: list[Page]) -> str:
    rows = []
    for position, page in enumerate(p for p in pages if p.in_map):
        number = re.match(r"\d+", page.notebook)
        number = number.group(0) if number else str(position)
        rows.append(f'<tr><td>{number}</td><td><a href="{page.html_name}">{html.escape(page.title)}</a></td>'
                    f"<td>{html.escape(page.aim)}</td><td>{html.escape(page.time)}</td></tr>")
    extras = [p for p in pages if not p.in_map]
    more = ""
    if extras:
        items = "".join(f'<li><a href="{p.html_name}">{html.escape(p.title)}</a> ({p.notebook})</li>' for p in extras)
        more = f"<h2>Not in the lesson map yet</h2><ul>{items}</ul>"
    return f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1.0">
<title>gaccum · gradient accumulation, understood</title>
<style>
body {{ font-family: system-ui, sans-serif; max-width: 960px; margin: 2rem auto; padding: 0 1rem; line-height: 1.5;
  color: #222; }}
table {{ border-collapse: collapse; width: 100%; }}
th, td {{ text-align: left; vertical-align: top; padding: 0.5rem; border-bottom: 1px solid #ddd; }}
td:first-child, td:last-child {{ white-space: nowrap; }}
a {{ color: #0072B2; }}
</style>
</head>
<body>
<main>
<h1>gaccum · gradient accumulation, understood</h1>
<p>Why gradient accumulation works, where the naive version is silently wrong, and how to do it right
on one process or many with Hugging Face Accelerate. Each lesson below is a notebook, shown here as
it ran, plots included; the interactive widgets show their last state. To use them, run the
notebooks yourself: <code>make lab</code>.</p>
<h2>The lessons, in reading order</h2>
<table class="gaccum-lessons">
<thead><tr><th scope="col">#</th><th scope="col">lesson</th><th scope="col">you will learn</th>
<th scope="col">time</th></tr></thead>
<tbody>
{chr(10).join(rows)}
</tbody>
</table>
{more}
</main>
</body>
</html>
"""


def build(out: Path, *, executed: Path | None = None, source: Path = ROOT / "notebooks",
          workdir: Path = ROOT / "build" / "site-run", jobs: int = 2) -> dict:
    """Build the site into ``out``; return what was done (for the summary and the tests)."""
    start = time.monotonic()
    pages = pages_for(source)
    names = [p.notebook for p in pages]
    if executed is None:
        print(f">> executing {len(names)} notebooks in {workdir} ({jobs} at a time)", flush=True)
        seconds = execute_all(source, workdir, names, jobs)
        executed = workdir
    else:
        seconds = {}
        absent = [n for n in names if not (executed / n).exists()]
        if absent:
            raise SiteError(f"{executed} lacks executed copies of {absent}")
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    exporter = _exporter()
    widgets = {}
    for index, page in enumerate(pages):
        nb = nbformat.read(executed / page.notebook, as_version=4)
        if not any(c.get("outputs") for c in nb.cells if c.cell_type == "code"):
            raise SiteError(f"{executed / page.notebook} has no outputs: it was not executed")
        body, widgets[page.notebook] = render_page(nb, pages, index, exporter)
        (out / page.html_name).write_text(body)
    (out / "index.html").write_text(render_index(pages))
    return {"pages": pages, "seconds": seconds, "widgets": widgets, "total_s": time.monotonic() - start}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "build" / "site", help="where the site goes")
    parser.add_argument("--executed", type=Path, help="render the notebooks already executed in this folder")
    parser.add_argument("--notebooks", type=Path, default=ROOT / "notebooks", help="the lessons")
    parser.add_argument("--workdir", type=Path, default=ROOT / "build" / "site-run",
                        help="where the notebooks are executed")
    parser.add_argument("--jobs", type=int, default=int(os.environ.get("NB_WORKERS", "2") or 1),
                        help="notebooks executed at once")
    args = parser.parse_args(argv)
    try:
        done = build(args.out.resolve(), executed=args.executed, source=args.notebooks, workdir=args.workdir,
                     jobs=args.jobs)
    except SiteError as exc:
        print(f"build_site: {exc}", file=sys.stderr)
        return 1
    for page in done["pages"]:
        print(f"   {page.html_name:<40} {done['widgets'][page.notebook]} widget(s) made static")
    print(f">> site: {args.out / 'index.html'} ({len(done['pages'])} pages, {done['total_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
