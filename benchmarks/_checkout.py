"""Import this first in a benchmark script: it puts the checkout root on ``sys.path``.

The benchmarks drive the product through the lab harness ``lattica_lab/``, which sits beside
``lattica/`` in the checkout and is never installed. ``python benchmarks/x.py`` puts only
``benchmarks/`` on ``sys.path``; this adds the directory above it.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = str(Path(__file__).resolve().parent.parent)
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
