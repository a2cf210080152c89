"""Checks on an endpoint a client connects to (a worker's --join, ctl's --control), and what to tell
the user when the coordinator does not answer there.

zmq connects lazily and retries for ever: a host name that does not resolve, or an address where
nothing listens, looks exactly like a coordinator that has not answered yet. So a client resolves its
endpoint's host before it connects (`check_connect_endpoint`: one clear error at once, instead of a
wait for the connect timeout), and when the wait does run out, `no_answer` says which of the two
cases it was (no TCP connection at all, or a connection with no adaptrain answer on it) and what to
check. Both are pure apart from the resolver call; no logging.
"""

from __future__ import annotations

import socket

__all__ = ["READY_FIELD", "EndpointError", "check_connect_endpoint", "no_answer", "split_tcp"]

# Which address of the coordinator's ready line each kind of client wants, and the other one it may
# have taken instead.
READY_FIELD: dict[str, tuple[str, str]] = {"worker": ("workers", "control"), "ctl": ("control", "workers")}


class EndpointError(ValueError):
    """An endpoint a client cannot connect to; the message says what is wrong with it."""


def split_tcp(endpoint: str) -> tuple[str, int]:
    """(host, port) of `tcp://HOST:PORT` (also `tcp://[IPv6]:PORT` and zmq's `tcp://SOURCE;HOST:PORT`)."""
    if not endpoint.startswith("tcp://"):
        raise EndpointError(f"{endpoint!r} is not a tcp://HOST:PORT endpoint")
    rest = endpoint[len("tcp://"):].rpartition(";")[2]  # zmq's "source;destination" form
    host, sep, port = rest.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise EndpointError(f"{endpoint!r} must look like tcp://HOST:PORT")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if host == "*":
        raise EndpointError(f"{endpoint!r}: '*' is only for binding; give the coordinator's host name or address")
    if not 0 < int(port) < 65536:
        raise EndpointError(f"{endpoint!r}: the port must be between 1 and 65535 (the one its ready line prints)")
    return host, int(port)


def check_connect_endpoint(endpoint: str) -> None:
    """Raise EndpointError("cannot resolve HOST: ...") at once when a tcp endpoint's host does not
    resolve (an ipc:// endpoint is not checked)."""
    if endpoint.startswith("ipc://"):
        return
    host, port = split_tcp(endpoint)
    try:
        socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as e:
        reason = e.strerror if isinstance(e, socket.gaierror) and e.strerror else str(e)
        raise EndpointError(f"cannot resolve {host}: {reason} (in {endpoint})") from None


def no_answer(endpoint: str, timeout_s: float, *, who: str, connected: bool) -> str:
    """What to tell the user when the coordinator at `endpoint` did not answer `who` ("worker" or
    "ctl") within `timeout_s`; `connected`: whether a TCP connection was ever made there."""
    mine, other = READY_FIELD[who]
    if not connected:
        return (f"no answer from {endpoint} in {timeout_s:g} s: no connection could be made (is the coordinator "
                f"running? is this its host and the `{mine}=` port of its ready line? does a firewall block the port?)")
    return (f"no answer from {endpoint} in {timeout_s:g} s, though a connection was made: is this the `{mine}=` "
            f"address of the coordinator's ready line (not `{other}=`, nor another program's port)?")
