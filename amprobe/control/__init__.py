"""Control: starting, steering and stopping a probe from outside the training loop.

- :mod:`~amprobe.control.launcher`: ``amprobe run`` (the child process, its signals, its run dir);
- :mod:`~amprobe.control.autoattach` and ``_bootstrap``: the zero-code probe in the processes
  ``amprobe run`` starts;
- :mod:`~amprobe.control.channel`: the control file a running probe watches, the CLI's sender,
  and attaching to a live process.

This ``__init__`` imports nothing (the launcher must load without torch).
"""
