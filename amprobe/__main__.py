"""``python -m amprobe``: the same as the ``amprobe`` console script."""

import sys

from amprobe.cli import main

sys.exit(main())
