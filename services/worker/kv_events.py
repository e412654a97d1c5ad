"""The worker's KV cache events: vLLM's publisher inside the engine, relayed to the one
address routers subscribe to.

vLLM's ZeroMQ publisher binds only wildcard (`tcp://*:PORT`) and ipc endpoints; given
`tcp://host:PORT` it connects instead. So the engine publishes on an ipc socket in a
directory only this user can enter, and a relay thread in the worker process forwards
every message unchanged to a PUB socket bound to the worker's own events host (loopback
by default, never a wildcard). The messages carry block hashes and token ids: anyone
who can subscribe learns which tokens the engine has cached, so the socket is bound
where only the routers reach it.
"""

from __future__ import annotations

import atexit
import logging
import shutil
import tempfile
import threading
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

# vLLM keeps past batches for replays only when a replay endpoint is set; none is.
REPLAY_BATCHES = 1


class EventRelay:
    """Forwards the engine's event messages (ipc SUB) to `host:port` (tcp PUB)."""

    def __init__(self, host: str, port: int = 0) -> None:
        import zmq

        self._dir = Path(tempfile.mkdtemp(prefix="pdserve-kv-events-"))  # mode 0700
        self.ipc_path = self._dir / "events"
        self._ctx = zmq.Context()
        self._front = self._ctx.socket(zmq.SUB)
        self._front.setsockopt(zmq.SUBSCRIBE, b"")
        # Connected before the engine binds: ZeroMQ reconnects until it does, so the
        # relay hears the engine's first batch.
        self._front.connect(f"ipc://{self.ipc_path}")
        self._back = self._ctx.socket(zmq.PUB)
        try:
            if port:
                self._back.bind(f"tcp://{host}:{port}")
                self.port = port
            else:
                self.port = self._back.bind_to_random_port(f"tcp://{host}")
        except zmq.ZMQError as e:
            self._close_sockets()
            raise OSError(f"cannot bind the KV events port on {host}:{port or 'any free'} "
                          f"({e}); choose another --kv-events-host/--kv-events-port, or "
                          "--no-kv-events") from None
        self._control = self._ctx.socket(zmq.PAIR)
        self._control.bind(f"inproc://kv-events-control-{id(self)}")
        steer = self._ctx.socket(zmq.PAIR)
        steer.connect(f"inproc://kv-events-control-{id(self)}")
        self._thread = threading.Thread(target=self._run, args=(steer,), daemon=True,
                                        name="kv-events-relay")
        self._thread.start()
        atexit.register(self.close)

    def engine_config(self) -> Any:
        """vLLM's KVEventsConfig publishing to this relay."""
        from vllm.config import KVEventsConfig

        return KVEventsConfig(enable_kv_cache_events=True, publisher="zmq",
                              endpoint=f"ipc://{self.ipc_path}",
                              buffer_steps=REPLAY_BATCHES)

    def _run(self, steer: Any) -> None:
        import zmq

        try:
            zmq.proxy_steerable(self._front, self._back, None, steer)
        except zmq.ContextTerminated:
            pass
        except Exception:  # routers fall back to a reset view: they see a gap
            log.exception("the KV events relay stopped")
        finally:
            steer.close(linger=0)

    def _close_sockets(self) -> None:
        self._front.close(linger=0)
        self._back.close(linger=0)
        self._ctx.term()
        shutil.rmtree(self._dir, ignore_errors=True)

    def close(self) -> None:
        if not self._thread.is_alive():
            return
        self._control.send(b"TERMINATE")
        self._thread.join(timeout=2.0)
        self._control.close(linger=0)
        self._close_sockets()
