"""drift-lance: GraphRAG DRIFT search on LanceDB."""

__version__ = "0.1.0"
