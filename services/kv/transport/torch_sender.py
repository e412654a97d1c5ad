"""Sender of the torch transport: payloads over torch.distributed pair groups, one pair
(and one control stream) per receiver, reused by every transfer to it."""

from __future__ import annotations

import threading

import grpc

from services.kv.fingerprint import PeerIdentity
from services.kv.transport.grpc_channel import open_channel
from services.kv.transport.sender_core import STOP_ITEM, Item, Outgoing, SenderCore
from services.kv.transport.spec import TransportConfig
from services.kv.transport.torch_pair_out import PairOut


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
