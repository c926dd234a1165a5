"""The capture side: what runs inside the training process and turns it into records.

Dependencies point one way, lowest first:

- :mod:`~amprobe.capture.protocol`: the collector protocol (``Collector``, ``StepFacts``, ``due``);
- :mod:`~amprobe.capture.sites`, :mod:`~amprobe.capture.patching`: leaf helpers (call sites,
  dtype names, reversible patches);
- :mod:`~amprobe.capture.collectors`: the subscribers, each depending on the protocol only;
- :mod:`~amprobe.capture.discovery`: finding the models, optimizers and scalers of a process;
- :mod:`~amprobe.capture.hub`: every interception of torch, installed once, dispatching to
  collectors through the protocol;
- :mod:`~amprobe.capture.probe`: the attach scope, which owns the hub and the run writer.

This ``__init__`` imports nothing: importing one module of the package loads only what that
module needs.
"""
