"""Settings of the cluster state's authentication, shared by routers, pool workers and
`pdserve up` (one model, so each command gets the flags once). Env prefix PDSERVE_."""

from __future__ import annotations

from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict

from services.registry.signing import RecordSigner, record_signer


class ClusterStateConfig(BaseSettings):
    """How records in Redis are signed and checked. Env prefix PDSERVE_."""

    model_config = SettingsConfigDict(env_prefix="PDSERVE_", extra="ignore")

    cluster_secret: SecretStr = Field(
        SecretStr(""), description="HMAC-SHA256 key of worker records and pool sizes in "
        "Redis (at least 16 bytes; prefer the env variable or the file: a flag shows in ps)")
    cluster_secret_file: str = Field(
        "", description="file holding the cluster secret (what a Kubernetes Secret mounts)")
    allow_unsigned_records: bool = Field(
        False, description="run without a cluster secret: records are neither signed nor "
        "checked, so anyone who can write to Redis can register a worker (logged at start)")

    def signer(self, who: str) -> RecordSigner:
        """The signer for this process; ValueError without a secret unless unsigned
        records are explicitly allowed."""
        return record_signer(self.cluster_secret.get_secret_value(), self.cluster_secret_file,
                             self.allow_unsigned_records, who)
