"""The sections of a settings file (`--config FILE.yaml`): section name -> settings model.

The one place that names where each settings model lives: a model that moves or splits
changes its line here, and the file format, `--help`'s groups, `pdserve config show`
and docs/configuration.md follow. Models are named as `module:Class` and imported when
first needed, so that `services/settings.py`, which every model's module imports, can
ask which section a model is without importing the models itself.
"""

from __future__ import annotations

import functools
import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pydantic_settings import BaseSettings

# In the order the configuration reference lists them.
SECTIONS: dict[str, str] = {
    "server": "services.server.settings:ServerConfig",
    "engine": "services.engine.config:EngineConfig",
    "worker": "services.worker.config:WorkerConfig",
    "router": "services.router.config:RouterConfig",
    "launcher": "services.launcher.settings:LauncherConfig",
    "local": "services.launcher.local_pair:LocalPairConfig",
    "cluster": "services.registry.config:ClusterStateConfig",
}


@functools.cache
def section_models() -> dict[str, type[BaseSettings]]:
    """Section name -> settings model, in reference order."""
    models = {}
    for section, where in SECTIONS.items():
        module, _, name = where.partition(":")
        models[section] = getattr(importlib.import_module(module), name)
    return models


def section_of(model: type[BaseSettings]) -> str | None:
    """The section holding `model`'s settings in a settings file (None: it has none)."""
    where = f"{model.__module__}:{model.__qualname__}"
    for section, named in SECTIONS.items():
        if named == where:
            return section
    return next((s for s, m in section_models().items() if m is model), None)
