"""Entry point for `python -m jetflow_pl`."""

from jetflow_pl.cli import main

main()
