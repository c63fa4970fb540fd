"""The garbage collector and the packages' imports: infrastructure, nothing about accumulation.

After importing torch a process holds some 170,000 objects the collector tracks (380,000 with
transformers), and each of Python's full collections walks all of them: several while later
imports and a lesson's objects pile up, and one at the end of every ``Trainer.train()`` (Accelerate's
``free_memory`` calls ``gc.collect()``). Measured in each lesson's kernel: 0.5 to 1.0 s of full
collections, 2.8 s in lesson 08. Modules live as long as the process, so each package, once
imported, moves what exists then out of the collector's sight (``gc.freeze``, made for this);
everything made later is collected as always.
"""

from __future__ import annotations

import gc


def freeze_imports() -> None:
    """Exclude every object that exists now from later collections (call it right after importing)."""
    gc.freeze()
