"""Machinery: the explorers' canvas, plain Agg that does less work for the same pixels.

An explorer draws its figure again at every slider move, and most of a redraw is Matplotlib's
Python, not the pixels. :class:`ExplorerCanvas`, through Matplotlib 3.11's private internals:

- remembers the fonts' metrics, each string's layout and each rendered glyph (text was about
  half of a redraw: 60 ms an answer with this cache, 95 ms without, when it was added);
- works out each axis's ticks once per draw, where Matplotlib does it several times
  (:func:`ticks_worked_out_once`): a fifth to a third less drawing time;
- pastes an axis (ticks, tick labels, grid lines, label) or a figure legend from the last
  draw where its state and the pixels under it are unchanged (:meth:`ExplorerCanvas._pasted_or_drawn`);
- encodes the PNG itself (:func:`png_bytes`).

The pixels are plain Agg's for what the explorers do: tests/test_widgets.py compares every
explorer after slider moves, and tests/test_canvas.py each shortcut where it must not be taken.
Without the internals it draws with plain Agg.
"""

from __future__ import annotations

import contextlib
import functools
import math
import struct
import zlib
from typing import NamedTuple

import matplotlib
import matplotlib.axes
import matplotlib.axis
import matplotlib.legend
import matplotlib.transforms
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

    Matplotlib 3.11 works them out (locator, formatter, a layout of every tick label) several
    times per axis and draw (a y axis under a title four times): to place the axes' title above
    them, to place the axis label beside them (twice), and to draw them. Within a draw the first
    answer serves them all; it is worked out
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
    top, the y axis's offset text (a "1e-5" over the tick labels), and what it finds there on
    twinned, child or aligned axes; it measures all the tick labels to find out. Without any of
    those it puts the titles at 1.0 of the axes' height (plus their pad), lifted only if a title
    would reach below the axes' top (a pad smaller than its descent): this does the same
    without measuring the tick labels, and leaves every other case to Matplotlib.
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
        titles = (ax.title, ax._left_title, ax._right_title)
        for title in titles:
            title.set_position((title.get_position()[0], 1.0))
        top = ax.get_window_extent(renderer).ymax
        if any(t.get_text() and t.get_window_extent(renderer).ymin < top for t in titles):
            return place_titles(renderer)
        return None

    ax._update_title_position = titles_in_place


def _text_state(text) -> tuple:
    return (text.get_visible(), text.get_text(), str(text.get_color()), hash(text.get_fontproperties()),
            text.get_rotation())


def _state_of(artist) -> tuple:
    """What of a legend or an axis the explorers change, and so what its pasted pixels must match.

    For an axis: its limits, scale and place, each tick's place, texts and visibility, what
    tick_params and grid set, its label and offset text. For a legend: its texts, its handles'
    visibility and colour, its frame and anchor. Not seen (the explorers never do these; draw
    such a figure with plain Agg): styles set directly on one tick's lines or labels other than
    the above, spines moved, labels aligned across axes, a legend handle's width or marker.
    """
    if isinstance(artist, matplotlib.legend.Legend):
        texts = tuple(_text_state(t) for t in artist.get_texts())
        handles = tuple((id(h), h.get_visible(), str(h.get_color()) if hasattr(h, "get_color") else None)
                        for h in getattr(artist, "legend_handles", ()))
        anchor = artist.get_bbox_to_anchor()
        return texts, handles, artist.get_frame_on(), artist.get_alpha(), anchor.bounds, artist._loc
    axis, ax = artist, artist.axes
    ticks = tuple((t.get_loc(), *(_text_state(text) for text in (t.label1, t.label2)),
                   *(line.get_visible() for line in (t.tick1line, t.tick2line, t.gridline)))
                  for t in axis._update_ticks())
    # What tick_params and grid set for all the ticks (their size, direction, colours, the grid's).
    styles = (tuple(repr(sorted(kw.items())) for kw in (axis._major_tick_kw, axis._minor_tick_kw))
              if hasattr(axis, "_minor_tick_kw") else object())  # unknown: never equal, always drawn
    return (tuple(axis.get_view_interval()), axis.get_scale(), ax.bbox.bounds, ticks, styles, _text_state(axis.label),
            axis.labelpad, axis.label.get_position() if not axis._autolabelpos else None,
            _text_state(axis.offsetText))


def _box_of(artist, renderer):
    """The box a legend or an axis paints: for an axis, its ticks, labels, offset text, grid lines."""
    if isinstance(artist, matplotlib.legend.Legend):
        return artist.get_window_extent(renderer)
    axis, ax = artist, artist.axes
    # The grid lines inside the axes, the tick marks around them, the tick labels and labels beyond.
    tick_length = max((t.tick1line.get_markersize() + t.tick1line.get_markeredgewidth()
                       for t in axis.majorTicks[:1] + axis.minorTicks[:1]), default=0.0)
    boxes = [ax.bbox.padded(tick_length * ax.get_figure(root=True).dpi / 72)]
    tight = axis.get_tightbbox(renderer)
    if tight is not None:
        boxes.append(tight)
    return matplotlib.transforms.Bbox.union(boxes)


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


