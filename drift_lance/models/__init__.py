"""Model providers: the chat/embedder protocols, backends by name, offline token counting.

    from drift_lance.models import get_chat_model, get_embedder, get_tokenizer, Message
    chat = get_chat_model()          # from the environment: OpenAI-compatible endpoint or embedded
    result = await chat.complete([Message("user", "hi")], response_model=MySchema)
"""

from drift_lance.config.models import ModelSettings, default_model_settings
from drift_lance.models.base import (
    ChatModel,
    ChatParams,
    ChatResult,
    ChatStream,
    Embedder,
    EmbedKind,
    Message,
    ModelError,
    ModelRequestError,
    RequestFailure,
    StructuredOutputError,
    EmptyAnswerError,
    Usage,
)
from drift_lance.models.compat import check_embedding_compatibility
from drift_lance.models.registry import (
    get_chat_model,
    get_embedder,
    register_chat_backend,
    register_embedder,
)
from drift_lance.models.tokens import Tokenizer, encoding_for_model, get_tokenizer, tokenizer_for_model

__all__ = [
    "ChatModel",
    "ChatParams",
    "ChatResult",
    "ChatStream",
    "EmbedKind",
    "Embedder",
    "Message",
    "ModelError",
    "ModelRequestError",
    "ModelSettings",
    "RequestFailure",
    "StructuredOutputError",
    "EmptyAnswerError",
    "Tokenizer",
    "Usage",
    "check_embedding_compatibility",
    "default_model_settings",
    "encoding_for_model",
    "get_chat_model",
    "get_embedder",
    "get_tokenizer",
    "register_chat_backend",
    "register_embedder",
    "tokenizer_for_model",
]
