"""`drift-lance` command line.

Each subcommand lives in its own module exposing `register(subparsers)`, which adds a parser whose
`func` default is `run(args) -> int`. Errors that are the user's (bad input, missing database)
exit 2 with one line on stderr; runtime failures exit 1; tracebacks only with --verbose. With --json
the error is also on stdout as JSON (`_json_error`).
"""

from __future__ import annotations

import argparse
import codecs
import contextlib
import importlib
import json
import logging
import os
import sys
from typing import Any, NoReturn

from drift_lance.errors import did_you_mean, first_cause

# Subcommand modules, in --help order.
_COMMAND_MODULES = (
    "ingest_cmd",
    "query_cmd",
    "context_cmd",
    "inspect_cmd",
    "serve_cmd",
    "config_cmd",
    "demo_cmd",
)

EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2

# Commands that only read. Once their output is flushed the process has nothing left to do, and
# the interpreter's teardown of LanceDB's runtime and caches (0.3-0.6 s with 10^6 rows) would only
# delay the shell prompt, so `run` skips it for them.
_READ_ONLY_COMMANDS = frozenset({"query", "context", "inspect", "config"})


class UsageError(Exception):
    """The user's input is wrong (exit 2)."""


def _user_error_types() -> tuple[type[BaseException], ...]:
    """Errors caused by the user's input: bad files, bad config, missing database."""
    from drift_lance.errors import USER_ERRORS

    return USER_ERRORS


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line on stderr (no usage dump) and exit 2, naming the
    subcommand, with the nearest option or choice for a misspelt one."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see --help)\n")

    def parse_args(self, args=None, namespace=None):  # type: ignore[override]
        namespace, extras = self.parse_known_args(args, namespace)
        if extras:  # argparse would report them as the top-level parser's, with no hint
            parser = self._command_parser(namespace)
            parser.error(f"unrecognized arguments: {' '.join(extras)}{parser._extras_hint(extras)}")
        return namespace

    def _check_value(self, action: argparse.Action, value: Any) -> None:
        try:
            super()._check_value(action, value)
        except argparse.ArgumentError as exc:
            raise argparse.ArgumentError(action, exc.message + did_you_mean(str(value), map(str, action.choices or ()))) from None

    def _command_parser(self, namespace: argparse.Namespace) -> _Parser:
        """The parser of the subcommand in `namespace` (this parser when there is none)."""
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                return action.choices.get(getattr(namespace, action.dest, None), self)
        return self

    def _extras_hint(self, extras: list[str]) -> str:
        options = [o for o in self._option_string_actions if o.startswith("--")]
        for extra in extras:
            if extra.startswith("-") and (hint := did_you_mean(extra.split("=", 1)[0], options)):
                return hint
        if any(a.dest == "query" for a in self._positionals._group_actions) and not extras[0].startswith("-"):
            return "; a question of several words must be quoted"
        return ""


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="drift-lance",
        description="GraphRAG DRIFT search on LanceDB: ingest once, query fast.",
    )
    parser.add_argument("--verbose", "-v", action="store_true", help="show tracebacks and debug logs")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in _COMMAND_MODULES:
        try:
            module = importlib.import_module(f"drift_lance.cli.{name}")
        except ModuleNotFoundError as exc:
            if exc.name == f"drift_lance.cli.{name}":
                continue  # subcommand not present in this build
            raise
        module.register(sub)
    for command_parser in sub.choices.values():
        # also after the command (`drift-lance query ... -v`); SUPPRESS keeps a `-v` given before it
        command_parser.add_argument("--verbose", "-v", action="store_true", default=argparse.SUPPRESS,
                                    help="show tracebacks and debug logs")
    return parser


