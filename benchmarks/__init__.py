"""Benchmarks of sandlock against the alternatives (issue 5).

Run ``python -m benchmarks`` from the checkout for the full report, or
``python -m benchmarks --quick`` for the CI smoke run (under two minutes, no
installs, no thresholds). Modules: :mod:`.measure` (timing and interleaving),
:mod:`.worker` (the measuring processes), :mod:`.contenders` (finding and
installing the other sandboxes), :mod:`.suite` (the benchmarks),
:mod:`.report` (markdown and plots).
"""
