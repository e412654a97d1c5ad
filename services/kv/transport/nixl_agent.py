"""The NIXL side of the `nixl` KV transport: one agent per process, and the memory it
registers once.

`agent()` makes the process's NIXL agent on first use (UCX backend, no progress thread:
whoever waits on a transfer or a notification drives UCX itself, so an idle worker spends
no CPU on it) and keeps it for the process's life; a sender and a receiver in one process
share it. `Arena` is one block of memory registered with that agent once, at start, and
carved into regions per transfer: the receiver's staging (the regions senders WRITE into)
and the sender's source buffers (what it WRITEs from). Host memory registers as DRAM and
GPU memory as VRAM; that choice, made from the tensor's device, is the only difference
between the two.

A region of a failed or cancelled transfer is not reused at once: a one-sided WRITE its
peer posted may still land in it (the receiver cannot revoke it), so it is quarantined for
`quarantine_s` (the transfer lease), by which time the peer's own guards have ended it.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

logger = logging.getLogger(__name__)

ALIGN = 64 << 10  # regions start on this boundary (and are rounded up to it)


class NixlUnavailable(RuntimeError):
    """NIXL is not installed, or its UCX backend cannot start here."""


class Agent:
    """The process's NIXL agent: thread-safe (NIXL's strict sync mode), UCX backend."""

    def __init__(self) -> None:
        try:
            from nixl._api import (  # type: ignore[import-untyped]
                nixl_agent,
                nixl_agent_config,
                nixl_thread_sync_t,
            )
        except ImportError as e:
            raise NixlUnavailable(
                f"the nixl KV transport needs the nixl package ({e}); install pdserve's "
                "gpu extra or requirements/cpu.lock, or choose --kv-transport grpc"
            ) from None
        self.name = f"pdserve-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        config = nixl_agent_config(
            enable_prog_thread=False,
            backends=[],
            sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT,
        )
        try:
            self.nixl = nixl_agent(self.name, config)
            self.nixl.create_backend("UCX", {})
        except Exception as e:  # nixl raises its own error types from C++
            raise NixlUnavailable(f"cannot start a NIXL agent with UCX: {e}") from None
        self._lock = threading.Lock()
        self._remotes: dict[str, bytes] = {}  # loaded peer agent -> its metadata
        # Notifications by (sender agent, tag), for tags someone waits on; others dropped.
        self._notes: dict[tuple[str, str], list[bytes]] = {}
        self._notes_cond = threading.Condition()
        self._pump_thread: threading.Thread | None = None

    def metadata(self) -> bytes:
        return bytes(self.nixl.get_agent_metadata())

    def remote(self, metadata: bytes, name: str) -> bool:
        """Load the metadata of peer agent `name` once; False if the metadata is another
        agent's (or `name` came before with other metadata). A loaded agent is never
        loaded again: NIXL fails the transfers in flight to an agent it reloads."""
        with self._lock:
            known = self._remotes.get(name)
            if known is not None:
                return known == metadata
            loaded = self.nixl.add_remote_agent(metadata)
            loaded = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
            self._remotes[loaded] = metadata
            return loaded == name

    def retire_peer(self, old: str) -> None:
        """Forget agent `old`, which a receiver at the same address replaced."""
        with self._lock:
            if self._remotes.pop(old, None) is not None:
                self._drop(old)

    def _drop(self, name: str) -> None:
        try:
            self.nixl.remove_remote_agent(name)
        except Exception as e:  # nixl raises its own error types from C++
            logger.debug("removing NIXL agent %s: %s", name, e)

    def descs(self, regions: list[tuple[int, int, int]], mem: str) -> Any:
        """A transfer descriptor list of (address, bytes, device id) regions."""
        return self.nixl.get_xfer_descs(regions, mem)

    def write(
        self, local: Any, remote: Any, peer: str, note: bytes, keep_going: Callable[[], bool]
    ) -> str | None:
        """WRITE `local` into `remote` at agent `peer`, with notification `note` delivered
        after the data; drives UCX until done. None on success, else why it failed; gives
        up (cancelling the request) once `keep_going()` is False."""
        try:  # NIXL refuses a region its peer never registered, or an unknown peer
            handle = self.nixl.initialize_xfer("WRITE", local, remote, peer, note)
        except Exception as e:
            return f"NIXL refused the transfer: {type(e).__name__}: {e}"
        try:
            state, delay = self.nixl.transfer(handle), 0.0
            while state == "PROC":
                if not keep_going():
                    return "given up while in flight"
                if delay:
                    time.sleep(delay)
                delay = min(delay * 2 or 20e-6, 1e-3)
                state = self.nixl.check_xfer_state(handle)
            return None if state == "DONE" else f"NIXL transfer state {state}"
        except Exception as e:
            return f"NIXL transfer failed: {type(e).__name__}: {e}"
        finally:
            try:
                handle.release()  # cancels a request still in flight
            except Exception as e:
                logger.warning("NIXL transfer to %s not released: %s", peer, e)

    # -- notifications -------------------------------------------------------------------
    def expect(self, peer: str, tag: str) -> None:
        """Keep notifications from `peer` under `tag`, and drive UCX until `unexpect`:
        without a progress thread, a receiver's UCX answers connections and takes
        notifications (and, over TCP, the data itself) only while someone drives it."""
        with self._notes_cond:
            self._notes[(peer, tag)] = []
            if self._pump_thread is None:
                self._pump_thread = threading.Thread(
                    target=self._pump, name="nixl-pump", daemon=True
                )
                self._pump_thread.start()
            self._notes_cond.notify_all()

    def unexpect(self, peer: str, tag: str) -> None:
        with self._notes_cond:
            self._notes.pop((peer, tag), None)

    def wait_note(self, peer: str, tag: str, want: bytes, timeout: float) -> bool:
        """Wait until `peer` sent notification `want` under `tag` (and take it). Its sender
        announces a layer once the WRITE is done, so the note is usually in UCX already:
        drain UCX here first rather than wait for the pump's next round."""
        deadline = time.monotonic() + timeout
        while True:
            with self._notes_cond:
                box = self._notes.get((peer, tag))
                if box is None:
                    return False
                if want in box:
                    box.remove(want)
                    return True
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
            if not self._drain():
                with self._notes_cond:
                    self._notes_cond.wait(min(left, 200e-6))

    def _pump(self) -> None:
        """Drive UCX while any transfer is expected; sleeps on the condition while none
        is. Backs off to a millisecond between polls while nothing arrives, so a slow
        transfer costs little CPU."""
        delay = 0.0
        while True:
            with self._notes_cond:
                while not self._notes:
                    self._notes_cond.wait()
            if self._drain():
                delay = 0.0
            else:
                time.sleep(delay)
                delay = min(delay * 2 or 10e-6, 1e-3)

    def _drain(self) -> bool:
        """Drive UCX once and file new notifications under their (peer, tag); whether
        any came."""
        fresh = self.nixl.get_new_notifs()
        if not fresh:
            return False
        with self._notes_cond:
            for peer, notes in fresh.items():
                who = peer.decode() if isinstance(peer, bytes) else str(peer)
                for note in notes:
                    tag = bytes(note).split(b":", 1)[0].decode(errors="replace")
                    box = self._notes.get((who, tag))
                    if box is None:  # nobody waits for it: stale, or not ours
                        logger.warning(
                            "NIXL notification from %s for unknown transfer tag %r dropped",
                            who,
                            tag[:40],
                        )
                    else:
                        box.append(bytes(note))
            self._notes_cond.notify_all()
        return True


