"""The rendezvous store's state machine (coordinator.store.RendezvousStore), with time passed in.

Keys written plainly here ("k") are put in epoch 1's namespace by `req`, as torch's PrefixStore
puts gloo's keys; the store is told the latest epoch is `LATEST`."""

from __future__ import annotations

import itertools

import pytest

from coordinator import store as store_module
from coordinator.store import RendezvousStore
from transport import StoreReply, StoreRequest

_ids = itertools.count(1)
A, B = b"client-a", b"client-b"
LATEST = 20


def req(op: str, *keys: str, values: list[bytes] | None = None, amount: int = 0,
        timeout_s: float = 10.0) -> StoreRequest:
    scoped = [k if k.startswith("epoch") else f"epoch1/{k}" for k in keys]
    return StoreRequest(req_id=next(_ids), op=op, keys=scoped, values=values or [], amount=amount,
                        timeout_s=timeout_s)


def handle(store: RendezvousStore, client: bytes, r: StoreRequest, *, now: float) -> StoreReply | None:
    return store.handle(client, r, now=now, epoch=LATEST)


def do(store: RendezvousStore, r: StoreRequest, *, client: bytes = A, now: float = 0.0) -> StoreReply:
    reply = handle(store, client, r, now=now)
    assert reply is not None, f"{r.op} was parked"
    assert reply.req_id == r.req_id and reply.ok, reply
    return reply


def test_set_then_get() -> None:
    s = RendezvousStore()
    do(s, req("set", "k", values=[b"v1"]))
    assert do(s, req("get", "k")).values == [b"v1"]
    do(s, req("set", "k", values=[b"v2"]))
    assert do(s, req("get", "k")).values == [b"v2"], "set overwrites"


def test_get_parks_until_set_then_poke_answers_it() -> None:
    s = RendezvousStore()
    r = req("get", "k")
    assert handle(s, A, r, now=0.0) is None
    assert s.poke() == [], "nothing was written"
    do(s, req("set", "other", values=[b"x"]), client=B)
    assert s.poke() == []
    do(s, req("set", "k", values=[b"hello"]), client=B)
    answers = s.poke()
    assert len(answers) == 1
    client, reply = answers[0]
    assert client == A and reply.req_id == r.req_id and reply.ok and reply.values == [b"hello"]
    assert s.poke() == [], "answered once"
    assert s.parked == []


def test_wait_on_several_keys_answers_when_all_exist() -> None:
    s = RendezvousStore()
    r = req("wait", "k1", "k2", "k3")
    assert handle(s, A, r, now=0.0) is None
    do(s, req("set", "k1", values=[b"1"]), client=B)
    do(s, req("set", "k3", values=[b"3"]), client=B)
    assert s.poke() == [], "k2 is still missing"
    do(s, req("set", "k2", values=[b"2"]), client=B)
    [(client, reply)] = s.poke()
    assert client == A and reply.req_id == r.req_id and reply.ok and reply.values == []
    assert do(s, req("wait", "k1", "k2")).ok, "keys that exist: answered at once"


def test_several_parked_clients_are_all_answered() -> None:
    s = RendezvousStore()
    ra, rb = req("get", "k"), req("wait", "k")
    assert handle(s, A, ra, now=0.0) is None and handle(s, B, rb, now=0.0) is None
    do(s, req("set", "k", values=[b"v"]))
    answers = {client: reply for client, reply in s.poke()}
    assert answers[A].req_id == ra.req_id and answers[A].values == [b"v"]
    assert answers[B].req_id == rb.req_id and answers[B].ok


def test_add_counts_from_zero() -> None:
    s = RendezvousStore()
    assert do(s, req("add", "n", amount=1)).number == 1
    assert do(s, req("add", "n", amount=5)).number == 6
    assert do(s, req("add", "n", amount=-2)).number == 4
    assert do(s, req("get", "n")).values == [b"4"], "stored as decimal text, like torch's stores"
    assert do(s, req("add", "other", amount=0)).number == 0


def test_add_to_a_non_counter_is_a_value_error() -> None:
    s = RendezvousStore()
    do(s, req("set", "k", values=[b"not a number"]))
    with pytest.raises(ValueError):
        handle(s, A, req("add", "k", amount=1), now=0.0)


def test_compare_set_sets_only_when_current_equals_expected() -> None:
    s = RendezvousStore()
    do(s, req("set", "k", values=[b"old"]))
    assert do(s, req("compare_set", "k", values=[b"wrong", b"new"])).values == [b"old"]
    assert do(s, req("get", "k")).values == [b"old"], "a mismatch leaves the value alone"
    assert do(s, req("compare_set", "k", values=[b"old", b"new"])).values == [b"new"]
    assert do(s, req("get", "k")).values == [b"new"]


def test_compare_set_with_empty_expected_means_absent() -> None:
    s = RendezvousStore()
    assert do(s, req("compare_set", "k", values=[b"", b"first"])).values == [b"first"]
    assert do(s, req("get", "k")).values == [b"first"]
    # It exists now: expecting absence fails and returns the current value.
    assert do(s, req("compare_set", "k", values=[b"", b"second"])).values == [b"first"]
    assert do(s, req("get", "k")).values == [b"first"]


def test_compare_set_on_an_absent_key_with_nonempty_expected_returns_expected() -> None:
    s = RendezvousStore()
    assert do(s, req("compare_set", "k", values=[b"x", b"y"])).values == [b"x"]  # torch's behaviour
    assert do(s, req("check", "k")).number == 0, "nothing was set"


def test_compare_set_answers_parked_gets() -> None:
    s = RendezvousStore()
    assert handle(s, B, req("get", "k"), now=0.0) is None
    do(s, req("compare_set", "k", values=[b"", b"won"]))
    [(client, reply)] = s.poke()
    assert client == B and reply.values == [b"won"]


