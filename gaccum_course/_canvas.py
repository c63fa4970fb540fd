"""Machinery: the explorers' canvas, plain Agg that remembers how it drew text.

Matplotlib 3.11 lays out and rasterises text glyph by glyph in Python, and measures each
text's font again at every draw: text is about half of an explorer's redraw (the lessons'
explorers answer a slider move in some 60 ms with this canvas, 95 ms without: ``make bench``).
:class:`ExplorerCanvas` remembers the fonts' metrics, each string's layout and each rendered
glyph through Matplotlib's private internals, and draws the same pixels as plain Agg
(tests/test_widgets.py compares them for every explorer, and the fallback without them).
"""

from __future__ import annotations

import math

import matplotlib
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
    """An Agg canvas drawing with :class:`_TextCachingRenderer` (plain Agg where that is unavailable)."""

    def get_renderer(self):
        # FigureCanvasAgg's, with the renderer's class chosen (again) at every draw.
        kind = _TextCachingRenderer if _TEXT_CACHE else RendererAgg
        w, h = self.get_width_height(physical=True)
        key = w, h, self.figure.dpi
        if self._lastKey != key or type(getattr(self, "renderer", None)) is not kind:
            self.renderer = kind(w, h, self.figure.dpi)
            self._lastKey = key
        return self.renderer
