"""docs/configuration.md, generated from the settings models (a test fails when the
file is stale): `python -m services.config_doc > docs/configuration.md`."""

from __future__ import annotations

from pydantic_settings import BaseSettings

from services.settings import env_name, flag_name


def settings_models() -> list[type[BaseSettings]]:
    """Every settings model, in the order the reference lists them."""
    from services.api.server import ServerConfig
    from services.engine.config import EngineConfig
    from services.launcher.up import LauncherConfig
    from services.registry.config import ClusterStateConfig
    from services.router.config import RouterConfig
    from services.router.local import LocalPairConfig
    from services.worker.config import WorkerConfig

    return [ServerConfig, EngineConfig, WorkerConfig, RouterConfig, LauncherConfig,
            LocalPairConfig, ClusterStateConfig]


def markdown_reference() -> str:
    """docs/configuration.md: one table per settings model."""
    lines = ["# Configuration reference", "",
             "Generated from the settings models by `python -m services.config_doc` (a test "
             "fails when this file is stale). Every setting is a CLI flag and a `PDSERVE_*` "
             "environment variable; flags win over the environment.", ""]
    for model in settings_models():
        doc = (model.__doc__ or "").strip().splitlines()[0]
        lines += [f"## {model.__name__}", "", doc, "", "| flag | env | default | meaning |",
                  "| --- | --- | --- | --- |"]
        for name, field in model.model_fields.items():
            default = field.get_default(call_default_factory=True)
            meaning = (field.description or "").replace("|", "\\|")
            lines.append(f"| `{flag_name(name)}` | `{env_name(model, name)}` | "
                         f"`{default!r}` | {meaning} |")
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    print(markdown_reference(), end="")
