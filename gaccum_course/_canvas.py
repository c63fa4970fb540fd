"""Machinery: the explorers' canvas, plain Agg that remembers how it drew text.

Matplotlib 3.11 lays out and rasterises text glyph by glyph in Python, and measures each
text's font again at every draw: text is about half of an explorer's redraw (the lessons'
explorers answer a slider move in some 60 ms with this canvas, 95 ms without: ``make bench``).
:class:`ExplorerCanvas` remembers the fonts' metrics, each string's layout and each rendered
glyph through Matplotlib's private internals, and draws the same pixels as plain Agg
(tests/test_widgets.py compares them for every explorer, and the fallback without them).

It also works out each axis's ticks once per draw, where Matplotlib does it up to three times
(:func:`ticks_worked_out_once`): a quarter of a redraw.
"""

from __future__ import annotations

import contextlib
import math

import matplotlib
import matplotlib.axes
import matplotlib.axis
import numpy as np
from matplotlib import ft2font
from matplotlib.backends.backend_agg import FigureCanvasAgg, RendererAgg, get_hinting_flag
from matplotlib.font_manager import fontManager, get_font


def text_internals_available() -> bool:
    """Whether this Matplotlib has the internals the text cache uses (3.11's); without them, plain Agg."""
    return all(hasattr(ft2font.FT2Font, name) for name in ("_layout", "_render_glyph", "_set_transform")) and \
        hasattr(ft2font, "RenderMode") and hasattr(RendererAgg, "_prepare_font")


_TEXT_CACHE = text_internals_available()  # False: plain Agg (to measure without it, or where it is unavailable)
_GLYPHS_KEPT = 50_000  # glyph bitmaps (of some 100 bytes each) before the cache starts over
_TICK_INTERNALS = all(hasattr(matplotlib.axis.Axis, name) for name in ("_update_ticks", "_get_ticklabel_bboxes")) and \
    all(hasattr(matplotlib.axes.Axes, name) for name in ("_update_title_position", "_twinned_axes"))


@contextlib.contextmanager
def ticks_worked_out_once(figure):
    """During one draw of ``figure``: each axis's ticks, and their labels' extents, worked out once.

    Matplotlib 3.11 works them out (locator, formatter, a layout of every tick label) up to three
    times per axis and draw: to place the axes' title above them, to place the axis label beside
    them, and to draw them. Within a draw the first answer serves all three; it is worked out
    again if the axis's limits or the axes' place on the figure change (a layout engine, a fixed
    aspect). The title's placement is skipped where nothing can sit above the axes (see
    :func:`_title_in_place`). Afterwards the axes are as they were: a draw outside this block is
    plain Matplotlib's.
    """
    if not _TICK_INTERNALS:  # another Matplotlib: plain draws
        yield
        return
    patched = [axis for ax in figure.axes for axis in (ax.xaxis, ax.yaxis)]
    for axis in patched:
        _remember_ticks(axis)
    for ax in figure.axes:
        _title_in_place(ax)
    try:
        yield
    finally:
        for axis in patched:
            del axis._update_ticks, axis._get_ticklabel_bboxes
        for ax in figure.axes:
            del ax._update_title_position


def _title_in_place(ax) -> None:
    """Shadow the axes' title placement: where nothing can sit above the axes, the titles stay at 1.0.

    Matplotlib lifts a title over what it finds at the top of the axes: x ticks or an x label on
    top, the y axis's offset text (a "1e-5" over the tick labels), twinned, child or aligned
    axes. It measures all the tick labels to find out. Without any of those it puts the titles
    at 1.0 of the axes' height (plus their pad), which is what this does without measuring.
    """
    place_titles = ax._update_title_position

    def titles_in_place(renderer):
        yaxis, xaxis = ax.yaxis, ax.xaxis
        yaxis._update_ticks()  # (remembered) sets the formatter's offset for these limits
        if (not getattr(ax, "_autotitlepos", None) or xaxis.get_ticks_position() in ("top", "unknown")
                or xaxis.get_label_position() == "top" or ax.child_axes
                or len(ax._twinned_axes.get_siblings(ax)) > 1
                or len(ax.get_figure(root=False)._align_label_groups["title"].get_siblings(ax)) > 1
                or (yaxis.offsetText.get_visible() and yaxis.major.formatter.get_offset())):
            return place_titles(renderer)
        for title in (ax.title, ax._left_title, ax._right_title):
            title.set_position((title.get_position()[0], 1.0))
        return None

    ax._update_title_position = titles_in_place


