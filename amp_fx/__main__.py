"""``python -m amp_fx``: the command line (see :mod:`amp_fx.inspection.cli`)."""

import os
import sys

from amp_fx.inspection.cli import main

if __name__ == "__main__":
    try:
        sys.exit(main())
    except BrokenPipeError:
        # Output piped into `head`: stop quietly, as Unix tools do.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(0)
