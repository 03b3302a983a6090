"""One JSON error shape for every non-2xx answer: `{"error": {"code", "message", "field"}}`."""

from __future__ import annotations

import json

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict
from starlette.exceptions import HTTPException as StarletteHTTPException


class ErrorDetail(BaseModel):
    model_config = ConfigDict(json_schema_serialization_defaults_required=True)  # `field` is always sent, null or not

    code: str
    message: str
    field: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class ApiError(Exception):
    """Raised by handlers; rendered as ErrorResponse with `status`."""

    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        *,
        field: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        message, field = _utf8_safe(message), _utf8_safe(field) if field is not None else None
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.field = field
        self.headers = headers or {}

    def payload(self) -> dict:
        return ErrorResponse(error=ErrorDetail(code=self.code, message=self.message, field=self.field)).model_dump()

    def response(self) -> JSONResponse:
        return JSONResponse(self.payload(), status_code=self.status, headers=self.headers)

    def closing_response(self) -> tuple[list[tuple[bytes, bytes]], bytes]:
        """Raw headers and body of this error, answered by a layer below the app (a refused body, a
        request the HTTP parser refused), after which the server closes the connection."""
        body = json.dumps(self.payload()).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   (b"connection", b"close")]
        return headers, body


def internal_error(exc: BaseException) -> ApiError:
    """The answer to a bug (an exception no handler mapped), named by its type; the log has the rest."""
    return ApiError(500, "internal", f"internal error: {type(exc).__name__}")


def cancelled_by_shutdown(what: str, note: str = "") -> ApiError:
    """The answer for a `what` ("search", "reload") that shutdown cancelled past its grace period."""
    return ApiError(503, "cancelled", f"{what} cancelled: server shutting down" + (f"; {note}" if note else ""))


def _utf8_safe(text: str) -> str:
    """Error text echoes client input (field names); lone surrogates in it would make the JSON
    response itself fail to encode."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


# Shared OpenAPI `responses=` entries, so the schema documents every error a route can give, by the
# `code` values a client can tell apart.
ERROR_CODES = {
    400: "`bad_index`: the index cannot answer this request",
    401: "`unauthorized`: missing or wrong API key",
    408: "`body_timeout`: the request body did not arrive in time",
    413: "`body_too_large`: request body too large",
    415: "`unsupported_media_type`: the body is not sent as JSON (Content-Type: application/json)",
    422: "`invalid_json`, `invalid_request`, `unknown_field`, `not_overridable` (a server-side field), `over_limit` "
         "(past the server's cap) or `invalid_config`; `field` names the field",
    429: "`too_many_searches`: too many concurrent searches; retry after the Retry-After header",
    500: "`internal`: a bug or an unreadable table (the server log has the cause)",
    502: "`model_error`: the language model failed",
    503: "`not_ready`: store or models not ready yet",
    504: "`timeout`: the search exceeded the server's time limit",
}
RETRY_AFTER = {"description": "seconds to wait before retrying", "schema": {"type": "integer"}}


def error_responses(*statuses: int, codes: dict[int, str] | None = None) -> dict[int | str, dict]:
    """`responses=` entries for `statuses`; `codes` replaces a status's description where a route
    gives other codes with it than `ERROR_CODES` says."""
    described = {**ERROR_CODES, **(codes or {})}
    return {
        s: {"model": ErrorResponse, "description": described[s],
            **({"headers": {"Retry-After": RETRY_AFTER}} if s in (429, 503) else {})}
        for s in statuses
    }


_FASTAPI_BODY_PARSE_ERROR = "There was an error parsing the body"
_HTTP_CODES = {400: "bad_request", 404: "not_found", 405: "method_not_allowed", 413: "body_too_large", 401: "unauthorized"}


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error(exc.errors()).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 400 and exc.detail == _FASTAPI_BODY_PARSE_ERROR:
            # FastAPI's answer to a body it cannot decode (not UTF-8, nested too deep for the parser)
            return ApiError(422, "invalid_json", "request body is not valid JSON (UTF-8 text, nested at most a few hundred levels)").response()
        code = _HTTP_CODES.get(exc.status_code, f"http_{exc.status_code}")
        err = ApiError(exc.status_code, code, str(exc.detail), headers=dict(exc.headers or {}))
        return err.response()


def validation_error(errors: list[dict] | tuple[dict, ...], *, prefix: str = "") -> ApiError:
    """A 422 for the first pydantic error, naming its field as a dotted path (without `body.`)."""
    first = errors[0] if errors else {"loc": (), "msg": "invalid request", "type": "value_error"}
    loc = [str(p) for p in first.get("loc", ())]
    if loc and loc[0] == "body":
        loc = loc[1:]
    if first.get("type") == "json_invalid":
        return ApiError(422, "invalid_json", f"request body is not valid JSON: {first.get('msg')}")
    if not loc and first.get("type") == "missing":
        return ApiError(422, "invalid_json", 'request body is empty; send a JSON object such as {"query": "..."}')
    if not loc and first.get("type") in ("model_attributes_type", "model_type", "dict_type"):
        # A JSON array, string, number or null: pydantic's "valid dictionary or object to extract
        # fields from" names no field, and is about Python objects.
        return ApiError(422, "invalid_request", 'body: must be a JSON object such as {"query": "..."}', field="body")
    field = ".".join([prefix, *loc] if prefix else loc) or None
    code = "unknown_field" if first.get("type") == "extra_forbidden" else "invalid_request"
    message = "unknown field" if code == "unknown_field" else str(first.get("msg", "invalid value"))
    return ApiError(422, code, f"{field}: {message}" if field else message, field=field)
