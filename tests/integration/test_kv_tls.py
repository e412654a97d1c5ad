"""The KV transports under internal mTLS, with real receivers on loopback and a real CA
made by `pdserve certs init`: the right certificate is served (bit-exact), a sender with
no certificate or one from another CA never gets a transfer in, nor (torch) the
rendezvous that would let it join a pair group, nor (nixl) a region to write into."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from services.kv.transport import ReceiveState, TransportConfig, make_receiver
from services.security import certs
from tests.integration.test_kv_transport import (
    CFG,
    RX_ID,
    TX_ID,
    kv_layers,
    new_sender,
    same_bits,
    send_all,
    wait_outcome,
)

pytestmark = pytest.mark.timeout(240)


def tls_config(directory: Path, role: str) -> TransportConfig:
    files = certs.internal_files(directory, role)
    return dataclasses.replace(CFG, tls_ca_file=str(files.ca), tls_cert_file=str(files.cert),
                               tls_key_file=str(files.key))


@pytest.fixture(scope="module")
def cas(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    ours, theirs = tmp_path_factory.mktemp("ours"), tmp_path_factory.mktemp("theirs")
    certs.init(ours)
    certs.init(theirs)
    return ours, theirs


@pytest.fixture(scope="module", params=["grpc", "torch", "nixl"])
def secured(request: pytest.FixtureRequest, cas: tuple[Path, Path]) -> Iterator[tuple[str, Any]]:
    rx = make_receiver(request.param, RX_ID, tls_config(cas[0], "decode"), "127.0.0.1", 0)
    yield request.param, rx
    rx.close()


def test_the_right_certificate_is_served(secured: tuple[str, Any],
                                         cas: tuple[Path, Path]) -> None:
    kind, rx = secured
    tx = new_sender(kind, TX_ID, tls_config(cas[0], "prefill"))
    try:
        layers = kv_layers(7)
        send_all(tx, rx.address, f"tls-ok-{kind}", layers)
        assert wait_outcome(tx, f"tls-ok-{kind}").ok
        got = rx.take(f"tls-ok-{kind}")
        assert got is not None and same_bits(got.layers, layers)
    finally:
        tx.close()


@pytest.mark.parametrize("who", ["plaintext", "another CA"])
def test_unauthenticated_senders_are_refused(secured: tuple[str, Any], cas: tuple[Path, Path],
                                             who: str) -> None:
    kind, rx = secured
    cfg = CFG if who == "plaintext" else tls_config(cas[1], "prefill")
    tx = new_sender(kind, TX_ID, cfg)
    tid = f"tls-refused-{kind}-{who.replace(' ', '-')}"
    try:
        send_all(tx, rx.address, tid, kv_layers(8))
        outcome = wait_outcome(tx, tid, timeout=30)
        assert not outcome.ok
        assert rx.state(tid) is not ReceiveState.COMPLETE
        assert rx.take(tid) is None
    finally:
        tx.close()
