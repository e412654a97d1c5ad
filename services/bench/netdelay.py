"""Hold every packet of an NFQUEUE queue for a fixed time, then let it through: link
latency where the kernel has no netem qdisc.

Runs inside the network namespace whose packets it delays (a queue belongs to its
namespace), bound to `--queue`; iptables sends it packets with
``-j NFQUEUE --queue-num N --queue-bypass`` (with the bypass, packets pass undelayed
whenever no delayer is bound, so a delayer that dies fails open, never cuts the link).

    python -m services.bench.netdelay --queue 0 --delay-ms 100

Only packets a host *receives* should be queued (its INPUT chain): a packet held on its
sender's way out is still charged to the sending socket, and TCP's small-queue limit then
lets barely two packets per socket wait in the queue, so throughput collapses instead of
the round trip growing. Packets keep their order (every one waits the same time).
On SIGTERM or SIGINT every held packet is let through at once, then it exits.

It runs at a real-time priority (SCHED_FIFO, where allowed): vLLM's CPU engines keep every
core busy, and a delayer at ordinary priority waits its turn for a core while its packets
wait with it, seconds instead of the delay. It sleeps between packets, so the priority
takes from the engines only the time the packets themselves cost.

Needs the `NetfilterQueue` package (pip), which builds against libnetfilter_queue
(Debian: apt-get install libnetfilter-queue-dev).
"""

from __future__ import annotations

import argparse
import collections
import os
import select
import signal
import socket
import sys
import time
from typing import Any

MISSING = ("the latency fault needs the NetfilterQueue package: apt-get install "
           "libnetfilter-queue-dev, then pip install NetfilterQueue")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--queue", type=int, default=0, help="the NFQUEUE queue number to bind")
    p.add_argument("--delay-ms", type=float, required=True, help="how long each packet waits")
    p.add_argument("--priority", type=int, default=10,
                   help="SCHED_FIFO priority (0: the ordinary scheduler)")
    args = p.parse_args()
    if args.priority > 0:
        try:
            os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(args.priority))
        except OSError as e:  # not root, or no real-time budget: say so, delay anyway
            print(f"ordinary priority ({e}): packets may wait longer than the delay "
                  "while the cores are busy", file=sys.stderr, flush=True)
    try:
        from netfilterqueue import COPY_META, NetfilterQueue
    except ImportError:
        sys.exit(MISSING)
    delay = args.delay_ms / 1000
    held: collections.deque[tuple[float, Any]] = collections.deque()
    stopping = False

    def hold(packet: Any) -> None:
        held.append((time.monotonic() + delay, packet))

    def stop(*_: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    queue = NetfilterQueue()
    # Only the packet's metadata comes up: a verdict needs no payload, and copying
    # megabytes of KV through this process would cost the cores the engines run on.
    queue.bind(args.queue, hold, max_len=1 << 16, mode=COPY_META)
    # One thread: `run()` holds the interpreter while it waits on the queue's socket, so
    # a second thread releasing packets would stall until the next packet arrives.
    sock = socket.fromfd(queue.get_fd(), socket.AF_NETLINK, socket.SOCK_RAW)
    sock.setblocking(False)
    print(f"delaying queue {args.queue} by {args.delay_ms:g} ms", flush=True)
    try:
        while not stopping:
            now = time.monotonic()
            while held and held[0][0] <= now:
                held.popleft()[1].accept()
            wait = min(held[0][0] - now, 0.5) if held else 0.5
            try:
                ready, _, _ = select.select([sock], [], [], max(wait, 0.0))
            except InterruptedError:
                continue
            if ready:
                queue.run(block=False)
    finally:
        while held:
            held.popleft()[1].accept()
        queue.unbind()
        sock.close()


if __name__ == "__main__":
    main()
