"""docs/configuration.md, generated from the settings models (a test fails when the
file is stale): `python -m services.config_doc > docs/configuration.md`."""

from __future__ import annotations

from pydantic_settings import BaseSettings

from services.config_sections import section_models
from services.settings import env_name, flag_name, is_advanced, summary

INTRO = """\
# Configuration reference

Generated from the settings models by `python -m services.config_doc` (a test fails when \
this file is stale).

Every setting is a CLI flag, a `PDSERVE_*` environment variable and a key of a settings \
file. Where one setting is given several ways, the first of these wins:

1. the flag (`--max-model-len 4096`);
2. the environment variable (`PDSERVE_MAX_MODEL_LEN=4096`);
3. the settings file given with `--config` (`engine: {max_model_len: 4096}`);
4. the default below.

## The settings file

`pdserve up`, `serve`, `router`, `prefill` and `decode` take `--config FILE.yaml`: a YAML \
mapping of sections, one per settings model below, each a mapping of that model's setting \
names (the **key** column) to values:

<!-- not-run: output: a settings file (tests/unit/test_doc_blocks.py loads it with pdserve's \
settings-file parser) -->
```yaml
engine:
  max_model_len: 4096
  kv_cache_gib: 2
server:
  port: 50051
  http_port: 8000
router:
  policy: round_robin
launcher:
  prefill: 2
  decode: 1
```

One file can describe a whole stack: each command reads the sections it uses and leaves \
the others (a router ignores `engine:`), but every section and key is checked whatever the \
command. The file is refused, with the file name and the key's path, when it holds a \
section or a key pdserve does not have (`stack.yaml: engine.kv_cache_gb is not a setting \
(did you mean kv_cache_gib?)`) or a value its setting refuses (`stack.yaml: \
engine.max_model_len: Input should be a valid integer ...`). Keep secrets out of it: the \
cluster secret and Redis passwords belong in the environment or in files named by the \
`*_file` settings.

`pdserve config show --for COMMAND [--config FILE] [COMMAND's flags]` prints the settings \
COMMAND would run with, resolved as above, in this file's shape (passwords in URLs and \
secrets masked), so its output is a settings file again. (`pdserve up` on a CPU host \
then also bounds engine steps, see `max_num_batched_tokens`.)

`--help` lists each command's flags grouped by section; the expert knobs (timeouts, \
staging sizes, keepalives, checksums, limits), marked *advanced* below, are listed apart \
under "advanced".

Sections: {sections}.
"""


def settings_models() -> list[type[BaseSettings]]:
    """Every settings model, in the order the reference lists them."""
    return list(section_models().values())


def markdown_reference() -> str:
    """docs/configuration.md: the file format, then one table per settings section."""
    sections = section_models()
    lines = [INTRO.replace("{sections}", ", ".join(f"`{s}`" for s in sections))]
    for section, model in sections.items():
        lines += [f"## `{section}:` {model.__name__}", "", summary(model), "",
                  "| key | flag | env | default | meaning |", "| --- | --- | --- | --- | --- |"]
        for name, field in model.model_fields.items():
            default = field.get_default(call_default_factory=True)
            meaning = (field.description or "").replace("|", "\\|")
            if is_advanced(field):
                meaning = f"*advanced:* {meaning}"
            lines.append(f"| `{name}` | `{flag_name(name)}` | `{env_name(model, name)}` | "
                         f"`{default!r}` | {meaning} |")
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    print(markdown_reference(), end="")
