"""`python -m drift_lance ...` runs the `drift-lance` CLI."""

from drift_lance.cli import run

run()
