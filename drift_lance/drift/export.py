"""Export a DRIFT action graph (`QueryState.serialize(include_context=False)`, also found in
`SearchResult.state`) as JSON, GraphML or a self-contained HTML picture, chosen by file extension.

The HTML has the SVG and a few lines of JS inline (no CDN, works offline): nodes are laid out in
columns by depth, coloured by score (grey: open, red: failed); clicking a node shows its answer.
"""

from __future__ import annotations

import html
import json
import math
from collections import defaultdict
from pathlib import Path
from typing import Any

import networkx as nx

from drift_lance.errors import ConfigError

__all__ = ["EXPORT_FORMATS", "export_graph", "to_graphml_graph", "to_html"]

EXPORT_FORMATS = (".json", ".graphml", ".html")


def export_graph(state: dict[str, Any], path: str | Path) -> Path:
    """Write `state` to `path`; the extension picks the format (.json, .graphml, .html/.htm)."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix == ".json":
        text = json.dumps(state, indent=2, ensure_ascii=False, allow_nan=False)
        path.write_text(text + "\n", encoding="utf-8")
    elif suffix == ".graphml":
        nx.write_graphml(to_graphml_graph(state), path)
    elif suffix in (".html", ".htm"):
        path.write_text(to_html(state), encoding="utf-8")
    else:
        raise ConfigError(f"graph output {path}: unknown extension {suffix!r}; use one of {', '.join(EXPORT_FORMATS)}")
    return path


def to_graphml_graph(state: dict[str, Any]) -> nx.MultiDiGraph:
    """A networkx graph with GraphML-safe attributes: strings and numbers only, `score` a double on
    scored actions and absent on unscored and failed ones (those carry `error`), so tools that sort
    or colour by it read numbers."""
    graph = nx.MultiDiGraph()
    for node in state.get("nodes", []):
        metadata = node.get("metadata") or {}
        graph.add_node(
            str(node["id"]),
            query=node.get("query") or "",
            answer=node.get("answer") or "",
            **_graphml_score(node.get("score")),
            depth=int(node.get("depth") or 0),
            error=str(metadata.get("error", "")),
            llm_calls=int(metadata.get("llm_calls", 0)),
            prompt_tokens=int(metadata.get("prompt_tokens", 0)),
            output_tokens=int(metadata.get("output_tokens", 0)),
        )
    for edge in state.get("edges", []):
        graph.add_edge(str(edge["source"]), str(edge["target"]), weight=float(edge.get("weight", 1.0)))
    return graph


def _graphml_score(score: Any) -> dict[str, float]:
    # One type per GraphML key: a double, left out where there is no finite score (a failed
    # action's -inf is no number GraphML readers agree on).
    try:
        value = float(score)
    except (TypeError, ValueError):
        return {}
    return {"score": value} if math.isfinite(value) else {}


# ---------------------------------------------------------------- HTML

_NODE_W, _NODE_H, _COL_GAP, _ROW_GAP, _PAD = 220, 44, 80, 14, 20


def to_html(state: dict[str, Any], title: str | None = None) -> str:
    nodes = state.get("nodes", [])
    positions = _layout(nodes)
    width = max((x for x, _ in positions.values()), default=0) + _NODE_W + 2 * _PAD
    height = max((y for _, y in positions.values()), default=0) + _NODE_H + 2 * _PAD
    root_query = nodes[0]["query"] if nodes else "DRIFT query"
    title = title or f"DRIFT: {root_query}"

    edges_svg = []
    for edge in state.get("edges", []):
        if edge["source"] not in positions or edge["target"] not in positions:
            continue
        (x1, y1), (x2, y2) = positions[edge["source"]], positions[edge["target"]]
        sx, sy, tx, ty = x1 + _NODE_W, y1 + _NODE_H / 2, x2, y2 + _NODE_H / 2
        mid = (sx + tx) / 2
        edges_svg.append(
            f'<path d="M{sx:.0f},{sy:.0f} C{mid:.0f},{sy:.0f} {mid:.0f},{ty:.0f} {tx:.0f},{ty:.0f}" '
            'fill="none" stroke="#9aa4b2" stroke-width="1.2" marker-end="url(#arrow)"/>'
        )

    nodes_svg = []
    details = {}
    for node in nodes:
        x, y = positions[node["id"]]
        metadata = node.get("metadata") or {}
        label = _shorten(node.get("query", ""), 34)
        score = node.get("score")
        score_text = "open" if node.get("answer") is None and "error" not in metadata else f"score {score}"
        nodes_svg.append(
            f'<g class="node" data-id="{node["id"]}" transform="translate({x},{y})">'
            f'<rect width="{_NODE_W}" height="{_NODE_H}" rx="6" fill="{_colour(node)}" stroke="#33415c"/>'
            f'<text x="8" y="18">{html.escape(label)}</text>'
            f'<text x="8" y="35" class="meta">#{node["id"]} · {html.escape(score_text)}</text>'
            f"<title>{html.escape(node.get('query', ''))}</title></g>"
        )
        details[str(node["id"])] = {
            "query": node.get("query"),
            "answer": node.get("answer"),
            "score": score,
            "error": metadata.get("error"),
            "llm_calls": metadata.get("llm_calls", 0),
            "prompt_tokens": metadata.get("prompt_tokens", 0),
            "output_tokens": metadata.get("output_tokens", 0),
        }

    data_json = json.dumps(details, ensure_ascii=False, allow_nan=False).replace("</", "<\\/")
    return _HTML_TEMPLATE.format(
        title=html.escape(title),
        width=int(width),
        height=int(height),
        edges="\n".join(edges_svg),
        nodes="\n".join(nodes_svg),
        data=data_json,
        count=len(nodes),
        edge_count=len(state.get("edges", [])),
    )


def _layout(nodes: list[dict[str, Any]]) -> dict[Any, tuple[float, float]]:
    columns: dict[int, list[Any]] = defaultdict(list)
    for node in nodes:
        columns[int(node.get("depth") or 0)].append(node["id"])
    return {
        node_id: (_PAD + depth * (_NODE_W + _COL_GAP), _PAD + row * (_NODE_H + _ROW_GAP))
        for depth, ids in columns.items()
        for row, node_id in enumerate(ids)
    }


def _colour(node: dict[str, Any]) -> str:
    metadata = node.get("metadata") or {}
    if "error" in metadata:
        return "#f4b6b6"
    score = node.get("score")
    if node.get("answer") is None or not isinstance(score, (int, float)) or not math.isfinite(score):
        return "#e5e7eb"
    share = max(0.0, min(1.0, score / 100.0))  # light to strong green by score
    red, green, blue = int(230 - 110 * share), int(245 - 45 * share), int(230 - 110 * share)
    return f"#{red:02x}{green:02x}{blue:02x}"


def _shorten(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


_HTML_TEMPLATE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{title}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 0; display: flex; height: 100vh; }}
#graph {{ flex: 2; overflow: auto; border-right: 1px solid #ccd; }}
#detail {{ flex: 1; padding: 1em; overflow: auto; white-space: pre-wrap; }}
.node {{ cursor: pointer; }} .node text {{ font-size: 12px; fill: #111; }} .node text.meta {{ fill: #555; font-size: 11px; }}
.node.selected rect {{ stroke: #e11d48; stroke-width: 2.5; }}
</style></head>
<body>
<div id="graph"><svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}">
<defs><marker id="arrow" viewBox="0 0 10 10" refX="10" refY="5" markerWidth="7" markerHeight="7" orient="auto-start-reverse"><path d="M0,0 L10,5 L0,10 z" fill="#9aa4b2"/></marker></defs>
{edges}
{nodes}
</svg></div>
<div id="detail"><h3>{title}</h3><p>{count} actions, {edge_count} edges. Click an action to see its answer.</p></div>
<script>
const DETAILS = {data};
document.querySelectorAll('.node').forEach(function (el) {{
  el.addEventListener('click', function () {{
    document.querySelectorAll('.node.selected').forEach(function (n) {{ n.classList.remove('selected'); }});
    el.classList.add('selected');
    const d = DETAILS[el.dataset.id];
    const box = document.getElementById('detail');
    box.textContent = '';
    const h = document.createElement('h3'); h.textContent = d.query; box.appendChild(h);
    const m = document.createElement('p');
    m.textContent = 'score: ' + d.score + ' | LLM calls: ' + d.llm_calls + ' | tokens: ' + d.prompt_tokens + ' in / ' + d.output_tokens + ' out';
    box.appendChild(m);
    if (d.error) {{ const e = document.createElement('p'); e.style.color = '#b91c1c'; e.textContent = 'error: ' + d.error; box.appendChild(e); }}
    const a = document.createElement('div'); a.textContent = d.answer || '(no answer)'; box.appendChild(a);
  }});
}});
</script>
</body></html>
"""
