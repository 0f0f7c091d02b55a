"""``python -m soak`` is ``scripts/soak``."""

import sys

from soak.run import main

sys.exit(main())
