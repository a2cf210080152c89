"""CURVE keys, who may connect where, and the socket limits every control-plane socket runs with.

Keys. `coordinator keygen DIR` writes ZeroMQ CURVE key pairs in zmq's certificate format
(`NAME.key` public, `NAME.key_secret` public + secret, secrets mode 0600):

    server.key / server.key_secret     the coordinator (its secret never leaves the coordinator)
    worker.key / worker.key_secret     one key shared by every worker (the role key)
    ctl.key / ctl.key_secret           the operator's control tool
    workers/NAME.key(_secret)          optional per-worker keys (`keygen DIR --worker NAME`):
                                       a connection with such a key may only speak as NAME

A client needs `server.key` plus its own `*.key_secret`; the coordinator needs `server.key_secret`
and the public keys of the clients it admits. So a spot instance gets a directory holding
`server.key` and `worker.key_secret` (or `workers/NAME.key_secret`), nothing else.

Who may connect. Every coordinator socket runs ZAP (`Gatekeeper`, pyzmq's thread authenticator:
a well-kept implementation of the ZAP protocol, so we do not write our own), in its own ZAP domain
per socket: the workers socket admits worker keys, the control socket admits the ctl key. A
refused key fails the handshake: no frame of it ever reaches the coordinator's code, and both
sides' socket monitors report HANDSHAKE_FAILED_AUTH. With `--insecure` the sockets run the NULL
mechanism but still go through ZAP, which makes libzmq refuse unversioned ZMTP 1.0 peers (raw
bytes from a port scanner would otherwise be parsed as messages). The ZAP reply's user id
(`zmq.Frame.get("User-Id")` on every received frame) says which key spoke: "worker",
"worker:NAME", "ctl", or "anonymous" without keys.

Limits (`harden_server`): frames over `max_bytes` close the connection inside libzmq; a
connection that has not finished its handshake in HANDSHAKE_S is dropped; established ones that
stop answering ZMTP heartbeats for HEARTBEAT_TIMEOUT_S are dropped; each peer's queue holds at most
HWM messages each way.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import zmq
import zmq.auth
import zmq.utils.z85
from zmq.auth.thread import ThreadAuthenticator

from transport.endpoints import READY_FIELD

KEYS_ENV = "ADAPTRAIN_KEYS"
ROLE_WORKER = "worker"
ROLE_CTL = "ctl"
ANONYMOUS = "anonymous"  # the ZAP user id of a NULL-mechanism peer (--insecure)
DOMAIN_WORKERS = "adaptrain-workers"
DOMAIN_CONTROL = "adaptrain-control"

HANDSHAKE_S = 5.0
HEARTBEAT_S = 1.0
HEARTBEAT_TIMEOUT_S = 6.0
HWM = 1000


class KeysError(ValueError):
    """A key directory that cannot be used; the message says which file and what to do."""


@dataclass(frozen=True, slots=True)
class ServerKeys:
    public: bytes
    secret: bytes
    clients: dict[bytes, str] = field(default_factory=dict)  # z85 public key -> user id


@dataclass(frozen=True, slots=True)
class ClientKeys:
    server_public: bytes
    public: bytes
    secret: bytes
    path: Path  # the secret file, for error messages


def keys_dir(given: str | os.PathLike[str] | None) -> Path | None:
    """`--keys DIR` if given, else $ADAPTRAIN_KEYS, else None (no keys)."""
    if given is not None:
        return Path(given)
    env = os.environ.get(KEYS_ENV)
    return Path(env) if env else None


def generate_keys(directory: Path, *, workers: Sequence[str] = ()) -> list[Path]:
    """Write the cluster's key pairs into `directory` (created); existing key files are kept, so
    adding `--worker NAME` later never invalidates keys already handed out. Returns new files."""
    directory.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    for folder, name in [(directory, "server"), (directory, ROLE_WORKER), (directory, ROLE_CTL)] + [
            (directory / "workers", n) for n in workers]:
        if not name or "/" in name or name.startswith("."):
            raise KeysError(f"bad worker name {name!r} for a key file")
        folder.mkdir(parents=True, exist_ok=True)
        if (folder / f"{name}.key_secret").exists():
            continue
        public, secret = zmq.auth.create_certificates(str(folder), name)
        os.chmod(secret, 0o600)
        written += [Path(public), Path(secret)]
    return written


def _read(path: Path, *, secret: bool) -> tuple[bytes, bytes | None]:
    if not path.exists():
        raise KeysError(f"missing key file {path}")
    try:
        public, sec = zmq.auth.load_certificate(str(path))
    except (ValueError, OSError) as e:
        raise KeysError(f"cannot read key file {path}: {e}") from None
    if secret and sec is None:
        raise KeysError(f"{path} holds no secret key (use the .key_secret file)")
    return public, sec


def load_server_keys(directory: Path) -> ServerKeys:
    """The coordinator's keys and the clients it admits, from `keygen`'s directory."""
    if not directory.is_dir():
        raise KeysError(f"key directory {directory} does not exist (create it with `coordinator keygen {directory}`)")
    public, secret = _read(directory / "server.key_secret", secret=True)
    assert secret is not None
    clients = {_read(directory / f"{role}.key", secret=False)[0]: role for role in (ROLE_WORKER, ROLE_CTL)
               if (directory / f"{role}.key").exists()}
    for path in sorted((directory / "workers").glob("*.key")):
        clients[_read(path, secret=False)[0]] = f"{ROLE_WORKER}:{path.stem}"
    if not clients:
        raise KeysError(f"{directory} holds no client keys (worker.key, ctl.key): run `coordinator keygen {directory}`")
    return ServerKeys(public=public, secret=secret, clients=clients)


def load_client_keys(directory: Path, role: str, *, name: str | None = None) -> ClientKeys:
    """A client's keys: `workers/NAME.key_secret` when a worker has its own key, else the role's."""
    if not directory.is_dir():
        raise KeysError(f"key directory {directory} does not exist")
    server_public, _ = _read(directory / "server.key", secret=False)
    own = directory / "workers" / f"{name}.key_secret" if name else None
    path = own if own is not None and own.exists() else directory / f"{role}.key_secret"
    if not path.exists():
        raise KeysError(f"missing key file {path}: copy {role}.key_secret (and server.key) from the directory "
                        "`coordinator keygen` wrote")
    public, secret = _read(path, secret=True)
    assert secret is not None
    return ClientKeys(server_public=server_public, public=public, secret=secret, path=path)


# --- roles ---------------------------------------------------------------------------------------


def may_work(user_id: str) -> bool:
    """Whether a peer with this ZAP user id may speak on the workers socket."""
    return user_id in (ANONYMOUS, ROLE_WORKER) or user_id.startswith(f"{ROLE_WORKER}:")


def may_control(user_id: str) -> bool:
    return user_id in (ANONYMOUS, ROLE_CTL)


def bound_name(user_id: str) -> str | None:
    """The only worker name a per-worker key may use (None: any name)."""
    prefix = f"{ROLE_WORKER}:"
    return user_id[len(prefix):] if user_id.startswith(prefix) else None


class Gatekeeper(ThreadAuthenticator):
    """ZAP for one process's zmq context: admits the keys in `keys` by socket domain (None: every
    NULL-mechanism peer, for --insecure) and names each admitted peer by its role."""

    def __init__(self, context: zmq.Context[zmq.Socket[bytes]], keys: ServerKeys | None) -> None:
        super().__init__(context)
        self._clients = keys.clients if keys is not None else {}
        if keys is not None:
            for domain in (DOMAIN_WORKERS, DOMAIN_CONTROL):
                self.configure_curve_callback(domain, credentials_provider=self)

    def callback(self, domain: str, z85_key: bytes) -> bool:
        """pyzmq's credentials-provider hook: may `z85_key` connect to `domain`'s socket?"""
        user = self._clients.get(z85_key)
        if user is None:
            return False
        return may_work(user) if domain == DOMAIN_WORKERS else may_control(user)

    def curve_user_id(self, client_public_key: bytes) -> str:
        return self._clients.get(zmq.utils.z85.encode(client_public_key), "unknown")


def harden_server(sock: zmq.Socket[bytes], *, max_bytes: int, domain: str, keys: ServerKeys | None) -> None:
    """Limits and authentication for a coordinator ROUTER (call before bind)."""
    sock.setsockopt(zmq.MAXMSGSIZE, max_bytes)
    sock.setsockopt(zmq.HANDSHAKE_IVL, int(HANDSHAKE_S * 1000))
    sock.setsockopt(zmq.HEARTBEAT_IVL, int(HEARTBEAT_S * 1000))
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(HEARTBEAT_TIMEOUT_S * 1000))
    sock.setsockopt(zmq.SNDHWM, HWM)
    sock.setsockopt(zmq.RCVHWM, HWM)
    sock.setsockopt(zmq.TCP_KEEPALIVE, 1)
    sock.setsockopt(zmq.ZAP_DOMAIN, domain.encode())
    if keys is not None:
        sock.setsockopt(zmq.CURVE_SERVER, 1)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, keys.secret)


def harden_client(sock: zmq.Socket[bytes], *, max_bytes: int, keys: ClientKeys | None) -> None:
    """Limits and (with keys) CURVE for a client DEALER (call before connect)."""
    sock.setsockopt(zmq.MAXMSGSIZE, max_bytes)
    sock.setsockopt(zmq.HANDSHAKE_IVL, int(HANDSHAKE_S * 1000))
    if keys is not None:
        sock.setsockopt(zmq.CURVE_SERVERKEY, keys.server_public)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, keys.secret)


# --- why a client's handshake failed --------------------------------------------------------------

HANDSHAKE_EVENTS = (zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_AUTH
                    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
_MECHANISM_MISMATCH = 0x11000002  # ZMQ_PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH


def handshake_failure(event: int, value: int, keys: ClientKeys | None, *, who: str,
                      endpoint: str | None = None) -> str | None:
    """A sentence for a person when a client's handshake with the coordinator at `endpoint` failed for
    a reason that retrying cannot fix; None for success and for transient failures (counted by the
    caller). `who` is "worker" or "ctl".

    A refused key has two likely causes that look the same from here: the coordinator's other socket
    (each admits one role's keys: a worker key at the control endpoint is refused like a forged one),
    or a key from another `keygen` directory. The sentence names both, the port first: it is the
    common slip, since the ready line prints two addresses."""
    if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        where = f" ({keys.path})" if keys is not None else ""
        at = f" at {endpoint}" if endpoint else ""
        mine, other = READY_FIELD.get(who, (None, None))
        keygen = f"the key was not made by the `coordinator keygen` the coordinator runs with (or is not a {who} key)"
        if mine is None:
            return f"the coordinator{at} refused this {who}'s key{where}: {keygen}"
        return (f"the coordinator{at} refused this {who}'s key{where}: either {endpoint or 'this address'} is the "
                f"coordinator's {other} endpoint, not its {mine} endpoint (use the `{mine}=` address of its ready "
                f"line), or {keygen}")
    if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
        if value == _MECHANISM_MISMATCH:
            if keys is None:
                return (f"the coordinator requires CURVE keys: give this {who} --keys DIR "
                        f"(or set ${KEYS_ENV}) with server.key and the {who}'s key")
            return f"the coordinator runs without keys (--insecure): start this {who} without --keys / ${KEYS_ENV}"
        return f"the handshake with the coordinator failed (zmq protocol error {value:#x}): is server.key right?"
    return None


def no_detail_failure(keys: ClientKeys | None) -> str:
    """What to say when handshakes keep failing with no reason given (the coordinator closed the
    connection mid-handshake, or it is not an adaptrain coordinator)."""
    if keys is not None:
        return ("the coordinator did not accept the CURVE handshake: is server.key the coordinator's? "
                "(or the coordinator runs --insecure, without keys)")
    return ("the coordinator closed every connection during the handshake: it probably requires CURVE keys: "
            f"give --keys DIR (or set ${KEYS_ENV}); or this is not an adaptrain coordinator's endpoint")
