"""How pdserve's processes log: one format, credentials masked in every record
(`services/security/redaction.py`), and the libraries a stack runs on kept quiet.

vLLM, Ray and torch say a lot while an engine starts, most of it about hardware a CPU
machine does not have (Triton, CUDA graphs) or API changes upstream (deprecations).
In a `pdserve up` stack, below `--log-level debug`, their loggers print errors only and
Python's and torch's C++ warnings are off, in the launcher's own process and in every
actor and engine process (through `quiet_env`, which their environment gets). Their
errors and every traceback still print; `--log-level debug` shows everything again.
"""

from __future__ import annotations

import logging
import warnings

from services.security.redaction import install_log_filter

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# The libraries whose loggers are quieted (children included: "vllm.engine", ...).
THIRD_PARTY = ("vllm", "ray", "torch", "transformers", "triton", "filelock", "urllib3")
LEVEL_ENV = "PDSERVE_LOG_LEVEL"  # the level an actor logs at (set by `pdserve up`)


def level_of(name: str) -> int:
    """The logging level named `name` (DEBUG, info, ...); ValueError when there is none."""
    level = logging.getLevelName(name.upper())
    if not isinstance(level, int):
        raise ValueError(f"unknown log level {name!r}: use DEBUG, INFO, WARNING or ERROR")
    return level


def quiet(level: int) -> bool:
    """Whether third-party libraries are kept to their errors at `level`."""
    return level > logging.DEBUG


def setup_logging(name: str = "INFO", quiet_libraries: bool = False) -> None:
    """Log at `name` in pdserve's format, credentials masked; with `quiet_libraries`
    (`pdserve up` and its actors), third-party libraries at ERROR unless `name` is DEBUG."""
    level = level_of(name)
    logging.basicConfig(level=level, format=FORMAT)
    logging.getLogger().setLevel(level)
    install_log_filter()
    if not quiet_libraries:
        return
    third_party = logging.ERROR if quiet(level) else level
    for lib in THIRD_PARTY:
        logging.getLogger(lib).setLevel(third_party)
    if quiet(level):
        warnings.simplefilter("ignore")


# What vLLM's engine processes print while they import vLLM, before its logging is set up
# there (so no level filters it): Triton's CPU notice, the weights' progress bar, blank
# lines. Skipped where Ray forwards the actors' output to `pdserve up`
# (RAY_DEDUP_LOGS_SKIP_REGEX, read when `ray` is imported); Ray's session logs keep them.
RAY_SKIP = (
    r"^(Triton is installed, but doesn't include CPU backend"
    r"|Loading safetensors checkpoint shards|\s*$)"
)


def driver_env(name: str) -> dict[str, str]:
    """Environment variables for the process that starts Ray and prints its actors'
    output (`pdserve up`), set before it imports `ray`."""
    return {"RAY_DEDUP_LOGS_SKIP_REGEX": RAY_SKIP} if quiet(level_of(name)) else {}


def quiet_env(name: str) -> dict[str, str]:
    """Environment variables that make the processes of a stack (actors, vLLM's engine
    and worker processes) log at `name`, as `setup_logging` does in this one."""
    level = level_of(name)
    env = {LEVEL_ENV: logging.getLevelName(level)}
    if quiet(level):
        env.update(VLLM_LOGGING_LEVEL="ERROR", PYTHONWARNINGS="ignore", TORCH_CPP_LOG_LEVEL="ERROR")
    else:
        env["VLLM_LOGGING_LEVEL"] = "DEBUG"
    return env
