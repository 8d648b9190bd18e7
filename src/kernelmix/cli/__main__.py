"""``python -m kernelmix.cli ...`` (what ``torchrun ... -m kernelmix.cli train`` runs)."""

import sys

from . import main

sys.exit(main())
