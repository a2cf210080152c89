"""Workers on two simulated hosts joined by a slow link (network namespaces, scripts/netns.py, 50
mbit each way), the coordinator on the bridge between them: a replicated job whose all-reduce
crosses the link trains exactly as on loopback, and the cost model, which starts from a prior
for links between hosts, learns the slow one from the steps: a `links` re-plan (or a `kept` event
for it) follows, and the steps after it are predicted within a third of what they take. Needs root
to make namespaces; skipped, saying why, where they cannot be made."""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest
from localjob import LocalJob
from netns import Hosts, available
from test_recipe import JOB, single_process
from test_sharded import _assert_exact

WHY_NOT = available()


@pytest.mark.skipif(bool(WHY_NOT), reason=f"network namespaces: {WHY_NOT}")
@pytest.mark.timeout(400)
def test_a_slow_link_between_hosts_is_learned_and_the_plan_weighed_again(tmp_path: Path) -> None:
    reference = single_process()
    with Hosts(["a", "b"], rate_mbit=50) as hosts, \
            LocalJob(JOB, tmp_path, min_workers=2, coordinator_args=["--layout", "dp=2"],
                     bind_host=hosts.bridge_address) as job:
        job.start()
        for name, host in (("w1", "a"), ("w2", "b")):
            job.add_worker(name, "--host", host, prefix=hosts.prefix(host), env_extra=hosts.env(host))
        exits = job.wait_workers(300)
        assert exits == {"w1": 0, "w2": 0}, job.tails(exits)
        assert job.wait_coordinator(30) == 0
        events = job.events()
    _assert_exact(events, reference)
    answered = [e for e in events if e["kind"] in ("plan", "kept") and e.get("reason") == "links"]
    assert answered, [(e["kind"], e.get("reason")) for e in events if e["kind"] in ("plan", "kept")]
    at = events.index(answered[0])
    after = [e for e in events[at:] if e["kind"] == "step" and e.get("predicted_s")][3:]
    assert after, "steps after the links were learned"
    error = statistics.median(abs(e["step_s"] - e["predicted_s"]) / e["step_s"] for e in after)
    assert error < 1 / 3, (error, [(e["step_s"], e["predicted_s"]) for e in after])
