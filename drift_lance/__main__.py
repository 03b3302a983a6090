"""`python -m drift_lance ...` runs the `drift-lance` CLI."""

import sys

from drift_lance.cli import main

sys.exit(main())
