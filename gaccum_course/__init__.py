"""gaccum_course: what runs the classroom, apart from the library a learner reads.

Nothing here teaches accumulation itself; the lessons use it so that their cells stay short:

* :mod:`~gaccum_course.plots` and :mod:`~gaccum_course.widgets` -- every figure and explorer
  (they import matplotlib and ipywidgets, so import them by name, not from here); what they are
  made of: :mod:`~gaccum_course.style` (palette, line styles), :mod:`~gaccum_course.live_plots`
  (plots drawn once, then updated) and :mod:`~gaccum_course.explorer` (controls -> compute -> draw)
* :mod:`~gaccum_course.exercises` -- the checks behind each lesson's exercises
* :mod:`~gaccum_course.lessons` -- the map of the notebooks (README, lesson 00, the site)
* :mod:`~gaccum_course.benchmarks` -- the saved results of ``make bench`` (lesson 07)
* :mod:`~gaccum_course.env` -- what this kernel runs on (lesson 00)
* :mod:`~gaccum_course.gallery` -- lesson 06's launches with Accelerate's own ``notebook_launcher``

The concepts live in :mod:`gaccum_lib`; the verifier of your own loop in :mod:`gaccum_check`.
"""
