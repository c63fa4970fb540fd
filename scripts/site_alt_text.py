"""Alt text for every matplotlib figure a kernel displays, from its titles, axis labels and legend.

An IPython start-up script: `make notebooks` puts it in the start-up folder of the kernels that
nbmake runs, and scripts/build_site.py runs it in the kernels it starts, so that the static site
can give every picture a description (the figure's PNG output carries it as its "alt" metadata).
"""

def _gaccum_site_alt_text():
    from IPython import get_ipython

    def clean(text):
        return " ".join(str(text).replace("$", "").split())

    def describe(fig):
        panels = []
        for ax in fig.axes:
            if not ax.get_visible():
                continue
            title = clean(ax.get_title() or ax.get_title("left") or ax.get_title("right"))
            bits = [f'"{title}"'] if title else []
            axes = [f"{name} {clean(label)}" for name, label in (("x:", ax.get_xlabel()), ("y:", ax.get_ylabel()))
                    if clean(label)]
            if axes:
                bits.append("(" + ", ".join(axes) + ")")
            labels = [clean(x) for x in ax.get_legend_handles_labels()[1] if clean(x) and not x.startswith("_")]
            if labels:
                bits.append("showing " + ", ".join(dict.fromkeys(labels)))
            if bits:
                panels.append(" ".join(bits))
        legend = [clean(t.get_text()) for lg in fig.legends for t in lg.get_texts() if clean(t.get_text())]
        suptitle = getattr(fig, "_suptitle", None)
        head = clean(suptitle.get_text()) if suptitle is not None and suptitle.get_text() else ""
        text = (head + ". " if head else "") + f"Plot with {len(panels)} panel{'s' if len(panels) != 1 else ''}"
        text += (": " + "; ".join(panels)) if panels else ""
        text += (". Legend: " + ", ".join(dict.fromkeys(legend))) if legend else ""
        return text + "."

    formatter = get_ipython().display_formatter.formatters["image/png"]

    class AltTextPNGFormatter(type(formatter)):
        def __call__(self, obj):
            result = super().__call__(obj)
            if result is None or not type(obj).__module__.startswith("matplotlib.figure"):
                return result
            data, metadata = result if isinstance(result, tuple) else (result, None)
            try:
                alt = describe(obj)
            except Exception:  # noqa: BLE001 -- a description is a bonus: never break a figure for it
                return result
            return data, {**(metadata or {}), "alt": alt}

    formatter.__class__ = AltTextPNGFormatter


_gaccum_site_alt_text()
del _gaccum_site_alt_text
