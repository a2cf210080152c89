"""The control plane's cost of safety: round trips and joins with and without CURVE, and fuzz absorbed
while training, in one run.

Sections (--sections, default all):

  latency  a real coordinator (no training: --min-workers is out of reach), once with CURVE keys and
           once --insecure, side by side:
             request round trip  a store `check` on the workers socket, answered by the coordinator:
                                 the path every worker message takes (heartbeats are one-way, so a
                                 request that gets an answer stands in for them)
             control round trip  `status` on the control socket (what ctl does)
             join                a fresh connection (TCP + handshake, CURVE and ZAP with keys) sends
                                 Join and gets its Welcome (the job's source included)
  fuzz     three workers train the paced job with keys (examples/paced.py:long_job, --planner even);
           the median step time of 100 quiet steps, then the median while scripts/fuzzer.py sends
           message-level inputs to the workers and the control socket at full speed: inputs absorbed
           per second, and the step-time ratio (1.0: absorbing them costs training nothing).

Prints a table and writes every number to --out (default bench-out/control.json).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import zmq

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fuzzer import CONTROL_KINDS, WORKER_KINDS, dealer, plan_messages, send_messages  # noqa: E402
from localjob import LocalJob, close_on_sigterm  # noqa: E402

from transport import ControlReply, ControlRequest, Join, Leave, StoreReply, StoreRequest, Welcome, decode, encode
from transport.security import ROLE_CTL, ROLE_WORKER, ClientKeys, load_client_keys

ROOT = Path(__file__).resolve().parent.parent
PACED = f"{ROOT / 'examples' / 'paced.py'}:long_job"
SECTIONS = ("latency", "fuzz")


def _ask(sock: zmq.Socket[bytes], frame: bytes, want: type, timeout_s: float = 10.0) -> float:
    """Seconds from send to the reply of type `want`."""
    t0 = time.perf_counter()
    sock.send(frame)
    while True:
        if not sock.poll(int(timeout_s * 1000)):
            raise TimeoutError("no reply")
        reply = decode(sock.recv())
        if isinstance(reply, want):
            return time.perf_counter() - t0


def _pct(xs: list[float]) -> dict[str, float]:
    xs = sorted(xs)
    return {"p50_ms": statistics.median(xs) * 1e3, "p99_ms": xs[min(len(xs) - 1, int(0.99 * len(xs)))] * 1e3,
            "n": len(xs)}


def latency(workdir: Path, secure: bool, rounds: int, joins: int) -> dict[str, Any]:
    with LocalJob(PACED, workdir, min_workers=100_000, insecure=not secure) as job:
        job.start()
        wkeys = load_client_keys(job.keys_dir, ROLE_WORKER) if job.keys_dir else None
        ckeys = load_client_keys(job.keys_dir, ROLE_CTL) if job.keys_dir else None
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        try:
            sock = dealer(ctx, job.workers_endpoint, wkeys)
            check = encode(StoreRequest(req_id=1, op="check", keys=["epoch0/x"], values=[], amount=0, timeout_s=1.0))
            _ask(sock, check, StoreReply)  # connect and handshake outside the measurement
            request = [_ask(sock, check, StoreReply) for _ in range(rounds)]
            sock.close()
            csock = dealer(ctx, job.control_endpoint, ckeys)
            status = encode(ControlRequest(command="status", args=[]))
            _ask(csock, status, ControlReply)
            control = [_ask(csock, status, ControlReply) for _ in range(rounds // 4)]
            csock.close()
            join_s = []
            for i in range(joins):
                t0 = time.perf_counter()
                s = dealer(ctx, job.workers_endpoint, wkeys)
                name = f"probe-{i}"
                _ask(s, encode(Join(name=name, host="bench", pid=i + 1, device="cpu", flops=1e9,
                                    memory_bytes=1 << 30, threads=1)), Welcome)
                join_s.append(time.perf_counter() - t0)
                s.send(encode(Leave(name=name, reason="finished")))
                s.close(linger=500)
        finally:
            ctx.term()
        job.ctl("stop")
        job.wait_coordinator(30)
    return {"secure": secure, "request": _pct(request), "control": _pct(control), "join": _pct(join_s)}


def _median_step_s(job: LocalJob, first: int, last: int) -> float:
    steps = job.steps()
    return float(statistics.median(steps[s]["step_s"] for s in range(first, last + 1) if s in steps))


def fuzz(workdir: Path, messages: int, seed: int) -> dict[str, Any]:
    with LocalJob(PACED, workdir, min_workers=3, coordinator_args=["--planner", "even"]) as job:
        job.start()
        for name in ("w1", "w2", "w3"):
            job.add_worker(name)
        job.wait_step(120, 300)
        quiet = _median_step_s(job, 21, 120)
        rng = random.Random(seed)
        plans = {"workers": plan_messages(rng, messages, dict(WORKER_KINDS), live=["w1", "w2", "w3"], control=False,
                                          oversize=0),
                 "control": plan_messages(rng, messages, dict(CONTROL_KINDS), live=[], control=True, oversize=0)}
        assert job.keys_dir is not None
        keys = {"workers": load_client_keys(job.keys_dir, ROLE_WORKER), "control": load_client_keys(job.keys_dir, ROLE_CTL)}
        endpoints = {"workers": job.workers_endpoint, "control": job.control_endpoint}
        results: dict[str, Any] = {}
        start_step = max(job.steps())

        def run(which: str) -> None:
            results[which] = send_messages(endpoints[which], keys[which], plans[which], {})

        t0 = time.perf_counter()
        threads = [threading.Thread(target=run, args=(w,)) for w in plans]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        expected = 2 * messages
        while job.ctl("status")["refused_total"] < expected and time.perf_counter() - t0 < 120:
            time.sleep(0.05)
        absorbed_s = time.perf_counter() - t0
        end_step = max(job.steps())
        during = _median_step_s(job, start_step + 1, end_step) if end_step > start_step else float("nan")
        refused = job.ctl("status")["refused_total"]
        job.ctl("stop")
        job.wait_coordinator(60)
    return {"inputs": expected, "refused": refused, "absorb_s": absorbed_s, "inputs_per_s": expected / absorbed_s,
            "steps_during": end_step - start_step, "quiet_step_s": quiet, "fuzzed_step_s": during,
            "step_ratio": during / quiet, "seed": seed}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench_control.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated, of {', '.join(SECTIONS)}")
    p.add_argument("--rounds", type=int, default=2000, help="round trips per mode (default 2000)")
    p.add_argument("--joins", type=int, default=100, help="joins per mode (default 100)")
    p.add_argument("--messages", type=int, default=20000, help="fuzz inputs per socket (default 20000)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out", type=Path, default=Path("bench-out/control.json"))
    a = p.parse_args(argv)
    close_on_sigterm()  # (SIGTERM closes what the `with` blocks below hold)
    sections = a.sections.split(",")
    if bad := [s for s in sections if s not in SECTIONS]:
        p.error(f"unknown sections {bad}; choose from {SECTIONS}")
    workdir = Path(tempfile.mkdtemp(prefix="bench-control-"))
    out: dict[str, Any] = {}
    if "latency" in sections:
        out["latency"] = [latency(workdir / f"lat-{s}", s, a.rounds, a.joins) for s in (True, False)]
        print("\nlatency (ms)            CURVE p50  p99    insecure p50  p99")
        for key, label in (("request", "request round trip"), ("control", "control round trip"), ("join", "join -> Welcome")):
            c, i = out["latency"][0][key], out["latency"][1][key]
            print(f"  {label:21} {c['p50_ms']:8.3f} {c['p99_ms']:6.3f}   {i['p50_ms']:10.3f} {i['p99_ms']:6.3f}")
    if "fuzz" in sections:
        f = out["fuzz"] = fuzz(workdir / "fuzz", a.messages, a.seed)
        print(f"\nfuzz while training: {f['inputs']} inputs absorbed in {f['absorb_s']:.2f} s "
              f"= {f['inputs_per_s']:.0f}/s (refused {f['refused']}); median step {f['quiet_step_s'] * 1e3:.1f} ms "
              f"quiet, {f['fuzzed_step_s'] * 1e3:.1f} ms fuzzed (ratio {f['step_ratio']:.3f}, "
              f"{f['steps_during']} steps)")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(out, indent=2) + "\n")
    print(f"\nwrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
