"""KV transport over torch.distributed point-to-point: payload on a 2-rank pair group.

Per (sender, receiver) pair there is one process group and one bidirectional gRPC
control stream (method Pair). The stream carries HELLO/READY (rendezvous: the receiver
hosts a TCPStore on its own port and names a fresh key prefix for each pair, since stale
keys of an earlier pair would mislead the rendezvous), then HEADER, LAYER (size, crc32,
tag), END and CANCEL for any number of transfers, answered by ACK frames.

Why one control stream per pair rather than per transfer: a gloo send/recv pair must
agree on the size, or gloo kills the receiving process, and a pair group is driven by one
thread at a time on each side. With one ordered stream per pair, each side's single pair
thread meets every LAYER frame in the order the payloads travel, so the receiver always
posts a recv of exactly the announced size (a layer it cannot accept is drained into
scratch memory, which keeps the pair in step). Anything that breaks the stream or the
group fails the pair's transfers, and the next transfer builds a new pair.

CPU tensors use ProcessGroupGloo. CUDA tensors take the ProcessGroupNCCL branch, which
cannot run on a CPU-only machine and is untested; there the checksum is computed on a host
copy of each layer (correct, but it costs a device-to-host copy).
"""

from __future__ import annotations

import collections
import datetime
import logging
import queue
import re
import socket
import threading
import time
import uuid
import zlib
from collections.abc import Iterator
from typing import Any

import grpc
import torch
from torch.distributed import PrefixStore, ProcessGroupGloo, Store, TCPStore

from services.kv import frames
from services.kv.fingerprint import PeerIdentity
from services.kv.frames import ControlFrame, FrameError, FrameKind
from services.kv.transport.base import (
    END_ITEM,
    STOP_ITEM,
    Outgoing,
    SenderCore,
    TransportConfig,
)
from services.kv.transport.grpc_transport import (
    SERVICE,
    GrpcKVReceiver,
    channel_options,
    rpc_error_text,
)
from services.kv.transport.staging import Refused, Staged, TransferFault

logger = logging.getLogger(__name__)

PAIR = f"/{SERVICE}/Pair"
SEND_WINDOW = 2  # layers in flight per pair
DRAIN_LIMIT = 1 << 30  # a bad LAYER frame larger than this breaks the pair instead
_TAG_MOD = 1 << 30
_PAIR_ID = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


def local_ip_towards(host: str) -> str:
    """The local address this host uses to reach `host` (no packet is sent)."""
    family, _, _, _, addr = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect(addr)
        return str(s.getsockname()[0])


