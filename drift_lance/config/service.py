"""HTTP service settings: where to listen, who may call, and the bounds every request must stay within.

Request-level DRIFT/local overrides are accepted only inside these caps, so one caller cannot make the
server fan out into thousands of LLM calls or huge prompts.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator

from drift_lance.errors import did_you_mean

# Search settings that spend the server's resources (LLM calls and context builds in flight, how long
# a call may hold them) rather than shape the answer: server-side unless a cap says how far a request may go.
RESOURCE_FIELDS = ("concurrency", "context_concurrency", "llm_timeout")


class RequestCaps(BaseModel):
    """Upper bounds on per-request search overrides. A request above a cap gets 422 naming the field."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    n_depth: int = Field(3, ge=0, description="max DRIFT follow-up depth a request may ask for")
    drift_k_followups: int = Field(20, ge=1, description="max communities the primer may use")
    primer_folds: int = Field(10, ge=1, description="max primer folds (parallel primer calls)")
    local_search_n: int = Field(1, ge=1, description="max completions per local search")
    # Applied to every override whose name contains "top_k" (entities/relationships per lookup).
    top_k: int = Field(100, ge=1, description="max value of any *top_k* override")
    # Applied to every integer override whose name ends in "_tokens" (context and generation budgets).
    token_budget: int = Field(16_000, ge=1, description="max value of any *_tokens override")
    # Extra per-field caps, e.g. {"community_level": 4}.
    fields: dict[str, float] = Field(default_factory=dict)
    # Fields that stay at the server's value: they govern the server's resources, not the answer.
    server_only: list[str] = Field(default_factory=lambda: list(RESOURCE_FIELDS))

    @field_validator("fields", "server_only")
    @classmethod
    def _names_are_search_fields(cls, value: Any) -> Any:
        # A misspelt name (`comunity_level`) would cap or keep nothing, silently.
        from drift_lance.config.drift import DRIFTSearchConfig
        from drift_lance.config.local import LocalSearchConfig

        known = sorted({*DRIFTSearchConfig.model_fields, *LocalSearchConfig.model_fields})
        for name in value:
            if name not in known:
                raise ValueError(f"{name!r} is no drift or local search setting{did_you_mean(name, known)}")
        return value

    @model_validator(mode="after")
    def _resource_fields_stay_bounded(self) -> RequestCaps:
        # `server_only` replaces the default list: `["seed"]` alone would let a request set
        # `concurrency` (LLM calls in flight) to anything. A resource field taken off it needs a cap.
        uncapped = [name for name in RESOURCE_FIELDS if name not in self.server_only and name not in self.fields]
        if uncapped:
            raise ValueError(
                f"server_only leaves {', '.join(uncapped)} to requests with no cap; keep "
                f"{'it' if len(uncapped) == 1 else 'them'} in server_only or cap {'it' if len(uncapped) == 1 else 'them'} in fields"
            )
        return self

    def cap_for(self, field: str) -> float | None:
        """The largest value a request may set `field` to, or None when it is uncapped."""
        if field in self.fields:
            return self.fields[field]
        named = {"n_depth", "drift_k_followups", "primer_folds", "local_search_n"}
        if field in named:
            return getattr(self, field)
        if field.endswith("_tokens"):
            return self.token_budget
        if "top_k" in field:
            return self.top_k
        return None


class ServiceConfig(BaseModel):
    """`drift-lance serve` settings. Env: DRIFT_LANCE_SERVICE__<FIELD>, and DRIFT_LANCE_API_KEY."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    # Bearer token; when set every route except /healthz and /readyz requires it.
    api_key: SecretStr | None = None

    max_body_bytes: int = Field(64 * 1024, ge=256, description="largest accepted request body")
    # A request's headers must arrive within this long of the connection (or of the previous
    # response), and its body within this long of its headers; else the connection is closed (body:
    # 408 first). Slow or stalled senders cannot hold connections.
    request_read_timeout_seconds: float = Field(10.0, gt=0)
    max_query_chars: int = Field(4_000, ge=1, description="longest accepted query")
    caps: RequestCaps = Field(default_factory=RequestCaps)

    # Searches running at once; request number max_concurrent_searches + 1 gets 429 + Retry-After.
    max_concurrent_searches: int = Field(4, ge=1)
    retry_after_seconds: int = Field(5, ge=1)
    # Wall-clock limit of one search (blocking or streamed), after which it is cancelled (504).
    search_timeout_seconds: float = Field(300.0, gt=0)
    # On shutdown, in-flight searches get this long to finish before they are cancelled.
    shutdown_grace_seconds: float = Field(30.0, ge=0)
    # SSE comment line sent when no event was emitted for this long, so proxies keep the stream open.
    sse_keepalive_seconds: float = Field(15.0, gt=0)
    # Serve GET /metrics (Prometheus); behind api_key like every route but the probes.
    metrics: bool = True

    @field_validator("host")
    @classmethod
    def _host_is_named(cls, value: str) -> str:
        # An empty host (`DRIFT_LANCE_SERVICE__HOST=` in an env file) made the server listen on every
        # interface, 0.0.0.0 and [::], instead of the default 127.0.0.1.
        if not value.strip():
            raise ValueError("empty; give an address (127.0.0.1, the default; 0.0.0.0 for every interface)")
        return value.strip()

    @field_validator("api_key", mode="before")
    @classmethod
    def _empty_key_means_no_auth(cls, value: object) -> object:
        # DRIFT_LANCE_API_KEY="" in an env file should disable auth, not require an empty token.
        if isinstance(value, str) and not value.strip():
            return None
        # A key read from a file (a Kubernetes secret, `$(cat key)` in an env file with CRLF) often
        # ends in a newline, which no client can send in a header: every request got 401.
        return value.strip() if isinstance(value, str) else value
