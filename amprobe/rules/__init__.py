"""Rules engine: findings from a loaded run.

Importing this package registers every rule module in :data:`RULE_MODULES`.
"""

from __future__ import annotations

from amprobe.rules import checkpoints as _checkpoints  # noqa: F401
from amprobe.rules import compare as _compare  # noqa: F401
from amprobe.rules import compiled as _compiled  # noqa: F401
from amprobe.rules import compute as _compute  # noqa: F401
from amprobe.rules import data as _data  # noqa: F401  (registers requirements)
from amprobe.rules import devicefault as _devicefault  # noqa: F401
from amprobe.rules import distributed as _distributed  # noqa: F401
from amprobe.rules import numerics as _numerics  # noqa: F401
from amprobe.rules import origin as _origin  # noqa: F401
from amprobe.rules import precision as _precision  # noqa: F401
from amprobe.rules import replay as _replay  # noqa: F401
from amprobe.rules import replicas as _replicas  # noqa: F401
from amprobe.rules import runtime as _runtime  # noqa: F401
from amprobe.rules import scaler as _scaler  # noqa: F401
from amprobe.rules import whatif as _whatif  # noqa: F401

# isort: split
# registered last, after the what-if rules: the registry's order is the order of "not checked"
from amprobe.rules import blockfit as _blockfit  # noqa: F401
from amprobe.rules.engine import (
    REGISTRY,
    Diagnosis,
    Finding,
    NotChecked,
    RuleSpec,
    Severity,
    ThresholdError,
    diagnose,
    resolve_thresholds,
)

__all__ = [
    "REGISTRY",
    "Diagnosis",
    "Finding",
    "NotChecked",
    "RuleSpec",
    "Severity",
    "ThresholdError",
    "diagnose",
    "resolve_thresholds",
]