def test_check_num_keys_and_delete() -> None:
    s = RendezvousStore()
    assert do(s, req("num_keys")).number == 0
    do(s, req("set", "a", values=[b"1"]))
    do(s, req("add", "b", amount=1))
    assert do(s, req("check", "a")).number == 1
    assert do(s, req("check", "a", "b")).number == 1
    assert do(s, req("check", "a", "c")).number == 0, "check wants every key"
    assert do(s, req("num_keys")).number == 2
    assert do(s, req("delete", "a")).number == 1
    assert do(s, req("delete", "a")).number == 0, "already gone"
    assert do(s, req("check", "a")).number == 0
    assert do(s, req("num_keys")).number == 1


def test_expire_fails_parked_requests_after_their_deadline() -> None:
    s = RendezvousStore()
    short, long = req("wait", "k", "j", timeout_s=1.0), req("get", "k", timeout_s=5.0)
    assert handle(s, A, short, now=10.0) is None
    assert handle(s, B, long, now=10.0) is None
    do(s, req("set", "j", values=[b"1"]))
    assert s.poke() == []
    assert s.expire(now=10.5) == [], "before the deadline"
    [(client, reply)] = s.expire(now=11.0)
    assert client == A and reply.req_id == short.req_id and not reply.ok
    assert "epoch1/k" in reply.error and "epoch1/j" not in reply.error, "the error names the missing key"
    assert s.expire(now=11.5) == [], "failed once"
    do(s, req("set", "k", values=[b"v"]))
    answers = s.poke()
    assert [(c, r.req_id) for c, r in answers] == [(B, long.req_id)], "the expired one is not answered"


def test_forget_epochs_before_drops_old_epoch_keys_and_parked_requests() -> None:
    s = RendezvousStore()
    for key in ("epoch1/a", "epoch2/a", "epoch3/a", "epoch10/a"):
        do(s, req("set", key, values=[b"x"]))
    old_wait = req("wait", "epoch2/b")
    new_wait = req("wait", "epoch3/b")
    assert handle(s, A, old_wait, now=0.0) is None
    assert handle(s, B, new_wait, now=0.0) is None

    s.forget_epochs_before(3)
    assert sorted(s.data) == ["epoch10/a", "epoch3/a"], "epochs compare as numbers"
    assert [p.request.req_id for p in s.parked] == [new_wait.req_id]
    do(s, req("set", "epoch2/b", values=[b"late"]))
    do(s, req("set", "epoch3/b", values=[b"y"]))
    assert [c for c, _ in s.poke()] == [B]
    assert s.expire(now=1e9) == [], "the dropped request is gone, not failed later"


@pytest.mark.parametrize("bad", [
    req("set", "k"),  # no value
    req("set", "k", "j", values=[b"1", b"2"]),
    req("compare_set", "k", values=[b"only-one"]),
    req("delete"),
    req("frobnicate", "k"),
])
def test_malformed_requests_are_value_errors(bad: StoreRequest) -> None:
    s = RendezvousStore()
    with pytest.raises(ValueError):
        handle(s, A, bad, now=0.0)
    assert s.data == {} and s.parked == []


@pytest.mark.parametrize("bad", [
    StoreRequest(req_id=1, op="set", keys=["unscoped"], values=[b"x"], amount=0, timeout_s=1.0),
    StoreRequest(req_id=1, op="set", keys=[f"epoch{LATEST + 1}/k"], values=[b"x"], amount=0, timeout_s=1.0),
    StoreRequest(req_id=1, op="get", keys=["epoch1/" + "k" * 600], values=[], amount=0, timeout_s=1.0),
    StoreRequest(req_id=1, op="set", keys=["epoch1/k"], values=[b"x" * (store_module.MAX_VALUE_BYTES + 1)],
                 amount=0, timeout_s=1.0),
    StoreRequest(req_id=1, op="wait", keys=[f"epoch1/{i}" for i in range(65)], values=[], amount=0, timeout_s=1.0),
])
def test_requests_outside_the_rendezvous_namespace_or_limits_are_refused(bad: StoreRequest) -> None:
    """A worker-keyed peer can reach the store: nothing outside an existing epoch's namespace, no
    giant key or value, no wait on a thousand keys."""
    s = RendezvousStore()
    with pytest.raises(ValueError):
        handle(s, A, bad, now=0.0)
    assert s.data == {} and s.parked == []


def test_parked_waits_are_bounded_per_client_and_in_time() -> None:
    s = RendezvousStore()
    for i in range(store_module.MAX_PARKED_PER_CLIENT):
        assert handle(s, A, req("wait", f"never{i}", timeout_s=1e9), now=0.0) is None
    with pytest.raises(ValueError, match="parked"):
        handle(s, A, req("wait", "one-more"), now=0.0)
    assert handle(s, B, req("wait", "other-client"), now=0.0) is None, "the limit is per client"
    late = s.expire(now=store_module.MAX_WAIT_S + 1)
    assert len(late) == store_module.MAX_PARKED_PER_CLIENT + 1, "a huge timeout is capped"


def test_total_bytes_are_bounded_and_accounted_on_delete(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(store_module, "MAX_DATA_BYTES", 100)
    s = RendezvousStore()
    do(s, req("set", "a", values=[b"x" * 50]))
    with pytest.raises(ValueError, match="bytes"):
        handle(s, A, req("set", "b", values=[b"x" * 50]), now=0.0)
    assert do(s, req("delete", "a")).number == 1 and s.data_bytes == 0
    do(s, req("set", "b", values=[b"x" * 50]))
