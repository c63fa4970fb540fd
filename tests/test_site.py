"""The static site: every lesson in order, every page there, widgets as their last state, offline, alt text.

Two kinds of tests:

- the site tests (marker ``notebooks``) check a built site. By default they render one from
  the notebooks `make notebooks` executed (build/executed: nbmake keeps the widget state), so
  CI checks the renderer on the real lessons without running them again; `make html` points
  them at what it built with ``GACCUM_SITE=build/site`` (executed copies in build/site-run);
- unit tests of the widget renderer on a hand-made widget state, run by `make unit`.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
from bs4 import BeautifulSoup

from gaccum_course.lessons import LESSONS

ROOT = Path(__file__).resolve().parents[1]
BUILD_SITE = ROOT / "scripts" / "build_site.py"
NOTEBOOKS = sorted(p.name for p in (ROOT / "notebooks").glob("*.ipynb"))
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
WIDGET_STATE = "application/vnd.jupyter.widget-state+json"
PLACEHOLDERS = re.compile(r"Loading widget|Error displaying widget|model not found|Failed to load model|"
                          r"widget-view\+json|widget-state\+json|No description has been provided", re.IGNORECASE)
REMOTE = re.compile(r"^\s*(https?:)?//", re.IGNORECASE)


def _load_build_site():
    spec = importlib.util.spec_from_file_location("build_site", BUILD_SITE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


build_site = _load_build_site()


# ----------------------------------------------------------------------------------------------
# The built site
# ----------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def site(tmp_path_factory) -> tuple[Path, Path]:
    """(folder of the site, folder of the executed notebooks it was made from).

    ``GACCUM_SITE``: a site built already (by `make html`); otherwise one is rendered here from
    the executed notebooks in ``GACCUM_SITE_EXECUTED`` (default: build/executed, from `make notebooks`).
    """
    given = os.environ.get("GACCUM_SITE")
    executed = Path(os.environ.get("GACCUM_SITE_EXECUTED", ROOT / "build" / ("site-run" if given else "executed")))
    missing = [n for n in NOTEBOOKS if not (executed / n).exists()]
    assert not missing, f"{executed} lacks executed {missing}: run `make notebooks` (or `make html`) first"
    if given:
        assert (Path(given) / "index.html").exists(), f"{given} holds no site: run `make html`"
        return Path(given), executed
    folder = tmp_path_factory.mktemp("site")
    result = subprocess.run([sys.executable, str(BUILD_SITE), "--executed", str(executed), "--out", str(folder)],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr + result.stdout
    return folder, executed


def _soup(path: Path) -> BeautifulSoup:
    return BeautifulSoup(path.read_text(), "html.parser")


def _pages(folder: Path) -> dict[str, BeautifulSoup]:
    return {name: _soup(folder / name.replace(".ipynb", ".html")) for name in NOTEBOOKS}


@pytest.mark.notebooks
def test_index_lists_every_lesson_in_order(site):
    folder, _ = site
    rows = _soup(folder / "index.html").select("table.gaccum-lessons tbody tr")
    shown = [(row.a["href"], *(" ".join(td.get_text().split()) for td in row.find_all("td")[1:])) for row in rows]
    expected = [(x.notebook.replace(".ipynb", ".html"), x.title, x.aim, x.time_text) for x in LESSONS]
    assert shown == expected


@pytest.mark.notebooks
def test_every_notebook_has_a_page_and_every_link_a_target(site):
    folder, _ = site
    for name in NOTEBOOKS:
        page = folder / name.replace(".ipynb", ".html")
        assert page.exists(), f"no page for {name}"
    for page in folder.glob("*.html"):
        for link in _soup(page).find_all("a", href=True):
            href = link["href"]
            if not re.match(r"^(https?:|mailto:|#)", href):
                assert (folder / href.split("#")[0]).exists(), f"{page.name} links to missing {href}"
    for name, soup in _pages(folder).items():
        assert soup.select_one('nav.gaccum-nav a[href="index.html"]'), f"{name} has no way back to the index"
        assert soup.select(".jp-Cell"), f"{name} shows no cells"


@pytest.mark.notebooks
def test_no_widget_placeholder_or_widget_error(site):
    folder, _ = site
    for page in folder.glob("*.html"):
        text = page.read_text()
        found = PLACEHOLDERS.search(text)
        assert not found, f"{page.name} shows {found.group(0)!r}"


def _reachable(state: dict, model_id: str) -> list[dict]:
    """Every model a widget view shows (children, and widgets displayed in Output widgets)."""
    seen, todo, found = set(), [model_id], []
    while todo:
        current = todo.pop().removeprefix("IPY_MODEL_")
        if current in seen or current not in state:
            continue
        seen.add(current)
        entry = state[current]
        found.append(entry)
        todo += [c for c in entry["state"].get("children", []) if isinstance(c, str)]
        for output in entry["state"].get("outputs", []):
            if WIDGET_VIEW in output.get("data", {}):
                todo.append(output["data"][WIDGET_VIEW]["model_id"])
    return found


@pytest.mark.notebooks
def test_widgets_show_their_last_plot_and_caption(site):
    folder, executed = site
    for name, soup in _pages(folder).items():
        nb = json.loads((executed / name).read_text())
        views = [o["data"][WIDGET_VIEW]["model_id"] for c in nb["cells"] for o in c.get("outputs", [])
                 if WIDGET_VIEW in o.get("data", {})]
        assert len(soup.select(".gaccum-widget")) == len(views), f"{name}: a widget was not made static"
        state = nb.get("metadata", {}).get("widgets", {}).get(WIDGET_STATE, {}).get("state", {})
        sources = {img["src"] for img in soup.select(".gaccum-widget img")}
        text = " ".join(soup.get_text().split())
        for view in views:
            for entry in _reachable(state, view):
                if entry["model_name"] == "ImageModel":
                    png = next(b["data"] for b in entry.get("buffers", []) if b["path"] == ["value"])
                    assert f"data:image/png;base64,{png}" in sources, f"{name}: a widget's last plot is missing"
                if entry["model_name"] == "HTMLModel":
                    caption = " ".join(BeautifulSoup(entry["state"].get("value", ""), "html.parser").get_text().split())
                    assert caption in text, f"{name}: the widget text {caption!r} is missing"


@pytest.mark.notebooks
def test_every_picture_has_alt_text(site):
    folder, _ = site
    for page in folder.glob("*.html"):
        for img in _soup(page).find_all("img"):
            assert img.get("alt", "").strip(), f"{page.name}: a picture without alt text: {str(img)[:120]}"
            assert img["src"].startswith("data:image/"), f"{page.name}: a picture not embedded in the page"


@pytest.mark.notebooks
def test_the_site_loads_nothing_from_the_network(site):
    folder, _ = site
    for page in folder.glob("*.html"):
        soup = _soup(page)
        for tag, attribute in (("script", "src"), ("link", "href"), ("img", "src"), ("iframe", "src"),
                               ("source", "src"), ("embed", "src"), ("object", "data"), ("video", "src"),
                               ("audio", "src")):
            for element in soup.find_all(tag):
                value = element.get(attribute) or ""
                assert not REMOTE.match(value), f"{page.name}: <{tag} {attribute}={value!r}> needs the network"
        for script in soup.find_all("script"):
            assert not re.search(r"https?://|import\(", script.get_text()), f"{page.name}: a script fetches code"
        for style in soup.find_all("style"):
            css = re.sub(r"/\*.*?\*/", "", style.get_text(), flags=re.S)  # comments cite their sources
            assert not re.search(r"@import|url\(\s*['\"]?(https?:)?//", css), f"{page.name}: CSS fetches a resource"


# ----------------------------------------------------------------------------------------------
# The widget renderer, on a hand-made state (as nbclient saves it)
# ----------------------------------------------------------------------------------------------

PNG = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNkYPhfDwAChwGA60e6kgAAAABJRU5ErkJggg=="


def _model(name: str, state: dict, buffers=None) -> dict:
    entry = {"model_name": name, "model_module": "@jupyter-widgets/controls", "model_module_version": "2.0.0",
             "state": {"_model_name": name, **state}}
    if buffers:
        entry["buffers"] = buffers
    return entry


def _explorer_notebook(*, hide_image: bool = False) -> nbformat.NotebookNode:
    """An executed notebook showing an explorer: title, controls and a button, image, caption."""
    state = {
        "title": _model("HTMLModel", {"value": "<b>Toy regression</b>"}),
        "ga": _model("IntSliderModel", {"value": 4, "description": "GA", "readout_format": "d"}),
        "lr": _model("FloatSliderModel", {"value": 0.02, "description": "learning rate", "readout_format": ".3f"}),
        "mode": _model("DropdownModel", {"index": 1, "_options_labels": ["naive", "token-normalised"],
                                         "description": "strategy"}),
        "go": _model("ButtonModel", {"description": "Launch for real"}),
        "row": _model("HBoxModel", {"children": ["IPY_MODEL_ga", "IPY_MODEL_lr", "IPY_MODEL_mode", "IPY_MODEL_go"]}),
        "message": _model("HTMLModel", {"value": ""}),
        "hidden": _model("LayoutModel", {"display": "none"}),
        "image": _model("ImageModel", {"format": "png", **({"layout": "IPY_MODEL_hidden"} if hide_image else {})},
                        buffers=[{"path": ["value"], "encoding": "base64", "data": PNG}]),
        "caption": _model("HTMLModel", {"value": "<i>After 1 update: w = 2.0400 (target 2).</i>"}),
        "box": _model("VBoxModel", {"children": ["IPY_MODEL_title", "IPY_MODEL_row", "IPY_MODEL_message",
                                                 "IPY_MODEL_image", "IPY_MODEL_caption"]}),
    }
    nb = nbformat.v4.new_notebook()
    nb.metadata["widgets"] = {WIDGET_STATE: {"state": state, "version_major": 2, "version_minor": 0}}
    cell = nbformat.v4.new_code_cell("explorer = regression_explorer()\nexplorer", execution_count=1)
    view = {"model_id": "box", "version_major": 2, "version_minor": 0}
    cell.outputs = [nbformat.v4.new_output("display_data", data={"text/plain": "VBox(...)", WIDGET_VIEW: view})]
    plot = nbformat.v4.new_code_cell("# The loss over the updates\nplt.plot(losses)", execution_count=2)
    plot.outputs = [nbformat.v4.new_output("display_data", data={"image/png": PNG, "text/plain": "<Figure>"})]
    nb.cells = [nbformat.v4.new_markdown_cell("# Lesson\n\n## Trying it"), cell, plot]
    return nb


def test_an_explorer_becomes_its_last_plot_caption_and_settings():
    nb = _explorer_notebook()
    assert build_site.make_static(nb, "Why accumulate") == 1
    assert "widgets" not in nb.metadata  # nothing left for a widget manager (or a CDN) to load
    static = BeautifulSoup(nb.cells[1].outputs[0]["data"]["text/html"], "html.parser")
    assert set(nb.cells[1].outputs[0]["data"]) == {"text/html"}
    image = static.find("img")
    assert image["src"] == f"data:image/png;base64,{PNG}"
    assert image["alt"] == ("Plot: Toy regression. After 1 update: w = 2.0400 (target 2). Settings: GA 4, "
                            "learning rate 0.020, strategy token-normalised.")
    text = " ".join(static.get_text().split())
    assert "Toy regression" in text and "After 1 update: w = 2.0400 (target 2)." in text
    assert "GA 4" in text and "learning rate 0.020" in text and "strategy token-normalised" in text
    assert static.find("button", disabled=True).get_text() == "Launch for real"
    assert not PLACEHOLDERS.search(str(static))


def test_a_plain_plot_gets_alt_text_from_where_it_stands():
    nb = _explorer_notebook()
    build_site.make_static(nb, "Why accumulate")
    alt = nb.cells[2].outputs[0]["metadata"]["image/png"]["alt"]
    assert alt == 'Plot from lesson "Why accumulate", section "Trying it": The loss over the updates.'


def test_a_hidden_widget_is_left_out():
    nb = _explorer_notebook(hide_image=True)
    build_site.make_static(nb, "Why accumulate")
    assert "<img" not in nb.cells[1].outputs[0]["data"]["text/html"]


def test_a_widget_without_saved_state_stops_the_build():
    nb = _explorer_notebook()
    del nb.metadata["widgets"][WIDGET_STATE]["state"]["image"]
    with pytest.raises(build_site.SiteError, match="widget model image has no saved state"):
        build_site.make_static(nb, "Why accumulate")


def test_a_page_has_no_script_alt_text_everywhere_and_links_to_its_neighbours():
    pages = [build_site.Page(f"0{i}_x{i}.ipynb", f"Lesson {i}", "", "", True) for i in range(3)]
    body, widgets = build_site.render_page(copy.deepcopy(_explorer_notebook()), pages, 1)
    soup = BeautifulSoup(body, "html.parser")
    assert widgets == 1
    assert soup.find_all("script") == []  # no require.js, MathJax, mermaid or widget manager
    assert all(img.get("alt", "").strip() for img in soup.find_all("img")) and len(soup.find_all("img")) == 2
    nav = soup.select_one("nav.gaccum-nav")
    assert [a["href"] for a in nav.find_all("a")] == ["index.html", "00_x0.html", "02_x2.html"]
    assert soup.title.get_text() == "Lesson 1 · gaccum"


def test_the_index_follows_the_lesson_map_and_adds_unlisted_notebooks(tmp_path):
    for lesson in LESSONS:
        (tmp_path / lesson.notebook).write_text("{}")
    extra = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell("# 07 · A draft\n\nSoon.")])
    nbformat.write(extra, tmp_path / "07_draft.ipynb")
    pages = build_site.pages_for(tmp_path)
    assert [p.notebook for p in pages] == [x.notebook for x in LESSONS] + ["07_draft.ipynb"]
    assert (pages[-1].title, pages[-1].in_map) == ("07 · A draft", False)
    index = BeautifulSoup(build_site.render_index(pages), "html.parser")
    assert len(index.select("table.gaccum-lessons tbody tr")) == len(LESSONS)
    assert [a["href"] for a in index.select("main > ul a")] == ["07_draft.html"]
    (tmp_path / LESSONS[-1].notebook).unlink()
    with pytest.raises(build_site.SiteError, match=LESSONS[-1].notebook):
        build_site.pages_for(tmp_path)
