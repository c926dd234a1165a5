"""The capture side: what runs inside the training process and turns it into records.

Dependencies point one way, lowest first:

- :mod:`~amprobe.capture.protocol`: the collector protocol (``Collector``, ``StepFacts``, ``due``);
- :mod:`~amprobe.capture.sites`, :mod:`~amprobe.capture.patching`: leaf helpers (call sites,
  dtype names, reversible patches);
- :mod:`~amprobe.capture.collectors`: the subscribers, each depending on the protocol only;
- :mod:`~amprobe.capture.discovery`: finding the models, optimizers and scalers of a process;
- the hub's parts, one role each: :mod:`~amprobe.capture.dispatch` (the guard and the event
  dispatch), :mod:`~amprobe.capture.install` (the stack of patches and hooks, GradScaler's
  wrapped methods), :mod:`~amprobe.capture.opmode` (the one dispatch mode),
  :mod:`~amprobe.capture.modules` (the module stack on the steps a collector asks for),
  :mod:`~amprobe.capture.compilewatch` (torch.compile awareness),
  :mod:`~amprobe.capture.sources` (engines that own the loss scale),
  :mod:`~amprobe.capture.boundary` (the step boundary and its facts),
  :mod:`~amprobe.capture.interceptions` (the class-level wrappers, root-model hooks);
- :mod:`~amprobe.capture.hub`: the owner of those parts: every interception of torch,
  installed once, dispatching to collectors through the protocol, removed newest first;
- :mod:`~amprobe.capture.probe`: the attach scope, which owns the hub and the run writer.

This ``__init__`` imports nothing: importing one module of the package loads only what that
module needs.
"""
