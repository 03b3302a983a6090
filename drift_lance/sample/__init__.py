"""The bundled sample index used by `drift-lance demo`: "Harrowgate Point", an original short history
of a fictional coastal town's campaign to restore and relight its lighthouse.

    from drift_lance.sample import build_sample_index, SAMPLE_QUERY
    index_dir = build_sample_index(tmp_dir / "harrowgate")   # graphrag 3.x parquet files, no vectors

The source is human-editable (`corpus/`: markdown text units, `corpus.yaml`, `communities.yaml`);
`build_sample_index` derives everything graphrag computes mechanically, so the files are consistent.
"""

from __future__ import annotations

from drift_lance.sample.builder import (
    GRAPHRAG3_SCHEMAS,
    SOURCE_DIR,
    SampleCorpus,
    SampleCorpusError,
    build_sample_index,
    derive_tables,
    load_sample_corpus,
)

__all__ = [
    "GRAPHRAG3_SCHEMAS",
    "SAMPLE_DESCRIPTION",
    "SAMPLE_NAME",
    "SAMPLE_QUERY",
    "SAMPLE_QUESTIONS",
    "SOURCE_DIR",
    "SampleCorpus",
    "SampleCorpusError",
    "build_sample_index",
    "derive_tables",
    "load_sample_corpus",
]

SAMPLE_NAME = "harrowgate-point"

SAMPLE_DESCRIPTION = """\
Harrowgate Point: a small GraphRAG 3.x index bundled with drift-lance (an original, fictional story).

Four documents (13 text units, ~3,100 words) tell how the town of Kestrel Bay saved its 1868
lighthouse after the Coastal Lights Authority switched it off in 2019: the Harrowgate Light Trust
and its heritage grant, a storm that brought the North Cliff to within seven metres of the tower,
an Arctic tern colony that set the works calendar, the fishermen who wanted their light back, and a
school oral-history project built on the last keeper's logbooks. The graph has 38 entities, 70
relationships, 19 claims and 12 communities (4 at level 0: restoration, headland, keepers and
fleet, town; 8 sub-communities at level 1), each with a graphrag-style community report.
"""

# Needs all three main themes: with the embedded e5 embedder its four nearest community reports are
# restoration (0), headland (1), fleet (11) and keepers (2), so DRIFT's primer has to fan out.
SAMPLE_QUERY = (
    "What obstacles did the Harrowgate Light Trust face in restoring and relighting the lighthouse, "
    "from the terns and the eroding cliff to the fishermen and the Coastal Lights Authority, "
    "and how was each resolved?"
)

# More questions for trying other search modes on the sample.
SAMPLE_QUESTIONS = (
    SAMPLE_QUERY,
    "How did the tern colony and the storm-damaged North Cliff shape the restoration's timetable and funding?",
    "Who is Ruth Marsh and how is her family connected to the lighthouse?",
    "What conditions did the March 2023 planning hearing attach to the restoration, and why?",
    "Which claims about the project are disputed or false?",
    "What are the main themes of the Harrowgate Point story?",
)