def _legend_state(legend) -> tuple:
    """What a legend's pixels depend on besides its place: its texts and their font, and its handles."""
    texts = tuple((t.get_text(), t.get_color(), hash(t.get_fontproperties())) for t in legend.get_texts())
    handles = tuple((id(h), h.get_visible(), str(h.get_color()) if hasattr(h, "get_color") else None)
                    for h in getattr(legend, "legend_handles", ()))
    return texts, handles, legend.get_frame_on(), legend.get_alpha()


def _remember_ticks(axis) -> None:
    """Shadow the axis's tick computations with ones that remember their last answer."""
    update_ticks, ticklabel_bboxes = axis._update_ticks, axis._get_ticklabel_bboxes
    memo = {}

    def where():  # what the answers depend on, besides the locator and formatter (fixed within a draw)
        return tuple(axis.get_view_interval()), axis.axes.bbox.bounds

    def remembered_update_ticks():
        key = where()
        if memo.get("ticks_for") != key:
            memo["ticks_for"], memo["ticks"] = key, update_ticks()
        return memo["ticks"]

    def remembered_ticklabel_bboxes(ticks, renderer):
        key = (where(), id(renderer), tuple(map(id, ticks)))
        if memo.get("bboxes_for") != key:
            memo["bboxes_for"], memo["bboxes"] = key, ticklabel_bboxes(ticks, renderer)
        return memo["bboxes"]

    axis._update_ticks, axis._get_ticklabel_bboxes = remembered_update_ticks, remembered_ticklabel_bboxes


class _TextCachingRenderer(RendererAgg):
    """Agg, remembering font metrics, each string's glyph layout and each rendered glyph.

    A glyph's bitmap depends on the font, size, rotation and the position's fraction of a
    pixel (FreeType's 1/64ths); a whole-pixel move only moves the bitmap. So a glyph is
    rendered once per such key and then copied, which is what Agg would draw anyway.
    """

    _metrics: dict = {}
    _layouts: dict = {}
    _glyphs: dict = {}

    def _get_font_height_metrics(self, prop):
        # What Text._get_layout computes from the font's tables on every call (Matplotlib 3.11).
        key = (hash(prop), prop.get_size_in_points(), self.dpi, matplotlib.rcParams["text.hinting_factor"])
        if key not in self._metrics:
            font = get_font(fontManager._find_fonts_by_props(prop))
            metrics = (None, None, None)
            for table_name, gap, ascent, descent in (("OS/2", "sTypoLineGap", "sTypoAscender", "sTypoDescender"),
                                                     ("hhea", "lineGap", "ascent", "descent")):
                table = font.get_sfnt_table(table_name)
                if table is None:
                    continue
                scale = prop.get_size_in_points() * self.dpi / 72 / font.get_sfnt_table("head")["unitsPerEm"]
                metrics = (table[ascent] * scale, -table[descent] * scale, table[gap] * scale)
                break
            self._metrics[key] = metrics
        return self._metrics[key]

    def draw_text(self, gc, x, y, s, prop, angle, ismath=False, mtext=None):
        if ismath or not gc.get_antialiased():
            return super().draw_text(gc, x, y, s, prop, angle, ismath=ismath, mtext=mtext)
        features = mtext.get_fontfeatures() if mtext is not None else None
        language = mtext.get_language() if mtext is not None else None
        size, flags, rc = prop.get_size_in_points(), get_hinting_flag(), matplotlib.rcParams
        key = (hash(prop), size, self.dpi, s, flags, rc["text.hinting_factor"], rc["text.kerning_factor"],
               None if features is None else tuple(features), str(language))
        items = self._layouts.get(key)
        if items is None:
            font = self._prepare_font(prop)
            items = self._layouts[key] = [(item.ft_object, item.glyph_index, item.x, item.y) for item in
                                          font._layout(s, flags=flags, features=features, language=language)]
        cos, sin = math.cos(math.radians(angle)), math.sin(math.radians(angle))
        matrix = (0x10000 * np.array([[cos, -sin], [sin, cos]])).round().astype(int)
        rotation = tuple(matrix.ravel().tolist())
        if len(self._glyphs) > _GLYPHS_KEPT:
            self._glyphs.clear()
        for font, glyph, dx, dy in items:  # y is downwards, FreeType's (and dy) upwards
            px = round(0x40 * (x + dx * cos - dy * sin))
            py = round(0x40 * (self.height - y + dx * sin + dy * cos))
            glyph_key = (font, size, self.dpi, glyph, rotation, px & 63, py & 63, flags)
            rendered = self._glyphs.get(glyph_key)
            if rendered is None:
                font.set_size(size, self.dpi)
                font._set_transform(matrix, [px & 63, py & 63])
                bitmap = font._render_glyph(glyph, flags, ft2font.RenderMode.NORMAL)
                rendered = self._glyphs[glyph_key] = (np.array(bitmap.buffer), bitmap.left, bitmap.top)
            buffer, left, top = rendered
            row = int(self.height) - top - (py >> 6) + buffer.shape[0]
            self._renderer.draw_text_image(buffer, left + (px >> 6), row, 0, gc)
        return None


