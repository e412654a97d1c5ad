"""Which CPU cores the workers of a local `pdserve up` stack are pinned to, and which
of them share a core.

Every CPU worker of a role is pinned to the role's whole core list (`--prefill-cores`,
`--decode-cores`; default: the first and the second half of this machine's cores), so
two workers of one role, or two roles whose lists overlap, run on the same cores: they
take turns there, and each engine runs slower than it would alone. That still serves
(a laptop, a test), so the launcher says it clearly instead of refusing:
`sharing_warning` names the workers, the cores they share and what to do.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from services.engine.config import available_cores, format_cores, parse_cores, split_cores
from services.launcher.actor_spec import ROLES
from services.launcher.settings import Stack, role_tp


@dataclass(frozen=True, slots=True)
class CoreShare:
    """Cores that more than one worker is pinned to."""

    cores: tuple[int, ...]
    workers: tuple[str, ...]  # actor names, e.g. ("prefill-0", "prefill-1")


def pinned_workers(counts: dict[str, int], cores: dict[str, str]) -> dict[str, set[int]]:
    """Actor name -> the cores it is pinned to, for the roles in `cores` (CPU roles)."""
    return {
        f"{role}-{i}": parse_cores(cores[role])
        for role, n in counts.items()
        if role in cores
        for i in range(n)
    }


def shared_cores(counts: dict[str, int], cores: dict[str, str]) -> list[CoreShare]:
    """The groups of cores shared by more than one worker, each with its workers; `counts`
    is workers per role, `cores` the core list of each CPU role."""
    by_core: dict[int, list[str]] = defaultdict(list)
    for name, pinned in pinned_workers(counts, cores).items():
        for core in pinned:
            by_core[core].append(name)
    groups: dict[tuple[str, ...], list[int]] = defaultdict(list)
    for core, names in sorted(by_core.items()):
        if len(names) > 1:
            groups[tuple(names)].append(core)
    return [CoreShare(tuple(cs), names) for names, cs in groups.items()]


def _core_list(cores: tuple[int, ...] | list[int]) -> str:
    word = "core" if len(cores) == 1 else "cores"
    return f"{word} {format_cores(list(cores))}"


def _names(workers: tuple[str, ...]) -> str:
    return ", ".join(workers[:-1]) + f" and {workers[-1]}"


def sharing_warning(shares: list[CoreShare], available: list[int]) -> str:
    """What the operator reads when workers share cores ("" when none do)."""
    if not shares:
        return ""
    which = "; ".join(f"{_names(s.workers)} share {_core_list(s.cores)}" for s in shares)
    return (
        f"CPU cores oversubscribed: {which}. Workers on one core take turns on it, so "
        "each runs slower than alone. Run fewer workers per role on this machine "
        "(`pdserve up --prefill N --decode N`, or `pdserve scale`), or give the roles "
        "separate cores with --prefill-cores and --decode-cores (this machine has "
        f"{_core_list(available)})."
    )


def ranks_warning(role: str, cores: str, ranks: int) -> str:
    """What the operator reads when a CPU worker has fewer cores than tensor-parallel
    ranks ("" when every rank has a core of its own)."""
    have = parse_cores(cores)
    if ranks <= len(have):
        return ""
    return (f"CPU cores oversubscribed: each {role} worker runs {ranks} tensor-parallel "
            f"ranks on {_core_list(sorted(have))}, so ranks take turns on a core and wait "
            f"for each other at every layer. Give the role at least {ranks} cores "
            f"(--{role}-cores) or fewer ranks (--{role}-tp).")


def stack_warning(stack: Stack, prefill: int, decode: int) -> str:
    """`sharing_warning` for a local stack of `prefill` and `decode` workers ("" on a
    joined cluster, where workers may land on different machines, and for GPU roles)."""
    lc = stack.launcher
    if lc.ray_address:
        return ""
    accelerator = {"prefill": lc.prefill_accelerator, "decode": lc.decode_accelerator}
    cores = dict(zip(ROLES, split_cores(lc.prefill_cores, lc.decode_cores), strict=True))
    cpu = {role: c for role, c in cores.items() if not accelerator[role]}
    shares = shared_cores({"prefill": prefill, "decode": decode}, cpu)
    ranks = [ranks_warning(role, c, role_tp(lc, stack.engine, role)) for role, c in cpu.items()
             if {"prefill": prefill, "decode": decode}[role]]
    return " ".join(w for w in (sharing_warning(shares, available_cores()), *ranks) if w)
