"""Receiver of the torch transport: serves pair groups (Pair method) on the same gRPC
server that still accepts gRPC Push transfers. The rendezvous store lives on its own
port for the receiver's whole life; see `torch_pair` for the protocol."""

from __future__ import annotations

import datetime
import logging
import threading
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
from services.kv.transport.torch_pair import PAIR_ID, build_pair_group
from services.kv.transport.torch_pair_in import PairIn

logger = logging.getLogger(__name__)


class TorchDistReceiver(GrpcKVReceiver):
    """KVReceiver that also serves pair groups (and still accepts gRPC Push transfers)."""

    def __init__(
        self, identity: PeerIdentity, config: TransportConfig, host: str, port: int
    ) -> None:
        # The rendezvous store lives on its own port for the receiver's whole life.
        self._store = TCPStore(
            host,
            0,
            is_master=True,
            wait_for_workers=False,
            timeout=datetime.timedelta(seconds=config.stall_timeout_s),
        )
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
