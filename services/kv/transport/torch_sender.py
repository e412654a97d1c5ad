"""Sender of the torch transport: payloads over torch.distributed pair groups, one pair
(and one control stream) per receiver, reused by every transfer to it (see `torch_pair`
for the protocol).

Each pair (`PairOut`) runs a thread that drives the pair group and writes the control
stream, and one that reads the receiver's ACKs; they report outcomes through the
owning sender's public helpers only."""

from __future__ import annotations

import collections
import datetime
import logging
import queue
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
from services.kv.transport.grpc_channel import PAIR, open_channel, rpc_error_text
from services.kv.transport.sender_core import (
    END_ITEM,
    HEADER_ITEM,
    STOP_ITEM,
    Item,
    LayerItem,
    Outgoing,
    SenderCore,
)
from services.kv.transport.spec import TransportConfig
from services.kv.transport.torch_pair import (
    SEND_WINDOW,
    TAG_MOD,
    build_pair_group,
    host_and_port,
    local_ip_towards,
    payload_checksum,
)

logger = logging.getLogger(__name__)

Job = tuple[Outgoing["PairOut"], Item]
InFlight = tuple[Outgoing["PairOut"], Item, Any]  # (transfer, its layer item, gloo work)


class PairOut:
    """One (sender, receiver) pair on the sending side."""

    def __init__(self, sender: SenderCore[PairOut], channel: grpc.Channel, peer: str) -> None:
        self.sender, self.channel, self.peer = sender, channel, peer
        self.device = torch.device(sender.config.device)
        self.jobs: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self.control: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self._lock = threading.Lock()  # guards outs, awaiting, broken
        self._outs: set[Outgoing[PairOut]] = set()  # transfers assigned here
        self._awaiting: dict[str, Outgoing[PairOut]] = {}  # header sent, no ack yet
        self.broken: str | None = None
        self.pg: Any = None
        self.call: Any = None
        self.seq = 0
        threading.Thread(target=self._run, name=f"kv-pair-{peer}", daemon=True).start()

    # -- called by the sender --------------------------------------------------------------
    def assign(self, out: Outgoing[PairOut]) -> bool:
        """Take `out` on this pair (its header is queued); False if the pair is broken."""
        with self._lock:
            if self.broken is not None:
                return False
            self._outs = {o for o in self._outs if not o.done}
            self._outs.add(out)
            out.link = self
            self.jobs.put((out, HEADER_ITEM))
            return True

    def put(self, out: Outgoing[PairOut], item: Item) -> None:
        self.jobs.put((out, item))

    def break_pair(self, reason: str) -> None:
        with self._lock:
            if self.broken is None:
                self.broken = reason
        self.jobs.put(None)

    # -- the pair thread -------------------------------------------------------------------
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
        self.call = self.channel.stream_stream(PAIR)(self._requests())
        host, _ = host_and_port(self.peer)
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
                with self._lock:
                    out = self._awaiting.pop(tid, None)
                if out is not None:
                    if ok and nbytes != out.spec.total_nbytes:
                        ok, error = False, f"receiver acked {nbytes} bytes"
                    self.sender.complete(out, ok, error, nbytes if ok else 0)
        except grpc.RpcError as e:
            reason = f"control stream: {rpc_error_text(e)}"
        except FrameError as e:
            reason = f"bad ack from receiver: {e}"
        self.break_pair(reason)

    def _loop(self) -> None:
        # Up to SEND_WINDOW layers on the wire: the receiver finds the next LAYER frame
        # already waiting when a recv completes, and the next layer's checksum is computed
        # while earlier ones travel.
        inflight: collections.deque[InFlight] = collections.deque()
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
                    self.sender.release_item(item)
                    raise
                started = self._do(out, item, prepared)
                if started is not None:
                    inflight.append(started)
        finally:
            for _, item, _ in inflight:
                self.sender.release_item(item)

    def _prepare(self, out: Outgoing[PairOut], item: Item) -> tuple[torch.Tensor, int] | None:
        """The flat bytes and checksum of a layer item (None for other items)."""
        if not isinstance(item, LayerItem) or out.done:
            return None
        try:
            if item.event is not None:  # CUDA producer: wait for its index_select
                item.event.synchronize()
            flat = item.tensor.to(self.device).contiguous().reshape(-1).view(torch.uint8)
            crc = payload_checksum(self.sender.config.checksum, flat)
            if out.corrupt:  # fault injection: damage a copy after the checksum
                out.corrupt, flat = False, flat.clone()
                flat[0] ^= 0xFF
            return flat, crc
        except Exception as e:  # a bad tensor fails its transfer, not the pair
            self.sender.fail(out, f"cannot prepare layer {item.layer}: {e}")
            return None

    def _finish_send(self, inflight: InFlight) -> None:
        """Wait for a send on the wire; frees its queue slot."""
        out, item, work = inflight
        try:
            work.wait()
        finally:
            self.sender.release_item(item)
        out.last_progress, out.phase = time.monotonic(), "waiting for layers"

    def _do(
        self, out: Outgoing[PairOut], item: Item, prepared: tuple[torch.Tensor, int] | None
    ) -> InFlight | None:
        """Act on one job; returns the send now in flight, if it started one."""
        spec, tid, now = out.spec, out.spec.transfer_id, time.monotonic()
        if item == STOP_ITEM:  # failed or cancelled locally: tell the receiver
            with self._lock:
                headered = self._awaiting.pop(tid, None) is not None
            if headered:
                body: dict[str, Any] = {"transfer_id": tid, "reason": out.error or "cancelled"}
                self.control.put(frames.encode_control(FrameKind.CANCEL, body))
        elif item == HEADER_ITEM and not out.done:
            with self._lock:
                self._awaiting[tid] = out
            out.last_progress = now
            out.phase = "waiting for layers"
            self.control.put(
                frames.encode_header(self.sender.identity, spec, self.sender.config.checksum)
            )
        elif item == END_ITEM and not out.done:
            out.last_progress, out.phase = now, "waiting for the receiver's ack"
            body = {"transfer_id": tid, "chunks": spec.num_layers, "nbytes": spec.total_nbytes}
            self.control.put(frames.encode_control(FrameKind.END, body))
        elif prepared is not None and isinstance(item, LayerItem) and not out.done:
            flat, crc = prepared
            self.seq = (self.seq + 1) % TAG_MOD
            out.last_progress, out.phase = now, f"sending layer {item.layer}"
            body = {
                "transfer_id": tid,
                "layer": item.layer,
                "nbytes": flat.numel(),
                "checksum": crc,
            }
            self.control.put(frames.encode_control(FrameKind.LAYER, {**body, "tag": self.seq}))
            try:
                return out, item, self.pg.send([flat], 1, self.seq)
            except BaseException:
                self.sender.release_item(item)
                raise
        self.sender.release_item(item)
        return None

    def _next_deadline(self) -> float | None:
        with self._lock:
            live = [o.last_progress for o in self._awaiting.values() if not o.done]
        if not live:
            return None
        left = min(live) + self.sender.config.stall_timeout_s - time.monotonic()
        return max(left, 0.05)

    def _check_stalls(self) -> None:
        stall, now = self.sender.config.stall_timeout_s, time.monotonic()
        with self._lock:
            outs = list(self._awaiting.values())
        for out in outs:
            if now - out.last_progress >= stall:
                self.sender.fail(out, f"no progress for {stall:.1f}s while {out.phase}")

    def _teardown(self, reason: str) -> None:
        with self._lock:  # after this no transfer can be assigned here
            self.broken = self.broken or reason
            outs = [o for o in self._outs if not o.done]
        for out in outs:
            self.sender.fail(out, self.broken)
        self.control.put(None)
        if self.call is not None:
            self.call.cancel()
        while True:
            try:
                job = self.jobs.get_nowait()
            except queue.Empty:
                return
            if job is not None:
                self.sender.release_item(job[1])


