"""``python -m dispenser`` is the ``dispenser`` command."""

import sys

from dispenser.cli import main

__all__: list[str] = []  # a script: nothing to import from it

sys.exit(main())
