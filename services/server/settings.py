"""The settings of a serving process's gRPC server, in three parts by who they concern:
every server (`ServerSettings`: where it listens, its metrics, its drain), the public
API (`PublicApiSettings`: the HTTP port, API keys, TLS), and the internal channels
(`InternalSettings`: mTLS between router, workers and KV transports, worker
reflection). `ServerConfig` is the three together: the one model every serving command
reads, so flags, `PDSERVE_*` variables, docs/configuration.md and the Helm chart derive
from it. Env prefix PDSERVE_."""

from __future__ import annotations

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from services.server.channels import MAX_MESSAGE_BYTES
from services.settings import ADVANCED

# The names of services/api/tools.py's parsers (a test holds the two equal; the settings
# cannot import the API package).
TOOL_CALL_PARSERS = ("hermes",)


class ServerSettings(BaseSettings):
    """Where a gRPC server listens, what it exports, how long it drains."""

    model_config = SettingsConfigDict(env_prefix="PDSERVE_", extra="ignore")

    host: str = Field("127.0.0.1", description="address the gRPC and HTTP APIs bind to "
                      "(0.0.0.0: every interface; beyond loopback the public API needs API "
                      "keys or TLS, or --allow-insecure)")
    port: int = Field(50051, ge=0, le=65535, description="gRPC API port (0 = any free port)")
    metrics_port: int = Field(
        9400, ge=-1, le=65535, description="Prometheus /metrics port (0 = off, -1 = any free "
        "port, published in the registry)"
    )
    max_message_bytes: int = Field(
        MAX_MESSAGE_BYTES, ge=4 << 20, description="largest gRPC message accepted or sent",
        json_schema_extra=ADVANCED,
    )
    grace_s: float = Field(10.0, ge=0, description="seconds running streams get on shutdown",
                           json_schema_extra=ADVANCED)
    otlp_traces_endpoint: str = Field(
        "", description="OpenTelemetry traces over OTLP/gRPC to this collector (empty: "
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, else off); host:port is plaintext on loopback, "
        "TLS elsewhere (docs/observability.md)")
    otlp_sampling_ratio: float | None = Field(
        None, ge=0.0, le=1.0, description="share of new traces sampled, 0..1 (a client's "
        "sampled traceparent is always followed); unset: OTEL_TRACES_SAMPLER, else 1",
        json_schema_extra=ADVANCED)
    metrics_host: str = Field("", description="address the Prometheus port binds to (empty: "
                              "the same as host)", json_schema_extra=ADVANCED)
    health_port: int = Field(
        0, ge=0, le=65535, description="a plaintext port serving grpc.health.v1 only, for "
        "probes that speak neither TLS nor API keys (0 = off)")


class PublicApiSettings(BaseSettings):
    """The public API's HTTP port and credentials (docs/security.md)."""

    model_config = SettingsConfigDict(env_prefix="PDSERVE_", extra="ignore")

    http_port: int = Field(
        0, ge=0, le=65535, description="OpenAI-compatible HTTP API port (0 = off)"
    )
    api_keys_file: str = Field(
        "", description="public API: a file of `client-name:key` lines (PDSERVE_API_KEYS "
        "adds comma-separated ones); other calls are refused UNAUTHENTICATED / HTTP 401")
    tls_cert_file: str = Field("", description="public API: TLS certificate chain (PEM)")
    tls_key_file: str = Field("", description="public API: TLS private key (PEM)")
    tls_client_ca_file: str = Field(
        "", description="public API: require client certificates from this CA (mTLS)")
    allow_insecure: bool = Field(
        False, description="serve the public API beyond loopback with neither API keys nor "
        "TLS (logged as a warning at start)")
    # vLLM's flags: `tool_choice: auto` lets the model decide whether to call a tool, so
    # its calls must be read out of its text in its family's format.
    enable_auto_tool_choice: bool = Field(
        False, description="OpenAI API: serve `tool_choice: auto`, reading the model's calls "
        "with --tool-call-parser (required and named tool choices need neither)")
    tool_call_parser: str = Field(
        "", description="OpenAI API: the format the model writes tool calls in, for "
        "--enable-auto-tool-choice: hermes (<tool_call>{...}</tool_call>: Qwen 2.5/3, "
        "Hermes)")

    @model_validator(mode="after")
    def _tool_parser_known(self) -> PublicApiSettings:
        if self.tool_call_parser and self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(f"tool_call_parser: {self.tool_call_parser!r} is not known; "
                             f"use one of {', '.join(TOOL_CALL_PARSERS)}")
        if self.enable_auto_tool_choice and not self.tool_call_parser:
            raise ValueError("enable_auto_tool_choice: needs --tool-call-parser (the format "
                             "the model writes tool calls in)")
        return self

    @property
    def auto_tool_parser(self) -> str | None:
        """The parser `tool_choice: auto` reads calls with; None: auto is off."""
        return self.tool_call_parser if self.enable_auto_tool_choice else None


class InternalSettings(BaseSettings):
    """The internal channels: router <-> workers and the KV transports (docs/security.md)."""

    model_config = SettingsConfigDict(env_prefix="PDSERVE_", extra="ignore")

    internal_tls_ca_file: str = Field(
        "", description="internal mTLS (router <-> workers, KV transports): the CA peers' "
        "certificates must chain to")
    internal_tls_cert_file: str = Field(
        "", description="internal mTLS: this process's certificate (DNS name "
        "pdserve.internal)")
    internal_tls_key_file: str = Field("", description="internal mTLS: its private key")
    internal_reflection: bool = Field(
        False, description="worker ports: serve gRPC reflection too (off: it lists the "
        "internal API to whoever connects)", json_schema_extra=ADVANCED)


# Fields are ordered base by base from the last base to the first: the server's, then
# the public API's, then the internal ones.
class ServerConfig(InternalSettings, PublicApiSettings, ServerSettings):
    """Where and how the public API listens. Env prefix PDSERVE_."""

    model_config = SettingsConfigDict(env_prefix="PDSERVE_", extra="ignore")
