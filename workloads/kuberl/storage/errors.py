"""Error classification for staging: transient failures are retried, permanent ones are
reported once with a message that names the URI and says how to fix it."""

from __future__ import annotations

import asyncio
import errno
import random
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


class StorageError(Exception):
    """A permanent storage failure; the message names the URI and the fix."""


# errno values that mean "the network hiccuped", not "the request is wrong".
_TRANSIENT_ERRNOS = {errno.ECONNRESET, errno.ECONNREFUSED, errno.ETIMEDOUT, errno.EPIPE,
                     errno.ECONNABORTED, errno.EHOSTUNREACH, errno.ENETUNREACH, errno.EAGAIN}
_TRANSIENT_HTTP = {408, 429, 500, 502, 503, 504}
_TRANSIENT_S3_CODES = {"SlowDown", "RequestTimeout", "InternalError", "ServiceUnavailable",
                       "RequestTimeTooSkewed", "Throttling", "ThrottlingException"}


def _http_status(exc: BaseException) -> int | None:
    code = getattr(exc, "code", None)  # gcsfs HttpError
    if isinstance(code, int):
        return code
    response = getattr(exc, "response", None)  # botocore ClientError
    if isinstance(response, dict):
        return response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return None


def _s3_code(exc: BaseException) -> str | None:
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        return response.get("Error", {}).get("Code")
    return None


def _chain(exc: BaseException):
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def is_transient(exc: BaseException) -> bool:
    """True for failures a retry can fix: connection drops, timeouts, throttling, 5xx."""
    for e in _chain(exc):
        if isinstance(e, StorageError | FileNotFoundError | PermissionError):
            return False
        name = type(e).__name__
        if name in ("NoCredentialsError", "PartialCredentialsError"):
            return False
        if isinstance(e, ConnectionError | TimeoutError | asyncio.TimeoutError):
            return True
        if name in ("EndpointConnectionError", "ConnectionClosedError", "ReadTimeoutError",
                    "ConnectTimeoutError", "ResponseStreamingError", "IncompleteReadError",
                    "ServerDisconnectedError", "ClientConnectionError", "ClientPayloadError",
                    "ClientOSError", "ProxyError", "ChunkedEncodingError"):
            return True
        if _s3_code(e) in _TRANSIENT_S3_CODES or _http_status(e) in _TRANSIENT_HTTP:
            return True
        if isinstance(e, OSError) and e.errno in _TRANSIENT_ERRNOS:
            return True
    return False


def explain(exc: BaseException, uri: str) -> StorageError:
    """A StorageError naming ``uri`` for a permanent failure raised by s3fs/gcsfs/huggingface_hub."""
    if isinstance(exc, StorageError):
        return exc
    for e in _chain(exc):
        name = type(e).__name__
        status = _http_status(e)
        if name in ("NoCredentialsError", "PartialCredentialsError"):
            return StorageError(
                f"{uri}: no usable credentials ({e}). Give the init container AWS_ACCESS_KEY_ID and "
                f"AWS_SECRET_ACCESS_KEY (or AWS_PROFILE / a web identity) from a Secret; "
                f"credentials never come from the job spec")
        if name in ("RepositoryNotFoundError", "GatedRepoError", "RevisionNotFoundError",
                    "EntryNotFoundError", "LocalEntryNotFoundError"):
            return StorageError(f"{uri}: Hugging Face could not serve it ({name}: {e}). Check the "
                                f"repo id and revision; private or gated repos need HF_TOKEN")
        if isinstance(e, PermissionError) or status in (401, 403) or \
                (isinstance(e, OSError) and str(e).startswith("Forbidden")):
            return StorageError(
                f"{uri}: access denied ({e}). Check that the credentials the init container gets "
                f"from its Secret (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, "
                f"GOOGLE_APPLICATION_CREDENTIALS, HF_TOKEN) are valid and may read this path")
        if isinstance(e, FileNotFoundError) or status == 404:
            return StorageError(f"{uri}: not found ({e}). Check the bucket name and the path")
    return StorageError(f"{uri}: {type(exc).__name__}: {exc}")


def with_retries(fn: Callable[[], T], *, uri: str, attempts: int = 5, base_delay: float = 0.5,
                 log: Callable[[str], None] | None = None) -> T:
    """Call ``fn``; retry transient failures with exponential backoff and jitter.

    Permanent failures, and transient ones that outlast ``attempts``, raise StorageError naming
    ``uri``.
    """
    for attempt in range(1, attempts + 1):
        try:
            return fn()
        except Exception as exc:  # noqa: BLE001 - classified below, never swallowed
            if not is_transient(exc):
                raise explain(exc, uri) from exc
            if attempt == attempts:
                raise StorageError(f"{uri}: still failing after {attempts} attempts: "
                                   f"{type(exc).__name__}: {exc}") from exc
            delay = base_delay * 2 ** (attempt - 1) * (0.5 + random.random())
            if log is not None:
                log(f"{uri}: transient {type(exc).__name__} ({exc}); retry {attempt}/{attempts - 1} "
                    f"in {delay:.1f}s")
            time.sleep(delay)
    raise AssertionError("unreachable")
