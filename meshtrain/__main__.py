"""``python -m meshtrain ...``: the ``meshtrain`` command, for environments where the console script is not on
PATH (a venv used without activating it, a source checkout)."""

import sys

from meshtrain.cli import main

if __name__ == "__main__":
    sys.exit(main())
