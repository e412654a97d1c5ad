"""Credentials kept out of logs, banners, error messages and `config show`: the one place
pdserve masks them.

Two layers. Code that prints a URL passes it through `redact_url` (the password of
`redis://:password@host` becomes `***`). And every pdserve process installs
`RedactingFilter` on its log handlers (`install_log_filter`), which masks passwords in
URLs, bearer tokens, pdserve API keys and every secret value the process registered
(`register`: the Redis password, the cluster secret) in each record, its traceback
included, so a line that forgot `redact_url`, or a library that logs a URL it was
given, still prints no credential.

Only the standard library is imported here, so every layer can use it without cycles.
"""

from __future__ import annotations

import logging
import re
import threading
from urllib.parse import unquote, urlsplit

MASK = "***"
# user:password@ in a URL (redis://:pw@host, https://user:pw@host/...).
_URL_PASSWORD = re.compile(r"(?P<head>[a-z][a-z0-9+.-]*://[^:/@\s]*:)[^@/\s]+(?P<at>@)", re.I)
# A bearer token in a header as logged ("authorization: Bearer <key>"), and a key made by
# `apikeys new` wherever it appears: API keys are kept as digests only, so they cannot be
# registered as literals.
_BEARER = re.compile(r"(?P<head>\bbearer\s+)[^\s'\",]+", re.I)
_PDSERVE_KEY = re.compile(r"\bpdsk_[A-Za-z0-9_-]+")
# Shorter values are not masked as literals: they would mask ordinary words and numbers
# (every generated secret and key is far longer).
MIN_SECRET_LEN = 8

_lock = threading.Lock()
_secrets: set[str] = set()


def redact_url(text: str) -> str:
    """`text` with the password of every URL in it replaced by `***`."""
    return _URL_PASSWORD.sub(rf"\g<head>{MASK}\g<at>", text)


def register(*values: str) -> None:
    """Remember secret values this process holds, so `redact` and the log filter mask
    them wherever they appear; values shorter than MIN_SECRET_LEN are ignored."""
    with _lock:
        _secrets.update(v for v in values if v and len(v) >= MIN_SECRET_LEN)


def register_url(url: str) -> None:
    """Register the password of `url` (as written in the URL and unquoted)."""
    try:
        password = urlsplit(url).password
    except ValueError:
        return
    if password:
        register(password, unquote(password))


def redact(text: str) -> str:
    """`text` with URL passwords, bearer tokens, pdserve API keys and every registered
    secret replaced by `***`."""
    text = _PDSERVE_KEY.sub(MASK, _BEARER.sub(rf"\g<head>{MASK}", redact_url(text)))
    with _lock:
        known = sorted(_secrets, key=len, reverse=True)  # a longer secret first
    for value in known:
        if value in text:
            text = text.replace(value, MASK)
    return text


class RedactingFilter(logging.Filter):
    """Masks credentials in a log record's message and traceback (see `redact`)."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        clean = redact(message)
        if clean != message:
            record.msg, record.args = clean, None
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = redact(record.exc_text)
        return True


def install_log_filter(logger: logging.Logger | None = None) -> None:
    """Put a `RedactingFilter` on every handler of `logger` (default: the root logger),
    where it sees the records of every child logger too; once per handler."""
    for handler in (logger or logging.getLogger()).handlers:
        if not any(isinstance(f, RedactingFilter) for f in handler.filters):
            handler.addFilter(RedactingFilter())
