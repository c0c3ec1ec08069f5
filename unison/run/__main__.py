"""``python -m unison.run``: the same as the ``unisonrun`` command."""

import sys

from unison.run.launcher import main

if __name__ == "__main__":
    sys.exit(main())