class TorchDistSender(SenderCore[PairOut]):
    """KVSender whose payload travels over torch.distributed pair groups."""

    def __init__(self, identity: PeerIdentity, config: TransportConfig) -> None:
        super().__init__(identity, config)
        self._pairs: dict[str, PairOut] = {}
        self._channels: dict[str, grpc.Channel] = {}
        self._pairs_lock = threading.Lock()

    def _channel(self, peer: str) -> grpc.Channel:
        """Called under `_pairs_lock`."""
        if peer not in self._channels:
            self._channels[peer] = open_channel(peer, self.config)
        return self._channels[peer]

    @property
    def pair_count(self) -> int:
        with self._pairs_lock:
            return len(self._pairs)

    # -- SenderCore hooks ----------------------------------------------------------------
    def _start(self, out: Outgoing[PairOut]) -> None:
        with self._pairs_lock:
            pair = self._pairs.get(out.peer)
            if pair is None or not pair.assign(out):  # none yet, or broken: a new pair
                pair = self._pairs[out.peer] = PairOut(self, self._channel(out.peer), out.peer)
                pair.assign(out)

    def _enqueue(self, out: Outgoing[PairOut], item: Item) -> None:
        assert out.link is not None
        out.link.put(out, item)

    def _abort(self, out: Outgoing[PairOut]) -> None:
        if out.link is not None:
            out.link.put(out, STOP_ITEM)

    def _close_transport(self) -> None:
        with self._pairs_lock:
            pairs, self._pairs = list(self._pairs.values()), {}
            channels, self._channels = list(self._channels.values()), {}
        for pair in pairs:
            pair.break_pair("sender closed")
        for channel in channels:
            channel.close()