def build_pair_group(store: Store, rank: int, hostname: str, device: str, timeout_s: float) -> Any:
    """A 2-rank group without global init; blocks until the other rank joins."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if torch.device(device).type == "cuda":  # untested branch: needs two GPUs
        from torch.distributed import ProcessGroupNCCL

        nccl_opts = ProcessGroupNCCL.Options()
        nccl_opts._timeout = timeout
        return ProcessGroupNCCL(store, rank, 2, nccl_opts)
    opts = ProcessGroupGloo._Options()
    opts._devices = [ProcessGroupGloo.create_device(hostname=hostname)]
    opts._timeout = timeout
    return ProcessGroupGloo(store, rank, 2, opts)


def payload_crc(flat: torch.Tensor) -> int:
    """crc32 of a flat uint8 tensor (a host copy for CUDA tensors)."""
    return zlib.crc32(frames.byte_view(flat if flat.device.type == "cpu" else flat.cpu()))


def _host_and_port(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


class _PairOut:
    """Sender half of one pair: a thread that drives the group, one that reads acks."""

    def __init__(self, sender: TorchDistSender, peer: str) -> None:
        self.sender, self.peer = sender, peer
        self.device = torch.device(sender.config.device)
        self.jobs: queue.SimpleQueue[tuple[Outgoing, Any] | None] = queue.SimpleQueue()
        self.control: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self.outs: set[Outgoing] = set()  # transfers assigned here (sender lock)
        self.awaiting: dict[str, Outgoing] = {}  # header sent, no ack yet (sender lock)
        self.broken: str | None = None
        self.pg: Any = None
        self.call: Any = None
        self.seq = 0
        threading.Thread(target=self._run, name=f"kv-pair-{peer}", daemon=True).start()

    def _requests(self) -> Iterator[bytes]:
        while (frame := self.control.get()) is not None:
            yield frame

    def _run(self) -> None:
        reason = "pair closed"
        try:
            call = self._connect()
            threading.Thread(target=self._read_acks, args=(call,), daemon=True).start()
            self._loop()
        except grpc.RpcError as e:
            reason = f"pair control stream failed: {rpc_error_text(e)}"
        except Exception as e:  # gloo errors, rendezvous timeouts, bad replies
            reason = f"pair with {self.peer} broke: {e}"
        finally:
            self._teardown(reason)
            if self.pg is not None:
                self.pg.abort()

    def _connect(self) -> Any:
        cfg, identity = self.sender.config, self.sender.identity
        self.call = self.sender.channel(self.peer).stream_stream(PAIR)(self._requests())
        host, _ = _host_and_port(self.peer)
        hello = {
            "sender": identity.to_dict(),
            "pair_id": uuid.uuid4().hex,
            "receiver_host": host,
            "device": self.device.type,
        }
        self.control.put(frames.encode_control(FrameKind.HELLO, hello))
        timer = threading.Timer(cfg.stall_timeout_s, self.call.cancel)
        timer.start()  # a receiver that never answers must not hang the pair thread
        try:
            ready = frames.decode_frame(next(self.call))
        finally:
            timer.cancel()
        if not isinstance(ready, ControlFrame) or ready.kind is not FrameKind.READY:
            raise FrameError("expected READY")
        store = TCPStore(
            host,
            frames.field(ready.body, "store_port", int),
            is_master=False,
            timeout=datetime.timedelta(seconds=cfg.stall_timeout_s),
        )
        prefixed = PrefixStore(frames.field(ready.body, "prefix", str), store)
        self.pg = build_pair_group(
            prefixed, 0, local_ip_towards(host), str(self.device), cfg.stall_timeout_s
        )
        return self.call

    def _read_acks(self, call: Any) -> None:
        reason = "control stream closed by the receiver"
        try:
            for raw in call:
                tid, ok, error, nbytes = frames.decode_ack(raw)
                with self.sender._lock:
                    out = self.awaiting.pop(tid, None)
                if out is not None:
                    if ok and nbytes != out.spec.total_nbytes:
                        ok, error = False, f"receiver acked {nbytes} bytes"
                    self.sender._complete(out, ok, error, nbytes if ok else 0)
        except grpc.RpcError as e:
            reason = f"control stream: {rpc_error_text(e)}"
        except FrameError as e:
            reason = f"bad ack from receiver: {e}"
        self.break_pair(reason)

    def break_pair(self, reason: str) -> None:
        with self.sender._lock:
            if self.broken is None:
                self.broken = reason
        self.jobs.put(None)

    def _loop(self) -> None:
        # Up to SEND_WINDOW layers on the wire: the receiver finds the next LAYER frame
        # already waiting when a recv completes, and the next layer's crc32 is computed
        # while earlier ones travel.
        inflight: collections.deque[tuple[Outgoing, Any, Any]] = collections.deque()
        try:
            while self.broken is None:
                self._check_stalls()  # cheap: a handful of transfers per pair
                try:
                    if inflight:
                        job = self.jobs.get_nowait()
                    else:
                        job = self.jobs.get(timeout=self._next_deadline())
                except queue.Empty:  # idle: complete a send, or go check for stalls
                    if inflight:
                        self._finish_send(inflight.popleft())
                    continue
                if job is None:
                    return
                out, item = job
                try:
                    prepared = self._prepare(out, item)
                    while inflight and (prepared is None or len(inflight) >= SEND_WINDOW):
                        self._finish_send(inflight.popleft())
                except BaseException:
                    self.sender._release_item(item)
                    raise
                started = self._do(out, item, prepared)
                if started is not None:
                    inflight.append(started)
        finally:
            for _, item, _ in inflight:
                self.sender._release_item(item)

    def _prepare(self, out: Outgoing, item: Any) -> tuple[torch.Tensor, int] | None:
        """The flat bytes and crc32 of a layer item (None for other items)."""
        if not isinstance(item, tuple) or out.done:
            return None
        layer_idx, tensor, event = item
        try:
            if event is not None:  # CUDA producer: wait for its index_select
                event.synchronize()
            flat = tensor.to(self.device).contiguous().reshape(-1).view(torch.uint8)
            crc = payload_crc(flat)
            if out.corrupt:  # fault injection: damage a copy after the checksum
                out.corrupt, flat = False, flat.clone()
                flat[0] ^= 0xFF
            return flat, crc
        except Exception as e:  # a bad tensor fails its transfer, not the pair
            self.sender._fail(out, f"cannot prepare layer {layer_idx}: {e}")
            return None

    def _finish_send(self, inflight: tuple[Outgoing, Any, Any]) -> None:
        """Wait for a send on the wire; frees its queue slot."""
        out, item, work = inflight
        try:
            work.wait()
        finally:
            self.sender._release_item(item)
        out.last_progress, out.phase = time.monotonic(), "waiting for layers"

    def _do(
        self, out: Outgoing, item: Any, prepared: tuple[torch.Tensor, int] | None
    ) -> tuple[Outgoing, Any, Any] | None:
        """Act on one job; returns the send now in flight, if it started one."""
        spec, tid, now = out.spec, out.spec.transfer_id, time.monotonic()
        if item == STOP_ITEM:  # failed or cancelled locally: tell the receiver
            with self.sender._lock:
                headered = self.awaiting.pop(tid, None) is not None
            if headered:
                body: dict[str, Any] = {"transfer_id": tid, "reason": out.error or "cancelled"}
                self.control.put(frames.encode_control(FrameKind.CANCEL, body))
        elif item == "header" and not out.done:
            with self.sender._lock:
                self.awaiting[tid] = out
            out.first_send_ts = out.last_progress = now
            out.phase = "waiting for layers"
            self.control.put(frames.encode_header(self.sender.identity, spec))
        elif item == END_ITEM and not out.done:
            out.last_progress, out.phase = now, "waiting for the receiver's ack"
            body = {"transfer_id": tid, "chunks": spec.num_layers, "nbytes": spec.total_nbytes}
            self.control.put(frames.encode_control(FrameKind.END, body))
        elif prepared is not None and not out.done:
            flat, crc = prepared
            self.seq = (self.seq + 1) % _TAG_MOD
            out.last_progress, out.phase = now, f"sending layer {item[0]}"
            body = {"transfer_id": tid, "layer": item[0], "nbytes": flat.numel(), "crc": crc}
            self.control.put(frames.encode_control(FrameKind.LAYER, {**body, "tag": self.seq}))
            try:
                return out, item, self.pg.send([flat], 1, self.seq)
            except BaseException:
                self.sender._release_item(item)
                raise
        self.sender._release_item(item)
        return None

    def _next_deadline(self) -> float | None:
        with self.sender._lock:
            live = [o.last_progress for o in self.awaiting.values() if not o.done]
        if not live:
            return None
        left = min(live) + self.sender.config.stall_timeout_s - time.monotonic()
        return max(left, 0.05)

    def _check_stalls(self) -> None:
        stall, now = self.sender.config.stall_timeout_s, time.monotonic()
        with self.sender._lock:
            outs = list(self.awaiting.values())
        for out in outs:
            if now - out.last_progress >= stall:
                self.sender._fail(out, f"no progress for {stall:.1f}s while {out.phase}")

    def _teardown(self, reason: str) -> None:
        with self.sender._lock:  # after this no job can be queued for these transfers
            self.broken = self.broken or reason
            outs = [o for o in self.outs if not o.done]
        for out in outs:
            self.sender._fail(out, self.broken)
        self.control.put(None)
        if self.call is not None:
            self.call.cancel()
        while True:
            try:
                job = self.jobs.get_nowait()
            except queue.Empty:
                return
            if job is not None:
                self.sender._release_item(job[1])


class TorchDistSender(SenderCore):
    """KVSender whose payload travels over torch.distributed pair groups."""

    def __init__(self, identity: PeerIdentity, config: TransportConfig) -> None:
        super().__init__(identity, config)
        self._pairs: dict[str, _PairOut] = {}
        self._channels: dict[str, grpc.Channel] = {}

    def channel(self, peer: str) -> grpc.Channel:
        with self._lock:
            if peer not in self._channels:
                self._channels[peer] = grpc.insecure_channel(peer, channel_options(self.config))
            return self._channels[peer]

    # -- SenderCore hooks ----------------------------------------------------------------
    def _start(self, out: Outgoing) -> None:
        with self._lock:
            pair = self._pairs.get(out.peer)
            if pair is None or pair.broken is not None:
                pair = self._pairs[out.peer] = _PairOut(self, out.peer)
            pair.outs = {o for o in pair.outs if not o.done}
            pair.outs.add(out)
            out.call = pair
            pair.jobs.put((out, "header"))

    def _enqueue(self, out: Outgoing, item: Any) -> None:
        out.call.jobs.put((out, item))

    def _abort(self, out: Outgoing) -> None:
        out.call.jobs.put((out, STOP_ITEM))

    def _close_transport(self) -> None:
        with self._lock:
            pairs, self._pairs = list(self._pairs.values()), {}
            channels, self._channels = list(self._channels.values()), {}
        for pair in pairs:
            pair.break_pair("sender closed")
        for channel in channels:
            channel.close()


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
        pair: _PairIn | None = None
        reason, code = "control stream closed by the sender", None
        try:
            first = next(requests, None)
            hello = frames.decode_frame(first) if first is not None else None
            if not isinstance(hello, ControlFrame) or hello.kind is not FrameKind.HELLO:
                raise FrameError("a pair stream must start with HELLO")
            sender = PeerIdentity.from_dict(frames.field(hello.body, "sender", dict))
            pair_id = frames.field(hello.body, "pair_id", str)
            device = frames.field(hello.body, "device", str)
            if not _PAIR_ID.match(pair_id):
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
            pair = _PairIn(self, sender, pg)
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


class _PairIn:
    """Receiver half of one pair; driven by its control stream's handler thread only."""

    def __init__(self, receiver: TorchDistReceiver, sender: PeerIdentity, pg: Any) -> None:
        self.table, self.sender, self.pg = receiver.table, sender, pg
        self.device = receiver.config.device
        self.live: dict[str, Staged] = {}
        # A received layer whose crc32 is checked while the next one is on the wire.
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
            sender, spec = frames.decode_header(body)
            try:
                if sender != self.sender:
                    raise Refused(
                        f"header from {sender.worker_id} on {self.sender.worker_id}'s pair"
                    )
                self.live[spec.transfer_id] = self.table.open(sender, spec)
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
                except TransferFault as e:
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
        crc, tag = frames.field(body, "crc", int), frames.field(body, "tag", int)
        st = self.live.get(tid)
        if st is not None:
            try:
                flat = self.table.layer_buffer(st, layer, nbytes).reshape(-1).view(torch.uint8)
                return self.pg.recv([flat], 0, tag), (st, layer, flat, crc)
            except TransferFault as e:
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
        if payload_crc(flat) != crc:
            self._fail(tid, f"checksum mismatch in layer {layer}", acks)
        else:
            self.table.layer_received(st, layer)

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
