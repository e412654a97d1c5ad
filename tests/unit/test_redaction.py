"""Credentials masked in log lines, URLs and tracebacks (services/security/redaction.py)."""

from __future__ import annotations

import io
import logging
from collections.abc import Iterator

import pytest

from services.security import redaction
from services.security.redaction import RedactingFilter, redact, redact_url


@pytest.fixture
def handler() -> Iterator[tuple[logging.Logger, io.StringIO]]:
    out = io.StringIO()
    h = logging.StreamHandler(out)
    h.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    logger = logging.getLogger("test.redaction")
    logger.addHandler(h)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    redaction.install_log_filter(logger)
    redaction.install_log_filter(logger)  # once per handler, however often it is called
    assert len(h.filters) == 1
    yield logger, out
    logger.removeHandler(h)


def test_url_passwords_are_masked_and_the_rest_kept() -> None:
    assert redact_url("redis://:s3cr3t-pw@127.0.0.1:6379/0") == "redis://:***@127.0.0.1:6379/0"
    assert redact_url("waiting in rediss://user:pw@h:1/0?ssl_ca_certs=/a.crt, then") == (
        "waiting in rediss://user:***@h:1/0?ssl_ca_certs=/a.crt, then")
    assert redact_url("redis://127.0.0.1:6379/0") == "redis://127.0.0.1:6379/0"
    assert redact_url("http://host:8000/v1") == "http://host:8000/v1"


def test_bearer_tokens_keys_and_registered_secrets_are_masked() -> None:
    redaction.register("cluster-secret-0123456789", "short")
    assert redact("authorization: Bearer abc.def-123") == "authorization: Bearer ***"
    assert redact("key pdsk_AbC-12_x given") == "key *** given"
    assert redact("secret=cluster-secret-0123456789;") == "secret=***;"
    assert redact("a short word") == "a short word"  # too short to be a secret's value


def test_the_log_filter_masks_messages_arguments_and_tracebacks(
        handler: tuple[logging.Logger, io.StringIO]) -> None:
    logger, out = handler
    redaction.register_url("redis://:pass%2Fword-0123@127.0.0.1:1/0")
    logger.info("waiting for workers to register in %s", "redis://:pw-1@127.0.0.1:1/0")
    logger.info("the password is %s", "pass/word-0123")  # registered unquoted, too
    try:
        raise ConnectionError("cannot reach redis://:pw-2@10.0.0.1:6379/0")
    except ConnectionError:
        logger.exception("failed")
    text = out.getvalue()
    assert "pw-1" not in text and "pw-2" not in text and "pass/word-0123" not in text
    assert "register in redis://:***@127.0.0.1:1/0" in text
    assert "ConnectionError: cannot reach redis://:***@10.0.0.1:6379/0" in text


def test_a_record_without_secrets_is_left_as_it_is() -> None:
    record = logging.LogRecord("x", logging.INFO, __file__, 1, "served %d requests", (3,),
                               None)
    assert RedactingFilter().filter(record)
    assert (record.msg, record.args) == ("served %d requests", (3,))
