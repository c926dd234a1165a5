"""Analysis: pure functions of a loaded run, shared by the rules, the report and the dashboard.

One module per question (``frames``, ``scaler``, ``numerics``, ``compute``, ``runtime``,
``ranks``, ``compare``, ``health``). Each function takes a :class:`~amprobe.store.Run` (or a
frame of one) and returns plain data or a DataFrame; results derived from a whole run are
cached on the run (:meth:`~amprobe.store.Run.cached`) so that the rules, the health metrics
and the report compute them once. Nothing here imports the rules engine or the report.

Layering: ``store`` < ``analysis`` < ``rules`` < ``report`` < ``cli`` / ``dashboard``.
"""
