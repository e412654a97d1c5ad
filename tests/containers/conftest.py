"""Container tests: pdserve's built image run as containers (`make test-containers`).

They start a whole stack in containers and need the image `make images` builds, so they
run only when selected (`-m container`); `make test` skips them and says so. Selected but
without a usable engine or the image, they skip saying why, or fail where
PDSERVE_REQUIRE_CONTAINERS=1 (what `make test-containers` sets: a run that checked
nothing must not pass).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.containers.engine import Engine, EngineUnusable, detect

NOT_SELECTED = ("container test: runs pdserve's image as containers (slow; needs the image "
                "`make images` builds): `make test-containers`, or pytest -m container")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if "container" in (config.option.markexpr or ""):
        return
    skip = pytest.mark.skip(reason=NOT_SELECTED)
    for item in items:
        if item.get_closest_marker("container"):
            item.add_marker(skip)


def unavailable(why: str) -> None:
    """Skip, or fail where the caller asked for the container tests to run for sure."""
    if os.environ.get("PDSERVE_REQUIRE_CONTAINERS") == "1":
        pytest.fail(f"PDSERVE_REQUIRE_CONTAINERS=1 and {why}", pytrace=False)
    pytest.skip(why)


@pytest.fixture(scope="session")
def engine() -> Engine:
    try:
        return detect()
    except EngineUnusable as e:
        unavailable(str(e))
        raise  # unreachable: unavailable() skips or fails


@pytest.fixture(scope="session")
def container_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    yield tmp_path_factory.mktemp("containers")
