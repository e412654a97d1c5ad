"""Receiver of the torch transport: serves pair groups (Pair method) on the same gRPC
server that still accepts gRPC Push transfers. The rendezvous store lives on its own
port for the receiver's whole life; see `torch_pair` for the protocol.

Each pair's receiving half (`PairIn`) is driven by its control stream's handler thread
only: it posts a recv of exactly the announced size for each LAYER frame (draining what
it cannot accept, so the pair stays in step), verifies checksums, answers with ACKs."""

from __future__ import annotations

import datetime
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import grpc
import torch
from torch.distributed import PrefixStore, TCPStore

from services.kv.fingerprint import PeerIdentity
from services.kv.transport import frames
from services.kv.transport.frames import ControlFrame, FrameError, FrameKind
from services.kv.transport.grpc_receiver import GrpcKVReceiver
from services.kv.transport.spec import TransportConfig
from services.kv.transport.staging import Refused, Staged, TransferFault
from services.kv.transport.torch_pair import (
    DRAIN_LIMIT,
    PAIR_ID,
    build_pair_group,
    payload_checksum,
)

logger = logging.getLogger(__name__)


class PairIn:
    """Receiver half of one pair; driven by its control stream's handler thread only."""

    def __init__(self, receiver: GrpcKVReceiver, sender: PeerIdentity, pg: Any) -> None:
        self.table, self.sender, self.pg = receiver.table, sender, pg
        self.device = receiver.config.device
        self.live: dict[str, Staged] = {}
        # A received layer whose checksum is verified while the next one is on the wire.
        self.pending: tuple[Staged, int, torch.Tensor, int] | None = None

    def handle(self, frame: Any) -> list[bytes]:
        """Act on one control frame; returns ACK frames to send back."""
        if not isinstance(frame, ControlFrame):
            raise FrameError("DATA frames do not belong on a pair stream")
        acks: list[bytes] = []
        body, kind = frame.body, frame.kind
        if kind is FrameKind.LAYER:
            work, entry = self._post_recv(body, acks)
            self._verify_pending(acks)
            work.wait()
            self.pending = entry
            return acks
        self._verify_pending(acks)
        if kind is FrameKind.HEADER:
            sender, spec, algorithm = frames.decode_header(body)
            try:
                if sender != self.sender:
                    raise Refused(
                        f"header from {sender.worker_id} on {self.sender.worker_id}'s pair"
                    )
                self.live[spec.transfer_id] = self.table.open(sender, spec, algorithm)
            except Refused as e:
                acks.append(frames.encode_ack(spec.transfer_id, False, f"refused: {e}", 0))
            return acks
        tid = frames.field(body, "transfer_id", str)
        if kind is FrameKind.END:
            st = self.live.pop(tid, None)
            if st is not None:  # else it already failed and was acked
                try:
                    chunks, nbytes = (
                        frames.field(body, "chunks", int),
                        frames.field(body, "nbytes", int),
                    )
                    acks.append(
                        frames.encode_ack(tid, True, None, self.table.finish(st, chunks, nbytes))
                    )
                except (TransferFault, Refused) as e:  # Refused: released mid-way
                    self._fail(tid, str(e), acks, st)
        elif kind is FrameKind.CANCEL:
            reason = str(body.get("reason", ""))[:500]
            self.table.fail(self.live.pop(tid, None), f"cancelled by sender: {reason}")
        else:
            raise FrameError(f"unexpected {kind.name} frame on a pair stream")
        return acks

    def _post_recv(self, body: dict[str, Any], acks: list[bytes]) -> tuple[Any, Any]:
        tid = frames.field(body, "transfer_id", str)
        layer, nbytes = frames.field(body, "layer", int), frames.field(body, "nbytes", int)
        crc, tag = frames.field(body, "checksum", int), frames.field(body, "tag", int)
        st = self.live.get(tid)
        if st is not None:
            try:
                flat = self.table.layer_buffer(st, layer, nbytes).reshape(-1).view(torch.uint8)
                return self.pg.recv([flat], 0, tag), (st, layer, flat, crc)
            except (TransferFault, Refused) as e:  # Refused: released mid-way
                self._fail(tid, str(e), acks)
        # Unknown, failed or refused transfer: take the payload and drop it, so that the
        # next recv lines up with the next send (gloo kills a process on a size mismatch).
        if not 0 < nbytes <= DRAIN_LIMIT:
            raise FrameError(f"LAYER frame of {nbytes} bytes cannot be drained")
        scratch = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        return self.pg.recv([scratch], 0, tag), None

    def _verify_pending(self, acks: list[bytes]) -> None:
        if self.pending is None:
            return
        st, layer, flat, crc = self.pending
        self.pending = None
        tid = st.spec.transfer_id
        if self.live.get(tid) is not st:
            return  # failed meanwhile
        t0 = time.perf_counter()
        intact = payload_checksum(st.checksum, flat) == crc
        checksum_s = time.perf_counter() - t0
        if not intact:
            self._fail(tid, f"checksum mismatch in layer {layer}", acks)
        else:
            self.table.layer_received(st, layer, checksum_s)

    def _fail(self, tid: str, reason: str, acks: list[bytes], st: Staged | None = None) -> None:
        self.table.fail(self.live.pop(tid, None) or st, reason)
        acks.append(frames.encode_ack(tid, False, reason, 0))

    def close(self, reason: str) -> int:
        """Fail what is still in flight; returns how many transfers that was."""
        failed = len(self.live)
        for st in self.live.values():
            self.table.fail(st, reason)
        self.live.clear()
        self.pg.abort()
        return failed


