"""`drift-lance config [--config FILE] [--json]`: the settings `query`, `context` and `serve` would
use, each with where it came from (default, config file, environment variable, or the models
selection rule), secrets masked."""

from __future__ import annotations

import argparse
import json
import sys


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "config",
        help="show the effective settings and where each comes from",
        description="Print every setting as query, context and serve load it (defaults < config file < "
        "environment; command-line flags are not included), with its source; API keys and storage secrets "
        "are masked. Models are shown as the selection rule resolves them.",
    )
    parser.add_argument(
        "--config", metavar="FILE",
        help="settings file (TOML/YAML; default $DRIFT_LANCE_CONFIG); a graphrag settings.yaml is accepted",
    )
    parser.add_argument("--json", action="store_true", help='print {"name": {"value": ..., "source": ...}} as JSON')
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from drift_lance.cli import json_text
    from drift_lance.config.settings import effective_settings

    rows = effective_settings(args.config)
    if args.json:
        print(json_text({name: {"value": value, "source": source} for name, value, source in rows}))
        return 0
    lines = [(f"{name} = {json.dumps(value, ensure_ascii=False)}", source) for name, value, source in rows]
    width = max(len(text) for text, _ in lines)
    for text, source in lines:
        print(f"{text:<{width}}  # {source}", file=sys.stdout)
    return 0