class ExplorerCanvas(FigureCanvasAgg):
    """An Agg canvas drawing with :class:`_TextCachingRenderer` (plain Agg where that is unavailable).

    Each draw works out the ticks once (:func:`ticks_worked_out_once`) and pastes the figure's
    legends from the previous draw where what lies under them did not change
    (:meth:`_draw_legends`); the pixels are plain Agg's.
    """

    def __init__(self, figure=None):
        super().__init__(figure)
        self._legend_pixels = {}  # legend -> (region, pixels under it, pixels with it)

    def draw(self):
        legends = [legend for legend in self.figure.legends if legend.get_visible() and self._drawn_last(legend)]
        for legend in legends:
            legend.set_visible(False)
        try:
            with ticks_worked_out_once(self.figure):
                super().draw()
        finally:
            for legend in legends:
                legend.set_visible(True)
        self._draw_legends(legends)

    def _drawn_last(self, legend) -> bool:
        # Pasting it after the figure's draw gives the same pixels only if nothing is drawn over it.
        return all(a is legend or not a.get_visible() or a.get_zorder() < legend.get_zorder()
                   for a in self.figure.get_children() if a is not self.figure.patch)

    def _draw_legends(self, legends) -> None:
        """Draw each legend over the finished figure, or paste its pixels from the last draw.

        An explorer's legend stays the same while the lines change: drawing it (frame, handles,
        labels) is a seventh of a redraw. Its pixels are pasted back only where the pixels under
        its box, drawn without it, are exactly those of the last draw, and its own state (texts,
        handles, place) is what it was; anything else draws it again.
        """
        renderer = self.get_renderer()
        pixels = np.asarray(renderer.buffer_rgba())
        height, width = pixels.shape[:2]
        for legend in legends:
            box = legend.get_window_extent(renderer)
            # Whole pixels around the box, with room for antialiasing at its edges.
            x0, x1 = max(math.floor(box.x0) - 2, 0), min(math.ceil(box.x1) + 2, width)
            y0, y1 = max(height - math.ceil(box.y1) - 2, 0), min(height - math.floor(box.y0) + 2, height)
            region = (x0, x1, y0, y1, _legend_state(legend))
            under = pixels[y0:y1, x0:x1]
            kept = self._legend_pixels.get(legend)
            if kept is not None and kept[0] == region and np.array_equal(kept[1], under):
                under[...] = kept[2]
                continue
            saved_under = under.copy()
            legend.draw(renderer)
            self._legend_pixels[legend] = (region, saved_under, pixels[y0:y1, x0:x1].copy())
        for legend in set(self._legend_pixels) - set(legends):
            del self._legend_pixels[legend]

    def get_renderer(self):
        # FigureCanvasAgg's, with the renderer's class chosen (again) at every draw.
        kind = _TextCachingRenderer if _TEXT_CACHE else RendererAgg
        w, h = self.get_width_height(physical=True)
        key = w, h, self.figure.dpi
        if self._lastKey != key or type(getattr(self, "renderer", None)) is not kind:
            self.renderer = kind(w, h, self.figure.dpi)
            self._lastKey = key
        return self.renderer
