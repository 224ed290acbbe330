"""`python -m megagenome ...` runs the command line."""

import sys

from megagenome.cli import main

sys.exit(main())
