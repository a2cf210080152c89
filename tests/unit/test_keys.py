"""CURVE key files (transport.security): what keygen writes, what each side loads, which key may
connect where, and the sentences a refused client prints."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest
import zmq

from transport.security import (
    DOMAIN_CONTROL,
    DOMAIN_WORKERS,
    Gatekeeper,
    KeysError,
    bound_name,
    generate_keys,
    handshake_failure,
    load_client_keys,
    load_server_keys,
    may_control,
    may_work,
)


def test_keygen_writes_role_and_per_worker_keys_with_private_secrets(tmp_path: Path) -> None:
    written = generate_keys(tmp_path, workers=["alice"])
    names = sorted(p.relative_to(tmp_path).as_posix() for p in written)
    assert names == ["ctl.key", "ctl.key_secret", "server.key", "server.key_secret", "worker.key",
                     "worker.key_secret", "workers/alice.key", "workers/alice.key_secret"]
    for path in written:
        if path.name.endswith("_secret"):
            assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    assert generate_keys(tmp_path, workers=["alice"]) == [], "running it again keeps the keys handed out"


def test_each_side_loads_what_it_needs(tmp_path: Path) -> None:
    generate_keys(tmp_path, workers=["alice"])
    server = load_server_keys(tmp_path)
    worker = load_client_keys(tmp_path, "worker", name="bob")
    alice = load_client_keys(tmp_path, "worker", name="alice")
    ctl = load_client_keys(tmp_path, "ctl")
    assert worker.server_public == server.public == ctl.server_public
    assert server.clients[worker.public] == "worker" and server.clients[ctl.public] == "ctl"
    assert server.clients[alice.public] == "worker:alice", "a per-worker key is found by the worker's name"


def test_a_spot_instance_needs_only_two_files(tmp_path: Path) -> None:
    full, spot = tmp_path / "full", tmp_path / "spot"
    generate_keys(full)
    spot.mkdir()
    for name in ("server.key", "worker.key_secret"):
        (spot / name).write_bytes((full / name).read_bytes())
    assert load_client_keys(spot, "worker", name="w7").public == load_client_keys(full, "worker").public
    with pytest.raises(KeysError, match="server.key_secret"):
        load_server_keys(spot)  # the coordinator's secret is not there, as it should be
    with pytest.raises(KeysError, match="ctl.key_secret"):
        load_client_keys(spot, "ctl")


def test_missing_or_broken_key_files_say_which(tmp_path: Path) -> None:
    with pytest.raises(KeysError, match="does not exist"):
        load_server_keys(tmp_path / "nowhere")
    generate_keys(tmp_path)
    (tmp_path / "worker.key_secret").write_text("garbage")
    with pytest.raises(KeysError, match="worker.key_secret"):
        load_client_keys(tmp_path, "worker")


def test_roles_decide_which_socket_a_key_may_use(tmp_path: Path) -> None:
    generate_keys(tmp_path, workers=["alice"])
    server = load_server_keys(tmp_path)
    gate = Gatekeeper(zmq.Context.instance(), server)  # not started: only its decisions are used
    keys = {role: load_client_keys(tmp_path, "worker", name=role).public for role in ("bob", "alice")}
    keys["ctl"] = load_client_keys(tmp_path, "ctl").public
    assert gate.callback(DOMAIN_WORKERS, keys["bob"]) and gate.callback(DOMAIN_WORKERS, keys["alice"])
    assert not gate.callback(DOMAIN_WORKERS, keys["ctl"]), "ctl's key cannot join as a worker"
    assert gate.callback(DOMAIN_CONTROL, keys["ctl"])
    assert not gate.callback(DOMAIN_CONTROL, keys["bob"]), "a worker's key cannot send control commands"
    assert not gate.callback(DOMAIN_WORKERS, zmq.curve_keypair()[0]), "unknown keys are refused"
    assert may_work("anonymous") and may_control("anonymous"), "--insecure: no roles"
    assert bound_name("worker:alice") == "alice" and bound_name("worker") is None


def test_refused_clients_are_told_what_to_do() -> None:
    no_keys = handshake_failure(zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, 0x11000002, None, who="worker")
    assert no_keys is not None and "--keys" in no_keys
    refused = handshake_failure(zmq.EVENT_HANDSHAKE_FAILED_AUTH, 400, None, who="ctl")
    assert refused is not None and "refused this ctl's key" in refused
    assert handshake_failure(zmq.EVENT_HANDSHAKE_SUCCEEDED, 0, None, who="worker") is None
