"""Only errors from Lance's native logger, unless the environment asks for more.

Lance logs "No existing dataset at ..., it will be created" at WARN for every table a first ingest
(or `ingest.synthetic`) creates; that is expected, so, as `drift-lance ingest` does, only errors reach
the user. Lance and LanceDB read LANCE_LOG / LANCEDB_LOG once, when their native modules load: the
`ingest` package imports this module before anything imports them (an application that imported
lancedb earlier keeps the level it started with). A level set in the environment is kept.
"""

from __future__ import annotations

import os

os.environ.setdefault("LANCE_LOG", "error")
os.environ.setdefault("LANCEDB_LOG", "error")
