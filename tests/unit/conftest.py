"""Fixtures the unit tests share."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from services.observability import tracing


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    """Tracing on, every finished span kept in memory; off again afterwards."""
    memory = InMemorySpanExporter()
    tracing.setup_tracing("pdserve-test", None, 1.0, exporter=memory)
    yield memory
    tracing.shutdown_tracing()
