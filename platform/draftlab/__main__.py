"""`python -m draftlab ARGS` = the `draftlab` command, where draftlab is on the path but not
installed (a GPU machine: `PYTHONPATH=platform python -m draftlab doctor --gpu`)."""

import sys

from draftlab.cli import main

if __name__ == "__main__":
    sys.exit(main())