@functools.cache
def agent() -> Agent:
    """This process's NIXL agent, made on first use."""
    return Agent()


@dataclass(frozen=True, slots=True)
class Region:
    offset: int
    nbytes: int


class Arena:
    """One registered block of memory handed out in regions; the `Pool` of staging (see
    `staging.Pool`) for the receiver, the source buffers for the sender."""

    def __init__(
        self,
        owner: Agent,
        nbytes: int,
        device: torch.device,
        quarantine_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.agent, self.quarantine_s, self._clock = owner, quarantine_s, clock
        self.nbytes = -(-nbytes // ALIGN) * ALIGN
        # Not an inference tensor, though vLLM makes the sender inside its forward pass
        # (inference mode): the transfer threads write into it outside that mode.
        with torch.inference_mode(False):
            self.memory = torch.empty(self.nbytes, dtype=torch.uint8, device=device)
        # The one branch between host and GPU: NIXL registers by the tensor's device.
        self.mem = "VRAM" if self.memory.is_cuda else "DRAM"
        self.device_id = (self.memory.device.index or 0) if self.memory.is_cuda else 0
        self._registration = owner.nixl.register_memory([self.memory])
        self.base = self.memory.data_ptr()
        self._lock = threading.Lock()
        self._free: list[Region] = [Region(0, self.nbytes)]  # by offset, coalesced
        self._lent: dict[int, Region] = {}  # data_ptr of a handed-out view -> its region
        self._quarantined: list[tuple[float, Region]] = []

    def get(self, nbytes: int) -> torch.Tensor:
        """A region of at least `nbytes`; RuntimeError when none is free."""
        size = max(-(-nbytes // ALIGN) * ALIGN, ALIGN)
        with self._lock:
            self._thaw()
            for i, free in enumerate(self._free):
                if free.nbytes >= size:
                    taken = Region(free.offset, size)
                    rest = Region(free.offset + size, free.nbytes - size)
                    self._free[i : i + 1] = [rest] if rest.nbytes else []
                    view = self.memory[taken.offset : taken.offset + size]
                    self._lent[view.data_ptr()] = taken
                    return view
        raise RuntimeError(
            f"NIXL arena full: no free region of {size} bytes "
            f"({self.free_bytes} of {self.nbytes} free)"
        )

    def put(self, view: torch.Tensor) -> None:
        """Give a region back for reuse: its transfer is over and nothing writes into it."""
        with self._lock:
            region = self._lent.pop(view.data_ptr(), None)
            if region is not None:
                self._insert(region)

    def retire(self, view: torch.Tensor) -> None:
        """Give a region back after `quarantine_s`: a WRITE may still land in it."""
        with self._lock:
            region = self._lent.pop(view.data_ptr(), None)
            if region is not None:
                self._quarantined.append((self._clock() + self.quarantine_s, region))

    def describe(self, view: torch.Tensor) -> dict[str, Any]:
        """Where a peer WRITEs to reach `view`: its address, length, device, memory kind."""
        return {
            "addr": view.data_ptr(),
            "nbytes": view.numel(),
            "device": self.device_id,
            "mem": self.mem,
        }

    def owns(self, view: torch.Tensor) -> bool:
        return self.base <= view.data_ptr() < self.base + self.nbytes

    @property
    def free_bytes(self) -> int:
        """Bytes free now (quarantined regions whose time is up count as free)."""
        with self._lock:
            self._thaw()
            return sum(r.nbytes for r in self._free)

    def close(self) -> None:
        try:
            self.agent.nixl.deregister_memory(self._registration)
        except Exception as e:
            logger.debug("deregistering a NIXL arena: %s", e)

    def _thaw(self) -> None:
        now = self._clock()
        due = [r for until, r in self._quarantined if until <= now]
        if due:
            self._quarantined = [(u, r) for u, r in self._quarantined if u > now]
            for region in due:
                self._insert(region)

    def _insert(self, region: Region) -> None:
        free = sorted([*self._free, region], key=lambda r: r.offset)
        merged: list[Region] = []
        for r in free:
            if merged and merged[-1].offset + merged[-1].nbytes == r.offset:
                last = merged.pop()
                r = Region(last.offset, last.nbytes + r.nbytes)
            merged.append(r)
        self._free = merged
