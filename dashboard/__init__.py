"""amprobe's Dash dashboard: a live view of the runs under a directory, findings first.

Nothing is loaded at import: build the app with :func:`dashboard.app.create_app` or serve it
with :func:`dashboard.main.serve` (``amprobe dashboard ROOT``). Runs are read only through
amprobe's loading API (:func:`amprobe.load_run`, :func:`amprobe.store.read_table`) and
diagnosed with :func:`amprobe.diagnose`; the dashboard adds no analysis of its own.
"""

from __future__ import annotations

__all__: list[str] = []
