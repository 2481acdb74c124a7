"""`python -m pipespec.cli`: the `pipespec` command."""

import sys

from pipespec.cli import main

sys.exit(main())