def main(argv: list[str] | None = None) -> int:
    _replace_unencodable_output()
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    if sys.stdout is None and args.command in _READ_ONLY_COMMANDS:  # `>&-`: say so before paying for a search
        print(f"drift-lance {args.command}: error: standard output is closed; there is nowhere to write the result",
              file=sys.stderr)
        return EXIT_USAGE
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("drift-lance: interrupted", file=sys.stderr)
        _json_error(args, "interrupted", KeyboardInterrupt("interrupted"))
        return 130
    except BrokenPipeError:  # `drift-lance inspect | head -1`: the reader is gone, which is no error
        with contextlib.suppress(OSError, ValueError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
        return 128 + 13  # what a process killed by SIGPIPE reports
    except (UsageError, *_user_error_types()) as exc:
        if args.verbose:
            raise
        print(f"drift-lance {args.command}: error: {_one_line(exc)}", file=sys.stderr)
        _json_error(args, "error", exc)
        return EXIT_USAGE
    except Exception as exc:  # noqa: BLE001 - the CLI's last line of defence
        if args.verbose:
            raise
        cause = first_cause(exc)
        if isinstance(cause, (UsageError, *_user_error_types())):
            print(f"drift-lance {args.command}: error: {_one_line(cause)}", file=sys.stderr)
            _json_error(args, "error", cause)
            return EXIT_USAGE
        print(f"drift-lance {args.command}: failed: {type(cause).__name__}: {_one_line(cause)}", file=sys.stderr)
        _json_error(args, "failed", cause)
        return EXIT_FAILURE


def _json_error(args: argparse.Namespace, code: str, exc: BaseException) -> None:
    """With --json a failure is JSON on stdout as well, `{"error": {"code", "type", "message"}}` (code
    "error" for exit 2, "failed" for 1, "interrupted" for 130): `... --json > out.json` or `| jq`
    then reads a parseable answer instead of an empty file."""
    if not getattr(args, "json", False) or sys.stdout is None:
        return
    error = {"code": code, "type": type(exc).__name__, "message": _one_line(exc)}
    with contextlib.suppress(OSError, ValueError):  # a closed or broken stdout: the exit code says it all
        print(json_text({"error": error}), flush=True)


def run() -> NoReturn:
    """Console-script entry: `main()` on sys.argv, then exit with its code."""
    argv = sys.argv[1:]
    try:
        code = main(argv)
    except KeyboardInterrupt:  # before main's own handler is in place: while the commands import
        print("drift-lance: interrupted", file=sys.stderr)
        code = 130
    command = next((a for a in argv if not a.startswith("-")), None)
    if command in _READ_ONLY_COMMANDS:
        try:
            logging.shutdown()
            for stream in (sys.stdout, sys.stderr):
                if stream is not None:  # None: closed when the process started (`>&-`)
                    stream.flush()
        except (OSError, ValueError):  # closed or broken pipe: let the normal exit report it
            sys.exit(code)
        os._exit(code)
    sys.exit(code)


def _replace_unencodable_output() -> None:
    """On a terminal or pipe whose encoding is not UTF-8 (a latin-1 locale, a Windows code page), a
    character it cannot encode is written as a `\\u2014` escape: an answer must not fail with
    UnicodeEncodeError after every LLM call of its search has been paid for."""
    for stream in (sys.stdout, sys.stderr):
        if not stdout_is_utf8(stream) and hasattr(stream, "reconfigure"):
            stream.reconfigure(errors="backslashreplace")


def stdout_is_utf8(stream: Any = None) -> bool:
    stream = sys.stdout if stream is None else stream
    encoding = getattr(stream, "encoding", None) or "utf-8"
    try:
        return codecs.lookup(encoding).name == "utf-8"
    except LookupError:
        return False


def json_text(value: Any, **options: Any) -> str:
    """`value` as indented JSON for stdout: characters as they are on a UTF-8 stdout, else `\\u`
    escapes, so the output is the same valid JSON whatever the locale's encoding."""
    return json.dumps(value, ensure_ascii=not stdout_is_utf8(), indent=2, **options)


STDIN = "-"


def question_argument(text: str) -> str:
    """The QUERY argument, read from standard input when it is `-` (`echo "..." | drift-lance query -`),
    as `cat -` does: a script's question need not be quoted for the shell or fit on one line."""
    if text != STDIN:
        return text
    data = sys.stdin.buffer.read() if sys.stdin is not None else b""
    try:
        return data.decode("utf-8-sig")  # a BOM from a Windows editor is no part of the question
    except UnicodeDecodeError:
        raise UsageError("the question read from standard input is not UTF-8 text") from None


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__
