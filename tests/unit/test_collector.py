"""worker.collector: no automatic collections while a worker starts; then start-up's cyclic garbage
is collected once, the rest frozen out of later scans, and collections resume. Run in a fresh
interpreter: freezing would change the test process's own collector."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.process

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import gc, weakref
from worker import collector
collector.pause()
assert not gc.isenabled()

class Node:
    pass

before = gc.get_stats()[2]["collections"]
for _ in range(200_000):  # enough allocations to trigger collections, were the collector on
    a, b = Node(), Node()
    a.other, b.other = b, a  # a cycle: only the cyclic collector frees it
probe = weakref.ref(a)
del a, b
kept = [Node() for _ in range(1000)]
assert gc.get_stats()[2]["collections"] == before and probe() is not None, "a collection ran while paused"
collector.settle()
assert gc.isenabled() and probe() is None, "start-up's cyclic garbage is collected once"
assert gc.get_freeze_count() > 1000, "what start-up built is frozen"
print("ok")
"""


def test_pause_then_settle() -> None:
    out = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_the_worker_pauses_first_and_settles_before_it_is_ready() -> None:
    source = (ROOT / "worker" / "cli.py").read_text()
    main = source[source.index("def _main("):]
    assert main.index("collector.pause()") < main.index("import torch"), "paused before torch is imported"
    assert main.index("collector.settle()") < main.index("agent.mark_ready()"), "settled before Ready"
