"""LayoutFingerprint and PeerIdentity: stable digests, readable differences, strict parsing."""

from __future__ import annotations

import dataclasses

import pytest

from services.kv.fingerprint import LayoutFingerprint, PeerIdentity


def make_fp(**over: object) -> LayoutFingerprint:
    base: dict[str, object] = dict(
        model="smollm2-135m",
        dtype="float32",
        block_size=128,
        num_layers=30,
        num_kv_heads=3,
        head_size=64,
        kv_packing="cpu:avx2:k-transposed",
        pdserve_version="0.1.0",
    )
    base.update(over)
    return LayoutFingerprint(**base)  # type: ignore[arg-type]


def test_digest_is_short_stable_and_field_sensitive() -> None:
    fp = make_fp()
    assert fp.digest() == make_fp().digest()
    assert len(fp.digest()) == 16 and int(fp.digest(), 16) >= 0
    # Pinned: a change to the canonical form would make every peer of an older
    # release look incompatible.
    assert fp.digest() == "2ce33a61e91a3f29"
    for f in dataclasses.fields(LayoutFingerprint):
        value = getattr(fp, f.name)
        changed = value + 1 if isinstance(value, int) else value + "x"
        assert make_fp(**{f.name: changed}).digest() != fp.digest(), f.name


def test_differences_name_each_field() -> None:
    a, b = make_fp(), make_fp(block_size=16, kv_packing="cpu:avx512")
    assert a.differences(a) == []
    assert a.differences(b) == [
        "block_size: 128 != 16",
        "kv_packing: 'cpu:avx2:k-transposed' != 'cpu:avx512'",
    ]


def test_dict_round_trip() -> None:
    fp = make_fp()
    assert LayoutFingerprint.from_dict(fp.to_dict()) == fp
    ident = PeerIdentity("decode-0", 7, fp)
    assert PeerIdentity.from_dict(ident.to_dict()) == ident


@pytest.mark.parametrize(
    "mutate",
    [
        lambda d: d.pop("block_size"),
        lambda d: d.update(block_size="128"),
        lambda d: d.update(block_size=0),
        lambda d: d.update(num_layers=True),
        lambda d: d.update(model=None),
    ],
)
def test_from_dict_rejects_bad_input(mutate: object) -> None:
    d = make_fp().to_dict()
    mutate(d)  # type: ignore[operator]
    with pytest.raises(ValueError):
        LayoutFingerprint.from_dict(d)


def test_identity_validation() -> None:
    fp = make_fp()
    with pytest.raises(ValueError):
        PeerIdentity("", 1, fp)
    with pytest.raises(ValueError):
        PeerIdentity("w", -1, fp)
    with pytest.raises(ValueError):
        PeerIdentity.from_dict({"worker_id": "w", "epoch": 1})
    with pytest.raises(ValueError):
        PeerIdentity.from_dict("not a dict")  # type: ignore[arg-type]
