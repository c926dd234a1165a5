"""Control: starting, steering and stopping a probe from outside the training loop.

- :mod:`~amprobe.control.launcher`: ``amprobe run`` (the child process, its signals, its run dir);
- :mod:`~amprobe.control.autoattach` and ``_bootstrap``: the zero-code probe in the processes
  ``amprobe run`` starts;
- :mod:`~amprobe.control.watcher`: the control file a dormant probe watches (in the job);
- :mod:`~amprobe.control.sender`: ``amprobe attach RUN`` / ``detach RUN`` writing that file (in
  the CLI; loads no torch);
- :mod:`~amprobe.control.remote`: attaching to a live process started without amprobe
  (``attach_live``, ``amprobe attach --pid``).

This ``__init__`` imports nothing (the launcher must load without torch).
"""
