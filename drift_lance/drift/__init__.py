"""DRIFT search: HyDE primer over community reports (one ANN query), follow-up local searches in a
`QueryState` action graph, and a (streamed) reduce.

    search = await open_drift_search("index.lance", config=DRIFTSearchConfig(n_depth=2))
    result = await search.search("Who leads Dulce?")
"""

from drift_lance.drift.action import ActionAnswer, DriftAction, PrimerFoldAnswer
from drift_lance.drift.callbacks import DriftCallbacks
from drift_lance.drift.export import export_graph
from drift_lance.drift.result import SearchResult
from drift_lance.drift.search import DRIFTSearch, DriftStream, open_drift_search
from drift_lance.drift.state import QueryState

__all__ = [
    "ActionAnswer",
    "DRIFTSearch",
    "DriftAction",
    "DriftCallbacks",
    "DriftStream",
    "PrimerFoldAnswer",
    "QueryState",
    "SearchResult",
    "export_graph",
    "open_drift_search",
]
