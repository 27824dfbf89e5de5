"""`python -m jetflow_pl.serve`: the same as `jetflow-serve`."""

import sys

from jetflow_pl.serve.cli import main

sys.exit(main())
