"""Object-storage URIs and options: what drift-lance adds on top of LanceDB's own handling.

LanceDB (through the Rust `object_store` crate) already reads the standard AWS variables for s3://
URIs: AWS_ENDPOINT_URL / AWS_ENDPOINT, AWS_REGION / AWS_DEFAULT_REGION, AWS_ACCESS_KEY_ID,
AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN, AWS_ALLOW_HTTP. What it does not do is accept a plain
http:// endpoint (MinIO, moto, Ceph on a private network) unless `allow_http` is set as well; the
endpoint's scheme already says so, so `resolve_storage_options` fills that gap. Everything else is
passed through unchanged: explicit options (config file `store.storage_options`, the CLI's
`--storage-option KEY=VALUE`) win over the environment.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from urllib.parse import urlparse

from drift_lance.errors import StoreError

__all__ = ["is_local_uri", "merge_storage_options", "resolve_storage_options"]

# Spellings object_store accepts for the S3 endpoint option, and the variables it reads for it.
_ENDPOINT_KEYS = ("aws_endpoint", "aws_endpoint_url", "endpoint", "endpoint_url")
_ENDPOINT_ENV = ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL", "AWS_ENDPOINT")  # the service-specific one first, as the AWS SDKs read them
_ALLOW_HTTP_KEYS = ("allow_http", "aws_allow_http")
_ALLOW_HTTP_ENV = ("AWS_ALLOW_HTTP",)
_S3_SCHEMES = ("s3", "s3a", "s3+ddb")


def has_uri_scheme(uri: str) -> bool:
    """True for s3://, gs://, file://, ...; False for a plain path, a Windows drive's (C:) included."""
    return len(urlparse(str(uri)).scheme) > 1  # one letter: a Windows drive


def is_local_uri(uri: str) -> bool:
    """True for a local folder (plain path or file://), False for s3://, gs://, az://, ..."""
    return not has_uri_scheme(uri) or urlparse(str(uri)).scheme == "file"


def connect_uri(uri: str) -> str:
    """`uri` as handed to `lancedb.connect_async`: a plain local path made absolute. LanceDB 0.40
    takes a relative path that starts with "db" ("db.lancedb", "db/index") for a LanceDB Cloud
    database and asks for an api_key."""
    uri = str(uri)
    if urlparse(uri).scheme == "":
        return os.path.abspath(os.path.expanduser(uri))
    return uri


def check_not_a_file(uri: str) -> None:
    """A local database is a folder: say so, instead of LanceDB's multi-line NotADirectory dump."""
    if urlparse(str(uri)).scheme == "" and os.path.isfile(os.path.expanduser(str(uri))):
        raise StoreError(f"{uri}: is a file; a LanceDB database is a folder")


# Object-store failures LanceDB reports as ~1.5k-character Rust debug dumps, and what they mean.
_STORAGE_FAILURES = (
    ("NoSuchBucket", "the bucket does not exist"),
    ("SignatureDoesNotMatch", "credentials rejected: the secret key does not match the access key id"),
    ("InvalidAccessKeyId", "credentials rejected: unknown access key id"),
    ("AccessDenied", "access denied by the object store"),
    ("Connection refused", "cannot connect to the endpoint (connection refused)"),
    ("BadScheme", "the endpoint's scheme is not accepted (an http:// endpoint needs allow_http=true)"),
    ("dns error", "the endpoint's host name does not resolve"),
    ("Timeout", "the endpoint did not answer in time (the storage options timeout, connect_timeout, "
                "client_max_retries and client_retry_timeout bound the wait)"),
)
_RAW_CHARS = 300


def describe_open_failure(uri: str, exc: BaseException) -> StoreError:
    """The StoreError for a database that could not be opened: what went wrong first, when it is one
    of the usual object-store failures, then the start of LanceDB's own message."""
    raw = " ".join(str(exc).split()) or type(exc).__name__
    meaning = next((text for marker, text in _STORAGE_FAILURES if marker in raw), None)
    short = raw if len(raw) <= _RAW_CHARS else raw[:_RAW_CHARS] + " ..."
    return StoreError(f"{uri}: cannot open LanceDB database: {meaning + ' (' + short + ')' if meaning else short}")


def merge_storage_options(*sources: Mapping[str, str] | None) -> dict[str, str]:
    """Later sources win; keys are compared case-insensitively (object_store lower-cases them)."""
    merged: dict[str, str] = {}
    for source in sources:
        for key, value in (source or {}).items():
            merged[str(key).strip().lower()] = str(value)
    return merged


def resolve_storage_options(
    uri: str,
    options: Mapping[str, str] | None = None,
    *,
    environ: Mapping[str, str] | None = None,
) -> dict[str, str] | None:
    """The storage options to hand LanceDB for `uri`: `options`, plus allow_http=true when the S3
    endpoint (from `options` or the environment) is a plain http:// URL and neither names
    allow_http. None when there is nothing to pass (LanceDB's default)."""
    env = os.environ if environ is None else environ
    resolved = merge_storage_options(options)
    if urlparse(str(uri)).scheme.lower() in _S3_SCHEMES:
        endpoint = next((resolved[k] for k in _ENDPOINT_KEYS if resolved.get(k)), None)
        endpoint = endpoint or next((env[k] for k in _ENDPOINT_ENV if env.get(k)), None)
        allow_http_given = any(k in resolved for k in _ALLOW_HTTP_KEYS) or any(env.get(k) for k in _ALLOW_HTTP_ENV)
        if endpoint and endpoint.strip().lower().startswith("http://") and not allow_http_given:
            resolved["allow_http"] = "true"
    return resolved or None
