"""Test doubles shipped with the package (usable by downstream projects' tests too).

- `ScriptedChatModel`: a ChatModel answering from a queue or a function, recording every call.
- `HashEmbedder` / `ScriptedEmbedder`: deterministic embedders, no model needed.
- `FakeOpenAIServer`: the OpenAI HTTP protocol on 127.0.0.1, scriptable per request
  (imported lazily: `from drift_lance.testing import FakeOpenAIServer`).
- `drift_lance.testing.s3.LocalS3`: moto's S3 server on 127.0.0.1 behind a request-counting proxy.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from drift_lance.testing.scripted import (
    HashEmbedder,
    RecordedCall,
    RecordedEmbedCall,
    ScriptedChatModel,
    ScriptedEmbedder,
    split_deltas,
)

if TYPE_CHECKING:
    from drift_lance.testing.openai_server import FakeOpenAIServer, Reply

__all__ = [
    "FakeOpenAIServer",
    "HashEmbedder",
    "RecordedCall",
    "RecordedEmbedCall",
    "Reply",
    "ScriptedChatModel",
    "ScriptedEmbedder",
    "split_deltas",
]


def __getattr__(name: str) -> Any:
    if name in ("FakeOpenAIServer", "Reply"):
        from drift_lance.testing import openai_server

        return getattr(openai_server, name)
    raise AttributeError(name)