class _Kept(NamedTuple):
    """An artist as it was drawn last: its state, the pixels it painted, those under it and with it."""

    state: tuple
    region: tuple  # x0, x1, y0, y1 in the buffer's pixels (y downwards)
    under: np.ndarray
    drawn: np.ndarray


class ExplorerCanvas(FigureCanvasAgg):
    """An Agg canvas drawing with :class:`_TextCachingRenderer` (plain Agg where that is unavailable).

    Each draw works out the ticks once (:func:`ticks_worked_out_once`) and pastes the pixels of
    an axis or a figure legend that did not change from the last draw (:meth:`_pasted_or_drawn`).
    For the changes the explorers make the pixels are plain Agg's (tests/test_widgets.py,
    tests/test_canvas.py); what it does not see is listed in :func:`_state_of`.
    """

    def __init__(self, figure=None):
        super().__init__(figure)
        self._kept = {}  # artist -> _Kept

    def draw(self):
        with ticks_worked_out_once(self.figure), self._pasting_what_did_not_change():
            super().draw()

    @contextlib.contextmanager
    def _pasting_what_did_not_change(self):
        """During one draw, the figure's legends and its axes' x and y axes drawn by :meth:`_pasted_or_drawn`."""
        artists = list(self.figure.legends)
        if _TICK_INTERNALS:
            artists += [axis for ax in self.figure.axes for axis in (ax.xaxis, ax.yaxis)]
        own_draws = {artist: vars(artist).get("draw") for artist in artists}  # an instance's own, kept
        for artist in artists:
            # Matplotlib marks a legend stale when one of its properties is set: then it is drawn. An
            # axis is marked stale by every set_xlim, even to the same limits (the explorers set them
            # at every answer): its state (:func:`_state_of`) says whether it changed.
            unchanged = not artist.stale if isinstance(artist, matplotlib.legend.Legend) else True
            artist.draw = functools.partial(self._pasted_or_drawn, artist, artist.draw, unchanged)
        for artist in set(self._kept) - set(artists):
            del self._kept[artist]
        try:
            yield
        finally:
            for artist, own in own_draws.items():
                if own is None:
                    del artist.draw
                else:
                    artist.draw = own

    def _pasted_or_drawn(self, artist, draw, unchanged: bool, renderer) -> None:
        """Draw ``artist``, or paste the pixels it gave last time if nothing they depend on changed.

        An explorer's legend and most of its axes (ticks, tick labels, grid lines, axis labels)
        stay the same while the lines change, and drawing them is most of a redraw. The pixels
        are pasted only where the artist is as it was (the same place, texts, ticks, limits and
        tick styles: :func:`_state_of`; a legend not marked stale) and the pixels under it, what
        was drawn before it in this draw, are exactly those of the last time; anything else draws
        it again. The box it paints is worked out again only when its state changed.
        """
        if not artist.get_visible() or renderer is not getattr(self, "renderer", None):
            return draw(renderer)
        pixels = np.asarray(renderer.buffer_rgba())
        state = (_state_of(artist), pixels.shape, type(renderer))  # a renderer of another kind: drawn
        kept = self._kept.get(artist)
        same = kept is not None and kept.state == state
        if same:
            x0, x1, y0, y1 = kept.region
        else:
            box, (height, width) = _box_of(artist, renderer), pixels.shape[:2]
            # Whole pixels around its box, with room for antialiasing at the edges.
            x0, x1 = max(math.floor(box.x0) - 3, 0), min(math.ceil(box.x1) + 3, width)
            y0, y1 = max(height - math.ceil(box.y1) - 3, 0), min(height - math.floor(box.y0) + 3, height)
        window = pixels[y0:y1, x0:x1]
        if unchanged and same and np.array_equal(kept.under, window):
            window[...] = kept.drawn
            artist.stale = False
            return None
        under = window.copy()
        draw(renderer)
        self._kept[artist] = _Kept(state, (x0, x1, y0, y1), under, window.copy())
        return None

    def get_renderer(self):
        # FigureCanvasAgg's, with the renderer's class chosen (again) at every draw.
        kind = _TextCachingRenderer if _TEXT_CACHE else RendererAgg
        w, h = self.get_width_height(physical=True)
        key = w, h, self.figure.dpi
        if self._lastKey != key or type(getattr(self, "renderer", None)) is not kind:
            self.renderer = kind(w, h, self.figure.dpi)
            self._lastKey = key
        return self.renderer


def png_bytes(rgba: np.ndarray) -> bytes:
    """An opaque (height, width, 4) RGBA picture as a PNG of its RGB, rows unfiltered, zlib level 1.

    Pillow's PNG encoder tries every row filter on every row, which on an explorer's picture
    (mostly flat colour) costs more than the compression itself: 9.8 ms against 5.8 ms for
    this, for a file of the same size (55 KB). Any PNG decoder reads it back pixel for pixel.
    """
    height, width = rgba.shape[:2]
    rows = np.empty((height, 1 + 3 * width), np.uint8)
    rows[:, 0] = 0  # filter type 0 (None) for every row
    rows[:, 1:] = rgba[:, :, :3].reshape(height, 3 * width)

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8-bit RGB, no interlace
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(rows.tobytes(), 1))
            + chunk(b"IEND", b""))
