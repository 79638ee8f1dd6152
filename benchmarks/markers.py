"""Markers of the sections of docs/benchmarks.md that one writer owns and the others keep.

Both page writers read them (report.py writes the CPU page around the other blocks, hf_report.py
inserts its own block before the GPU one), so they live here rather than in either writer: the
benchmarks package has no import cycle (tests/test_import_graph.py).
"""

from __future__ import annotations

GPU_BEGIN = ("<!-- gpu-section: written by `python -m benchmarks --device cuda --write-docs`; "
             "kept when the CPU page is regenerated -->")
GPU_END = "<!-- /gpu-section -->"
