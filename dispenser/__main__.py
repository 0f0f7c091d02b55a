"""``python -m dispenser`` is the ``dispenser`` command."""

import sys

from dispenser.cli import main

sys.exit(main())
