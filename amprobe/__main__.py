import sys

from amprobe.cli import main

sys.exit(main())