class TorchDistReceiver(GrpcKVReceiver):
    """KVReceiver that also serves pair groups (and still accepts gRPC Push transfers)."""

    def __init__(
        self, identity: PeerIdentity, config: TransportConfig, host: str, port: int
    ) -> None:
        # The rendezvous store lives on its own port for the receiver's whole life. Its
        # server would listen on every interface whatever `host` says, so it is handed a
        # socket bound to `host` (TCPStore owns and closes the descriptor).
        listener = socket.create_server(
            (host, 0), family=socket.AF_INET6 if ":" in host else socket.AF_INET)
        store_port = listener.getsockname()[1]
        fd = listener.detach()
        try:
            self._store = TCPStore(
                host,
                store_port,
                is_master=True,
                wait_for_workers=False,
                timeout=datetime.timedelta(seconds=config.stall_timeout_s),
                master_listen_fd=fd,
            )
        except BaseException:
            os.close(fd)
            raise
        self._groups: set[Any] = set()
        self._groups_lock = threading.Lock()
        super().__init__(identity, config, host, port)

    @property
    def store_port(self) -> int:
        return int(self._store.port)

    def _methods(self) -> dict[str, grpc.RpcMethodHandler]:
        methods = super()._methods()
        methods["Pair"] = grpc.stream_stream_rpc_method_handler(self._pair)
        return methods

    def close(self) -> None:
        with self._groups_lock:
            groups, self._groups = list(self._groups), set()
        for pg in groups:  # a handler blocked in recv still ends by the group timeout
            pg.abort()
        super().close()

    def _pair(self, requests: Iterator[bytes], context: grpc.ServicerContext) -> Iterator[bytes]:
        pair: PairIn | None = None
        reason, code = "control stream closed by the sender", None
        try:
            first = self.first_frame(requests, context)
            hello = frames.decode_frame(first) if first is not None else None
            if not isinstance(hello, ControlFrame) or hello.kind is not FrameKind.HELLO:
                raise FrameError("a pair stream must start with HELLO")
            sender = PeerIdentity.from_dict(frames.field(hello.body, "sender", dict))
            pair_id = frames.field(hello.body, "pair_id", str)
            device = frames.field(hello.body, "device", str)
            if not PAIR_ID.match(pair_id):
                raise FrameError(f"bad pair id {pair_id!r}")
            if device != torch.device(self.config.device).type:
                raise FrameError(f"sender uses {device}, receiver stages on {self.config.device}")
            prefix = f"pair/{pair_id}/{uuid.uuid4().hex[:8]}"
            body = {"store_port": self.store_port, "prefix": prefix}
            yield frames.encode_control(FrameKind.READY, body)
            host = frames.field(hello.body, "receiver_host", str)
            pg = build_pair_group(
                PrefixStore(prefix, self._store),
                1,
                host,
                self.config.device,
                self.config.stall_timeout_s,
            )
            pair = PairIn(self, sender, pg)
            with self._groups_lock:
                self._groups.add(pg)
            for raw in requests:
                yield from pair.handle(frames.decode_frame(raw))
        except FrameError as e:
            reason, code = f"malformed pair frame: {e}", grpc.StatusCode.INVALID_ARGUMENT
        except ValueError as e:
            reason, code = f"bad pair hello: {e}", grpc.StatusCode.INVALID_ARGUMENT
        except grpc.RpcError:
            reason = "control stream dropped"
        except RuntimeError as e:  # gloo: peer gone, timeout, aborted
            reason = f"pair group failed: {e}"
        finally:
            failed = pair.close(reason) if pair is not None else 0
            if pair is not None:
                with self._groups_lock:
                    self._groups.discard(pair.pg)
        level = logging.WARNING if code is not None or failed else logging.INFO
        logger.log(level, "KV pair stream from %s ended: %s", context.peer(), reason)
        if code is not None:
            context.abort(code, reason)
