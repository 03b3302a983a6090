"""Our top-level `ingest` package, imported from beside `drift_lance` rather than by `sys.path`.

`python -m drift_lance ingest ...` puts the working directory first on `sys.path`, so a user's own
`ingest.py` or `ingest/` folder there was imported instead (running its code), and the command
failed with "'ingest' is not a package" or "module 'ingest' has no attribute 'ingest'". The
`drift-lance` console script does not put the working directory on the path. As with the bundled
prompts (`drift_lance._bundled`), ours is the one installed next to this package.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

from drift_lance.errors import ConfigError

__all__ = ["import_ingest"]

_OURS = Path(__file__).resolve().parent.parent / "ingest"


def import_ingest() -> ModuleType:
    """The `ingest` package installed with drift_lance (its submodules then import from it too).
    ConfigError naming the file when another module named `ingest` was imported already."""
    loaded = sys.modules.get("ingest")
    if loaded is not None:
        where = getattr(loaded, "__file__", None)
        if where is None or Path(where).resolve().parent != _OURS:
            raise ConfigError(f"another module named 'ingest' is imported ({where or repr(loaded)}), not drift-lance's "
                              f"({_OURS}); rename it, or run the `drift-lance` command instead of `python -m drift_lance`")
        return loaded
    init = _OURS / "__init__.py"
    if not init.is_file():  # not installed beside us: whatever the path finds
        return importlib.import_module("ingest")
    spec = importlib.util.spec_from_file_location("ingest", init, submodule_search_locations=[str(_OURS)])
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["ingest"] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules["ingest"]
        raise
    return module
