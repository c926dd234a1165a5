"""Native callbacks for framework training loops.

* :mod:`amprobe.integrations.lightning`: ``AmprobeCallback`` for Lightning's ``Trainer``.
* :mod:`amprobe.integrations.hf`: ``AmprobeCallback`` for the Hugging Face ``Trainer``.

``accelerate`` needs none: :func:`amprobe.attach` with nothing passed finds the prepared
optimizer, scaler and model. Importing ``amprobe`` (or this package) never imports a framework;
each submodule imports only its own, and needs the ``integrations`` extra
(``pip install amprobe[integrations]``).
"""

from __future__ import annotations

__all__: list[str] = []
