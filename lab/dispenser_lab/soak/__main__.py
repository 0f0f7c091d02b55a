"""``python -m dispenser_lab.soak`` is ``scripts/soak``."""

import sys

from dispenser_lab.soak.run import main

sys.exit(main())
