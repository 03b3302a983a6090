"""Conversation history for local search, with graphrag 3.x's semantics.

The previous user questions are appended to the query before entity mapping, and a
"Conversation History" table (oldest turns first, at most `max_turns`) opens the context; its
tokens are taken off the budget before the sections are sized.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from drift_lance.errors import ConfigError
from drift_lance.local.render import TokenCounter, to_csv
from drift_lance.models.base import Message

__all__ = ["ConversationHistory", "Turn"]

_ROLES = ("system", "user", "assistant")


@dataclass(frozen=True, slots=True)
class Turn:
    role: str
    content: str


class ConversationHistory:
    """Turns of a conversation; build from `Message`s or `{"role", "content"}` dicts."""

    def __init__(self, turns: Iterable[Turn] = ()):
        self.turns = list(turns)

    @classmethod
    def from_any(cls, value: ConversationHistory | Sequence[Message | Mapping[str, str]] | None) -> ConversationHistory:
        if value is None or isinstance(value, ConversationHistory):
            return value or cls()
        if isinstance(value, str | bytes) or not isinstance(value, Sequence):
            raise ConfigError(f"conversation_history: expected a list of {{role, content}} turns, got {type(value).__name__}")
        turns = []
        for index, item in enumerate(value):
            if not isinstance(item, Message | Mapping):
                raise ConfigError(f"conversation_history[{index}]: expected a {{role, content}} mapping, got {type(item).__name__}")
            role, content = (item.role, item.content) if isinstance(item, Message) else (item.get("role", "user"), item.get("content", ""))
            if role not in _ROLES:
                raise ConfigError(f"conversation_history[{index}].role: {role!r} is not one of {', '.join(_ROLES)}")
            if content is None:  # an OpenAI-style turn without text
                content = ""
            if not isinstance(content, str):  # content parts or any other object: its repr would reach the prompt
                raise ConfigError(f"conversation_history[{index}].content: expected text, got {type(content).__name__}")
            turns.append(Turn(role, content))
        return cls(turns)

    def __bool__(self) -> bool:
        return bool(self.turns)

    def recent_user_questions(self, max_turns: int | None) -> list[str]:
        """The last `max_turns` user questions, newest first (what graphrag appends to the query)."""
        questions: list[str] = []
        for turn in reversed(self.turns):
            if turn.role == "user":
                questions.append(turn.content)
                if max_turns and len(questions) >= max_turns:
                    break
        return questions

    def _qa_turns(self, user_turns_only: bool) -> list[tuple[str, list[str]]]:
        pairs: list[tuple[str, list[str]]] = []
        for turn in self.turns:
            if turn.role == "user":
                pairs.append((turn.content, []))
            elif pairs and not user_turns_only:
                pairs[-1][1].append(turn.content)
        return pairs

    def render(
        self,
        *,
        counter: TokenCounter,
        max_turns: int | None,
        user_turns_only: bool,
        max_tokens: int,
        delimiter: str,
        empty_header: bool = False,
    ) -> str:
        """The "-----Conversation History-----" table: turn|content rows, oldest first, cut before
        the first QA turn that would overflow `max_tokens`. "" when nothing fits, or with
        `empty_header` graphrag's text for that case: the header over an empty table ("\n")."""
        pairs = self._qa_turns(user_turns_only)
        if max_turns:
            pairs = pairs[:max_turns]  # graphrag keeps the first turns (no recency bias here)
        head = "-----Conversation History-----\n"
        rows: list[list[str]] = []
        text = ""
        for question, answers in pairs:
            candidate = rows + [["user", question]] + ([["assistant", "\n".join(answers)]] if answers else [])
            candidate_text = head + to_csv(["turn", "content"], candidate, delimiter)
            if counter.count(candidate_text) > max_tokens:
                break
            rows, text = candidate, candidate_text
        if not rows and pairs and empty_header:
            return head + "\n"  # pandas writes an empty DataFrame as one blank line
        return text
