"""docs/observability.md lists every metric pdserve defines and every span attribute and
event it writes (the reference cannot drift from the code)."""

from __future__ import annotations

import re
from pathlib import Path

from services.observability.spans import Attr

ROOT = Path(__file__).resolve().parents[2]
DOC = (ROOT / "docs" / "observability.md").read_text()


def test_every_metric_in_the_code_is_documented() -> None:
    names = set()
    for path in (ROOT / "services").rglob("*.py"):
        names |= set(re.findall(r"\b(?:Counter|Gauge|Histogram)\(\s*\"(pdserve_\w+)\"",
                                path.read_text()))
    assert names, "no metric found: the pattern is wrong"
    assert not {n for n in names if f"`{n}`" not in DOC}


def test_every_span_attribute_and_event_is_documented() -> None:
    attrs = {v for k, v in vars(Attr).items() if k.isupper()}
    source = "\n".join(p.read_text() for p in (ROOT / "services" / "observability").glob("*.py"))
    attrs |= set(re.findall(r"\"(pdserve\.move\.\w+)\"", source))
    assert not {a for a in attrs if f"`{a}`" not in DOC}
    events = set(re.findall(r"\.event\(\s*\"(\w+)\"", source)) | {"migration", "retry"}
    assert not {e for e in events if f"| `{e}` |" not in DOC}
