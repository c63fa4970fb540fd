"""The garbage collector and the packages' imports: infrastructure, nothing about accumulation.

After importing torch a process holds some 170,000 objects the collector tracks (380,000 with
transformers), and each of Python's full collections walks all of them: several while later
imports and a lesson's objects pile up, and one at the start of every ``Trainer.train()``
(Accelerate's ``free_memory`` calls ``gc.collect()``). Measured in each lesson's kernel: 0.5 to
1.1 s of full collections, 2.8 s in lesson 08.

``gc.freeze`` moves every object alive at that moment out of the collector's sight; objects made
later are collected as always. Called right after a package's imports (gaccum_lib, gaccum_course's
style, real_stack's first model), what it freezes is almost all module-level state, which lives as
long as the process anyway. The cost: a frozen object that later becomes part of an unreachable
reference cycle is never freed, so freeze at import time, not in the middle of work. Importing
gaccum_lib (or gaccum_check, which imports it) freezes the importing process this way too.
"""

from __future__ import annotations

import gc


def freeze_imports() -> None:
    """Exclude every object alive now from later collections (call it right after importing)."""
    gc.freeze()
