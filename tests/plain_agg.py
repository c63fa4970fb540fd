"""What Matplotlib's own Agg canvas draws for a figure, in the suite's style.

The explorers draw on their own canvas (gaccum_course._canvas), which takes shortcuts; its pixels
must be exactly these. test_canvas.py and test_widgets.py compare against them (pytest puts this
folder on sys.path, as it does for tests/browser's chromium.py).
"""

import matplotlib
import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg

from gaccum_course.style import RC


def plain_agg_pixels(figure) -> np.ndarray:
    canvas = FigureCanvasAgg(figure)  # the figure's canvas from now on
    with matplotlib.rc_context(RC):
        canvas.draw()
    return np.asarray(canvas.buffer_rgba()).copy()
