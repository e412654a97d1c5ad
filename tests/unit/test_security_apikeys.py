"""API keys: parsing the file and PDSERVE_API_KEYS, which client a key names, constant-time
lookups over digests only, bearer tokens from gRPC metadata and HTTP headers, rotation by
editing the file."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import grpc
import pytest

from services.errors import Unauthenticated
from services.security import apikeys
from services.security.apikeys import (
    ApiKeyError,
    ApiKeys,
    bearer_from_headers,
    bearer_from_metadata,
    bearer_token,
)

ALICE = "alice-key-0123456789abcdef"
BOB = "bob-key-0123456789abcdef00"


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_file_and_env_keys_name_their_clients(tmp_path: Path) -> None:
    hashed = hashlib.sha256(BOB.encode()).hexdigest()
    keys_file = write(tmp_path / "keys", f"# clients\n\nalice:{ALICE}\n  bob:sha256:{hashed}\n")
    keys = ApiKeys.load(keys_file, env={"PDSERVE_API_KEYS": "carol:carol-key-0123456789ab, "
                                                            "dave:dave-key-0123456789abcd"})
    assert keys is not None
    assert keys.clients == {"alice", "bob", "carol", "dave"}
    assert keys.authenticate(ALICE) == "alice"
    assert keys.authenticate(BOB) == "bob"  # given only as its digest
    assert keys.authenticate("carol-key-0123456789ab") == "carol"
    assert keys.client_of("dave-key-0123456789abcX") is None


def test_no_source_means_no_keys(tmp_path: Path) -> None:
    assert ApiKeys.load(None, env={}) is None
    assert ApiKeys.load("", env={"PDSERVE_API_KEYS": " "}) is None


def test_refusals_are_unauthenticated_and_never_echo_the_key() -> None:
    keys = ApiKeys.load(None, env={"PDSERVE_API_KEYS": f"alice:{ALICE}"})
    assert keys is not None
    with pytest.raises(Unauthenticated) as missing:
        keys.authenticate(None)
    assert missing.value.status == grpc.StatusCode.UNAUTHENTICATED
    assert missing.value.http == 401
    assert "authorization: Bearer <key>" in missing.value.message
    wrong = "wrong-key-but-long-enough"
    with pytest.raises(Unauthenticated) as invalid:
        keys.authenticate(wrong)
    assert invalid.value.message == "invalid API key" and wrong not in str(invalid.value)


def test_only_digests_are_kept() -> None:
    keys = ApiKeys.load(None, env={"PDSERVE_API_KEYS": f"alice:{ALICE}"})
    assert keys is not None
    held = repr(vars(keys)) + repr(keys._keys)
    assert ALICE not in held
    assert keys._keys[0].digest == hashlib.sha256(ALICE.encode()).digest()


def test_lookup_compares_every_digest(monkeypatch: pytest.MonkeyPatch) -> None:
    """Constant time: the first entry matching does not stop the comparisons."""
    keys = ApiKeys.load(None, env={"PDSERVE_API_KEYS": f"alice:{ALICE},bob:{BOB}"})
    assert keys is not None
    compared = []
    real = apikeys.hmac.compare_digest

    def counting(a: bytes, b: bytes) -> bool:
        compared.append(a)
        return real(a, b)

    monkeypatch.setattr(apikeys.hmac, "compare_digest", counting)
    assert keys.client_of(ALICE) == "alice"
    assert len(compared) == 2


@pytest.mark.parametrize(("text", "message"), [
    ("alice", "keys:1: expected `client-name:key`"),
    ("ok:0123456789abcdefgh\n:0123456789abcdefgh", "keys:2: expected `client-name:key`"),
    ("al ice:0123456789abcdefgh", "client name 'al ice'"),
    ("alice:short", "must be at least 16 characters"),
    ("alice:sha256:abc", "64 hex digits"),
    (f"alice:{ALICE}\nbob:{ALICE}", "one key is given twice (for 'alice' and 'bob')"),
    ("# only comments\n", "no keys"),
])
def test_bad_files_say_where(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(ApiKeyError) as e:
        ApiKeys.load(write(tmp_path / "keys", text), env={})
    assert message in str(e.value)


def test_unreadable_file_says_what_to_do(tmp_path: Path) -> None:
    with pytest.raises(ApiKeyError) as e:
        ApiKeys.load(tmp_path / "absent", env={})
    assert "cannot be read" in str(e.value) and "--api-keys-file" in str(e.value)


def test_env_entries_are_numbered() -> None:
    with pytest.raises(ApiKeyError) as e:
        ApiKeys.load(None, env={"PDSERVE_API_KEYS": f"alice:{ALICE},bob"})
    assert "PDSERVE_API_KEYS entry 2" in str(e.value)


def test_a_client_may_hold_two_keys_while_rotating(tmp_path: Path) -> None:
    keys = ApiKeys.load(write(tmp_path / "keys", f"alice:{ALICE}\nalice:{BOB}\n"), env={})
    assert keys is not None
    assert keys.authenticate(ALICE) == keys.authenticate(BOB) == "alice"


def test_the_file_is_reread_when_it_changes(tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(apikeys, "RELOAD_S", 0.0)
    path = write(tmp_path / "keys", f"alice:{ALICE}\n")
    keys = ApiKeys.load(path, env={"PDSERVE_API_KEYS": "env:env-key-0123456789abcdef"})
    assert keys is not None
    # Rotation: the new file (written elsewhere, moved in place, as a Secret update is).
    staged = write(tmp_path / "keys.new", f"bob:{BOB}\n")
    os.replace(staged, path)
    assert keys.client_of(ALICE) is None
    assert keys.client_of(BOB) == "bob"
    assert keys.client_of("env-key-0123456789abcdef") == "env"  # env keys stay
    # A file broken mid-edit leaves the last good keys in force.
    os.replace(write(tmp_path / "keys.bad", "bob\n"), path)
    assert keys.client_of(BOB) == "bob"


@pytest.mark.parametrize(("value", "token"), [
    ("Bearer abc", "abc"), ("bearer  abc ", "abc"), (b"BEARER abc", "abc"),
    ("Basic abc", None), ("Bearer", None), ("Bearer ", None), (None, None), ("abc", None),
])
def test_bearer_token(value: str | bytes | None, token: str | None) -> None:
    assert bearer_token(value) == token


def test_bearer_from_metadata_and_headers() -> None:
    assert bearer_from_metadata((("x-client-id", "a"), ("authorization", "Bearer k"))) == "k"
    assert bearer_from_metadata((("authorization", b"Bearer k"),)) == "k"
    assert bearer_from_metadata(None) is None
    assert bearer_from_headers({"Authorization": "Bearer k"}) == "k"
    assert bearer_from_headers({"authorization": "Bearer k"}) == "k"
    assert bearer_from_headers({"content-type": "application/json"}) is None


def test_new_key_command_prints_a_usable_and_a_hashed_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert apikeys.main(["new", "alice"]) == 0
    plain, hashed = capsys.readouterr().out.splitlines()
    key = plain.split(":", 1)[1]
    assert len(key) >= 40 and hashed.startswith("alice:sha256:")
    keys = ApiKeys.load(write(tmp_path / "keys", hashed + "\n"), env={})
    assert keys is not None and keys.authenticate(key) == "alice"
    assert apikeys.main(["new", "bad name"]) == 2
