"""The desired state of a `pdserve up` stack, kept in Redis.

`pdserve scale` and `pdserve down` write the desired pool sizes (or a shutdown request)
under `pdserve:desired`; the launcher reads them every second. The document is signed
under the cluster secret and carries the stack's id and a version: the launcher takes
only its own stack's documents, never an older version than it has (a replay), and puts
its own state back when the key is missing or forged (a Redis restart, a stray writer),
so scaling keeps working after Redis comes back.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, replace
from typing import Any

from services.registry.records import BadRecord
from services.registry.signing import RecordSigner

DESIRED_KEY = "pdserve:desired"
DESIRED_KIND = "desired"


@dataclass(frozen=True, slots=True)
class Desired:
    prefill: int
    decode: int
    routers: int = 1
    down: bool = False
    stack: str = ""  # the id of the `pdserve up` run that owns the document
    version: int = 0  # time.time_ns() of the write: newer wins

    def sizes(self) -> dict[str, int]:
        return {"prefill": self.prefill, "decode": self.decode, "routers": self.routers}

    def updated(self, **changes: Any) -> Desired:
        return replace(self, version=max(time.time_ns(), self.version + 1), **changes)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Desired:
        try:
            out = cls(prefill=int(d["prefill"]), decode=int(d["decode"]),
                      routers=int(d.get("routers", 1)), down=bool(d.get("down", False)),
                      stack=str(d.get("stack", "")), version=int(d.get("version", 0)))
        except (KeyError, TypeError, ValueError) as e:
            raise BadRecord("schema", f"desired state: {e!r}") from None
        if min(out.prefill, out.decode - 1, out.routers - 1) < 0:
            raise BadRecord("schema", "desired state: a pool size out of range")
        return out


class DesiredState:
    """Reads and writes the signed desired-state document."""

    def __init__(self, redis: Any, signer: RecordSigner) -> None:
        self.redis = redis
        self.signer = signer

    async def write(self, desired: Desired) -> None:
        await self.redis.set(DESIRED_KEY, self.signer.seal(DESIRED_KIND, asdict(desired)))

    async def read(self) -> Desired | None:
        """The document; None when the key is missing; BadRecord when it is forged or
        malformed."""
        raw = await self.redis.get(DESIRED_KEY)
        if raw is None:
            return None
        return Desired.from_dict(self.signer.open(DESIRED_KIND, raw))

    async def delete(self) -> None:
        await self.redis.delete(DESIRED_KEY)
