"""``python -m dispenser.soak`` is ``scripts/soak``."""

import sys

from dispenser.soak.run import main

sys.exit(main())
