"""TrioSocket on real ROUTER/DEALER sockets over loopback TCP: no lost wake-ups, monitor events."""

from __future__ import annotations

import select
import time
from collections.abc import AsyncIterator

import pytest
import trio
import trio.testing
import zmq

from transport import TrioSocket

N = 2000


async def _send(sock: TrioSocket, frames: list[bytes]) -> None:
    """Send, backing off while the high-water mark is reached."""
    while not sock.send(frames):
        await trio.sleep(0.001)


@pytest.fixture
async def pair() -> AsyncIterator[tuple[TrioSocket, TrioSocket]]:
    router = TrioSocket.create(zmq.ROUTER, linger_s=0)
    dealer = TrioSocket.create(zmq.DEALER, linger_s=0)
    try:
        router.socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
        port = router.socket.bind_to_random_port("tcp://127.0.0.1")
        dealer.socket.setsockopt(zmq.ROUTING_ID, b"dealer-1")
        dealer.socket.connect(f"tcp://127.0.0.1:{port}")
        yield router, dealer
    finally:
        dealer.close()
        router.close()


async def test_lockstep_ping_pong(pair: tuple[TrioSocket, TrioSocket]) -> None:
    """Each side sends right after it receives: the send can eat the edge of the next message."""
    router, dealer = pair

    async def serve() -> None:
        for _ in range(N):
            peer, body = await router.receive()
            assert router.send([peer, b"re:" + body])

    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(serve)
            for i in range(N):
                assert dealer.send([b"%d" % i])
                assert await dealer.receive() == [b"re:%d" % i]


async def test_send_that_eats_the_edge_wakes_the_receiver(
    pair: tuple[TrioSocket, TrioSocket],
) -> None:
    """The exact lost wake-up of rule 2, made deterministic: a message makes the router's FD
    readable while its receiver is parked, then a send on the router consumes that edge before
    trio polls the FD again. Without the wake-up in `send`, the receiver sleeps forever."""
    router, dealer = pair
    received: list[list[bytes]] = []

    async def receive() -> None:
        received.append(await router.receive())

    with trio.fail_after(5):
        # connect first, so that the router knows the dealer's routing id
        assert dealer.send([b"hello"])
        assert await router.receive() == [b"dealer-1", b"hello"]
        async with trio.open_nursery() as nursery:
            nursery.start_soon(receive)
            await trio.testing.wait_all_tasks_blocked()  # parked on the FD
            # no checkpoint from here to the end of the block: trio cannot poll the FD
            assert dealer.send([b"ping"])
            assert select.select([router.socket.FD], [], [], 5)[0], "the edge never came"
            time.sleep(0.01)  # past zmq's command throttle, so the send processes commands
            assert router.send([b"dealer-1", b"pong"])
            assert not select.select([router.socket.FD], [], [], 0)[0], "the send kept the edge"
    assert received == [[b"dealer-1", b"ping"]]


async def test_interleaved_both_ways(pair: tuple[TrioSocket, TrioSocket]) -> None:
    """Requests, replies and unsolicited pushes in both directions at once, each socket with one
    receiving task and other tasks sending on it while that receiver is parked."""
    router, dealer = pair
    replies: list[bytes] = []
    pushes: list[bytes] = []
    served: list[bytes] = []
    first = trio.Event()

    async def server_receive() -> None:
        while len(served) < N:
            peer, body = await router.receive()
            assert peer == b"dealer-1"
            served.append(body)
            first.set()
            await _send(router, [peer, b"re:" + body])

    async def server_push() -> None:  # sends while server_receive is parked on the FD
        await first.wait()
        for i in range(N):
            await _send(router, [b"dealer-1", b"push:%d" % i])
            if i % 7 == 0:
                await trio.sleep(0)

    async def client_receive() -> None:
        while len(replies) < N or len(pushes) < N:
            (body,) = await dealer.receive()
            (replies if body.startswith(b"re:") else pushes).append(body)

    async def client_send() -> None:  # sends while client_receive is parked on the FD
        for i in range(N):
            await _send(dealer, [b"%d" % i])
            if i % 5 == 0:
                await trio.sleep(0)

    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(server_receive)
            nursery.start_soon(server_push)
            nursery.start_soon(client_receive)
            nursery.start_soon(client_send)
    assert served == [b"%d" % i for i in range(N)]
    assert replies == [b"re:%d" % i for i in range(N)]
    assert pushes == [b"push:%d" % i for i in range(N)]


async def test_unroutable_send_returns_false(pair: tuple[TrioSocket, TrioSocket]) -> None:
    router, _ = pair
    assert router.send([b"nobody", b"hello"]) is False


async def test_cancelled_receive_loses_nothing(pair: tuple[TrioSocket, TrioSocket]) -> None:
    router, dealer = pair
    with trio.move_on_after(0.05) as scope:
        await router.receive()
    assert scope.cancelled_caught
    assert dealer.send([b"late"])
    with trio.fail_after(5):
        assert await router.receive() == [b"dealer-1", b"late"]


async def test_one_receiver_only(pair: tuple[TrioSocket, TrioSocket]) -> None:
    router, dealer = pair
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(router.receive)
            await trio.testing.wait_all_tasks_blocked()
            with pytest.raises(AssertionError, match="already receiving"):
                await router.receive()
            assert dealer.send([b"x"])


async def test_close_wakes_the_receiver(pair: tuple[TrioSocket, TrioSocket]) -> None:
    router, _ = pair

    async def receive() -> None:
        with pytest.raises(trio.ClosedResourceError):
            await router.receive()

    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(receive)
            await trio.testing.wait_all_tasks_blocked()
            router.close()
    with pytest.raises(trio.ClosedResourceError):
        router.send([b"dealer-1", b"x"])


async def test_monitor_sees_disconnect_of_the_sending_connection() -> None:
    router = TrioSocket.create(zmq.ROUTER, linger_s=0)
    dealer = TrioSocket.create(zmq.DEALER, linger_s=0)
    with router, dealer, router.monitor() as monitor, trio.fail_after(10):
        port = router.socket.bind_to_random_port("tcp://127.0.0.1")
        dealer.socket.connect(f"tcp://127.0.0.1:{port}")
        assert dealer.send([b"hello"])
        received = await router.receive_from()
        (peer, body), fd = received.frames, received.fd
        assert body == b"hello" and fd >= 0 and received.user_id == "" and received.dropped == 0

        dealer.close()
        seen = []
        async for event in monitor:
            seen.append(event.event)
            if event.event == zmq.EVENT_DISCONNECTED:
                assert event.value == fd
                assert event.endpoint == f"tcp://127.0.0.1:{port}"
                break
        assert zmq.EVENT_ACCEPTED in seen


async def test_a_message_of_many_frames_is_read_whole_but_kept_short() -> None:
    """A peer cannot make the receiver hold a message of a million parts: frames past the limit are
    read (the next message is intact) and counted, not kept."""
    router = TrioSocket.create(zmq.ROUTER, linger_s=0)
    dealer = TrioSocket.create(zmq.DEALER, linger_s=0)
    with router, dealer, trio.fail_after(10):
        port = router.socket.bind_to_random_port("tcp://127.0.0.1")
        dealer.socket.connect(f"tcp://127.0.0.1:{port}")
        assert dealer.send([b"%d" % i for i in range(1000)])
        assert dealer.send([b"next"])
        many = await router.receive_from(max_frames=4)
        assert len(many.frames) == 4 and many.dropped == 1 + 1000 - 4  # the routing id is a frame too
        after = await router.receive_from()
        assert after.frames[1:] == [b"next"] and after.dropped == 0
