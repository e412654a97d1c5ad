"""`KVSettings`: the whole configuration of pdserve's KV connector, and the one place its
keys are defined. The worker service builds it (`services.worker.worker.kv_settings`),
vLLM carries its `to_dict()` as `kv_connector_extra_config` into the engine's
processes, the connector reads it back with `from_dict()` (a misspelled or unknown key
is an error there, never a silent default), and the transports get their view of it
from `transport_config()`."""

from __future__ import annotations

from dataclasses import dataclass

from services.kv.contract import Contract
from services.kv.transport import KINDS, TransportConfig, checksum

TRANSPORT_DEFAULTS = TransportConfig()  # the transports' defaults, which settings inherit


def rank_port_file(path: str, rank: int) -> str:
    """Where tensor-parallel rank `rank` of a decode engine publishes its receiver's port
    (`path` itself for the first rank)."""
    return path if rank == 0 else f"{path}.{rank}"


@dataclass(frozen=True, slots=True)
class KVSettings(Contract):
    """Producer: the prefill worker's half; consumer: the decode worker's (which hosts the
    KV receiver); both: either."""

    worker_id: str  # both: this worker's name, sent in every transfer's header
    epoch: int  # both: its start epoch; transfers meant for another epoch are refused
    kv_host: str = "127.0.0.1"  # consumer: where the KV receiver binds
    kv_port: int = 0  # consumer: its port; 0 = any free one, written to `port_file`
    # consumer: where the bound port is written for the service (`rank_port_file`)
    port_file: str = ""
    kv_transport: str = "grpc"  # consumer: receiver kind (KINDS)
    # Producer: longest hold of an unacknowledged transfer's blocks; consumer: how long
    # a received transfer waits to be taken.
    lease_s: float = TRANSPORT_DEFAULTS.lease_s
    load_timeout_s: float = 30.0  # consumer: longest wait for a complete transfer
    unknown_grace_s: float = 5.0  # consumer: how long an unseen transfer may take to appear
    chunk_bytes: int = TRANSPORT_DEFAULTS.chunk_bytes  # producer: payload bytes per frame
    # Both: the payload checksum this worker's sender computes: "crc32c" (hardware
    # CRC-32C), "xxh3" (64-bit XXH3) or "crc32" (zlib, slow). The algorithm travels in
    # each transfer's header; a receiver verifies whatever the sender used among these.
    checksum: str = TRANSPORT_DEFAULTS.checksum
    # Consumer: inbound streams (transfers and torch pairs) served at once; one more is
    # refused at once with RESOURCE_EXHAUSTED.
    max_streams: int = TRANSPORT_DEFAULTS.max_streams
    # Both: same-host KV through shared-memory segments. Producer: ship to a decode
    # worker whose `same_host` param is set through shm (else over the network, counted
    # in `pdserve_kv_transport_fallbacks_total{reason}`); consumer: accept shm transfers
    # on the receiver's address.
    shm: bool = TRANSPORT_DEFAULTS.shm
    # Both (with shm): where both workers of a same-host pair run on GPUs, transfers go
    # device to device over CUDA IPC (the decode worker lends its GPU memory) instead of
    # through host segments.
    cuda_ipc: bool = True
    # Producer: ship each layer as it is computed (off: all of a step's layers after
    # its forward pass, which exposes the whole transfer; for comparisons).
    layerwise: bool = True
    # Consumer: a KV stream whose first frame has not arrived by then is cancelled, so
    # idle connections cannot hold the receiver's handler threads.
    header_timeout_s: float = TRANSPORT_DEFAULTS.header_timeout_s
    # Consumer: most bytes staged; beyond, new transfers are refused.
    max_staged_bytes: int = TRANSPORT_DEFAULTS.max_staged_bytes
    # Both: internal mTLS of the KV channels (PEM files; all three, or none: plaintext).
    tls_ca_file: str = ""
    tls_cert_file: str = ""
    tls_key_file: str = ""
    allow_faults: bool = False  # both: accept fault injection (tests, failure drills)

    def __post_init__(self) -> None:
        if self.kv_transport not in KINDS:
            raise ValueError(f"KVSettings: kv_transport {self.kv_transport!r} is not one of "
                             f"{', '.join(KINDS)}")
        checksum.check(self.checksum)

    def transport_config(self, gpu: str = "") -> TransportConfig:
        """The transports' view. `gpu` is this worker's GPU ("cuda:N"; "" when its engine
        runs on none): same-host transfers go over CUDA IPC from it when shm and cuda_ipc
        are on."""
        return TransportConfig(
            chunk_bytes=self.chunk_bytes,
            lease_s=self.lease_s,
            max_streams=self.max_streams,
            max_staged_bytes=self.max_staged_bytes,
            checksum=self.checksum,
            shm=self.shm,
            ipc_device=gpu if self.shm and self.cuda_ipc else "",
            gpu=gpu,
            header_timeout_s=self.header_timeout_s,
            tls_ca_file=self.tls_ca_file,
            tls_cert_file=self.tls_cert_file,
            tls_key_file=self.tls_key_file,
        )
