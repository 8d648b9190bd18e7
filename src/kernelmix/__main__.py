"""``python -m kernelmix ...``: the command line, as the ``kernelmix`` script runs it.

:func:`kernelmix.cli.main` parses ``gpu-check`` with :mod:`kernelmix.cli.gpu_check` alone and
everything else with the full CLI (:mod:`kernelmix.cli.app`), so ``PYTHONPATH=src python3 -m
kernelmix gpu-check --out DIR`` runs where pydantic is missing (the GPU machine)."""

import sys

from kernelmix.cli import main

sys.exit(main())
