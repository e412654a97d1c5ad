"""The receiving half of one torch pair, driven by its control stream's handler thread
only: posts a recv of exactly the announced size for each LAYER frame (draining what it
cannot accept, so the pair stays in step), verifies checksums, answers with ACKs."""

from __future__ import annotations

from typing import Any

import torch

from services.kv.fingerprint import PeerIdentity
from services.kv.transport import frames
from services.kv.transport.frames import ControlFrame, FrameError, FrameKind
from services.kv.transport.grpc_receiver import GrpcKVReceiver
from services.kv.transport.staged import Refused, Staged, TransferFault
from services.kv.transport.torch_pair import DRAIN_LIMIT, payload_checksum


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
        if payload_checksum(st.checksum, flat) != crc:
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
