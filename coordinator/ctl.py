# ctl (`adaptrain-ctl`, or `python scripts/ctl.py`): the operator's control tool for a running
# adaptrain coordinator.
#
# Design. One request, one reply: every command is a `transport.ControlRequest` sent from a fresh
# zmq DEALER to the coordinator's control ROUTER (the `control=` endpoint of its ready line), and the
# answer is one `ControlReply` decoded by `transport.decode`. The coordinator computes every answer
# (coordinator/control.py); this file only formats it. `report` is the one command that computes:
# it reads every event (paged from the live coordinator, or from a finished job's events.jsonl)
# and hands them to coordinator.report. It imports transport's codec and zmq, never torch, trio,
# pulp, numpy or the daemon (coordinator/__init__ loads those lazily, and matplotlib is imported
# only to draw), so it starts fast and runs on any machine with adaptrain installed.
#
# Invariants:
# - Every wait has a deadline (`--timeout`, default 5 s). A request that times out is never
#   retried on the same socket (a late reply would answer the next request: replies carry no id),
#   and the socket is closed with linger 0, so ctl never hangs on exit.
# - Exit status: 0 success; 1 the coordinator refused the command (ok=false, or an `Error` reply);
#   2 usage error or no answer at all. `events --follow` ends with 0 on Ctrl-C, and with 0 plus a
#   note when a coordinator that had answered stops answering (the job ended), or closes the next
#   connection mid-handshake (as one that is shutting down may).
# - `--json` prints the reply's `data` exactly as the coordinator sent it (for `events --follow`,
#   one event object a line), so scripts never parse the human tables.
#
# Installed as the `adaptrain-ctl` console script; scripts/ctl.py is a shim that calls `main` here.

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, NoReturn

import zmq
from zmq.utils.monitor import recv_monitor_message

from coordinator import report
from transport import CodecError, ControlReply, ControlRequest, Error, decode, encode
from transport.endpoints import EndpointError, check_connect_endpoint, no_answer
from transport.security import (
    HANDSHAKE_EVENTS,
    KEYS_ENV,
    ROLE_CTL,
    ClientKeys,
    KeysError,
    handshake_failure,
    harden_client,
    keys_dir,
    load_client_keys,
    no_detail_failure,
)

EPILOG = """\
examples:
  adaptrain-ctl --control tcp://127.0.0.1:5556 status
  adaptrain-ctl --control tcp://127.0.0.1:5556 plan --json
  adaptrain-ctl --control tcp://127.0.0.1:5556 plan --explain
  adaptrain-ctl --control tcp://127.0.0.1:5556 save runs/gpt/step-1000
  adaptrain-ctl --control tcp://127.0.0.1:5556 checkpoint                 # DCP, into --checkpoint-dir
  adaptrain-ctl --control tcp://127.0.0.1:5556 graph
  adaptrain-ctl --control tcp://127.0.0.1:5556 events --follow
  adaptrain-ctl --control tcp://127.0.0.1:5556 events --since 100 --json
  adaptrain-ctl --control tcp://127.0.0.1:5556 drain worker-3
  adaptrain-ctl --control tcp://127.0.0.1:5556 slowdown worker-2 3   # test knob: 3x slower
  adaptrain-ctl --control tcp://127.0.0.1:5556 layout pp=2           # re-plan the running job as a pipeline
  adaptrain-ctl --control tcp://127.0.0.1:5556 layout auto           # no pin: the planner chooses again
  adaptrain-ctl --control tcp://127.0.0.1:5556 report --plot progress.png   # a live job
  adaptrain-ctl report --events runs/gpt/events.jsonl --plot progress.png  # a finished one
  adaptrain-ctl --control tcp://127.0.0.1:5556 stop

`python scripts/ctl.py ...` (from a checkout) is the same tool.

The control endpoint is the `control=` address in the coordinator's `ready` line (not the workers
one). --control may also come from $ADAPTRAIN_CONTROL; `report --events PATH` needs none.
--keys DIR (or $ADAPTRAIN_KEYS) holds server.key and ctl.key_secret from `coordinator keygen`;
without keys ctl connects without CURVE, which only an --insecure coordinator accepts. --json,
--keys and --timeout may go before or after the command.

exit status: 0 done; 1 the coordinator refused the command (the reason goes to stderr);
2 usage error, no answer within --timeout, or a file that cannot be read or written.
"""

REPORT_EPILOG = """\
examples:
  adaptrain-ctl --control tcp://127.0.0.1:5556 report --plot progress.png   # a live job: every event so far
  adaptrain-ctl report --events runs/gpt/events.jsonl --plot progress.png  # a finished job, no coordinator
  adaptrain-ctl report --events runs/gpt/events.jsonl --json               # the summary as JSON

It prints a summary (steps, loss, samples/s, members, how many of each event) and, with --plot,
where the PNG went; with --json the summary as one JSON object ("plot": the file or null). A line
of the events file that is cut short or not an event is named on stderr ("line 7: not JSON ...")
and skipped. Exit status: 0 done; 1 nothing to plot (no committed step); 2 a file that cannot be
read or written, or no answer from the coordinator.
"""

FOLLOW_POLL_S = 0.2
EVENTS_PAGE = 1000  # the coordinator answers at most this many events per request


class NoAnswer(Exception):
    """The coordinator did not answer within the timeout."""


class Refused(Exception):
    """The coordinator answered, but not with ok=true."""


class HandshakeRefused(Refused):
    """The connection failed at the handshake (keys, or the peer closed it mid-handshake)."""


# --- talking to the coordinator ------------------------------------------------------------------


class Client:
    """A DEALER to the control endpoint. A request that times out poisons the socket (a late reply
    would be taken for the next answer), so the next request gets a fresh one."""

    def __init__(self, endpoint: str, timeout_s: float, keys: ClientKeys | None = None) -> None:
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        self.keys = keys
        self.ctx = zmq.Context()
        self.sock: zmq.Socket[bytes] | None = None
        self.monitor: zmq.Socket[bytes] | None = None
        self.connected = False  # a TCP connection to the endpoint was made (what a timeout says)

    def _connect(self) -> zmq.Socket[bytes]:
        if self.sock is None:
            self.sock = self.ctx.socket(zmq.DEALER)
            self.sock.setsockopt(zmq.LINGER, 0)
            harden_client(self.sock, max_bytes=64 << 20, keys=self.keys)
            self.monitor = self.sock.get_monitor_socket(HANDSHAKE_EVENTS | zmq.EVENT_CONNECTED)
            self.sock.connect(self.endpoint)
        return self.sock

    def _drop(self) -> None:
        if self.sock is not None:
            self.sock.disable_monitor()
            self.sock.close(linger=0)
        if self.monitor is not None:
            self.monitor.close(linger=0)
        self.sock = self.monitor = None

    def _wait(self) -> None:
        """Until the answer is there; Refused when the coordinator refuses the handshake (keys)."""
        assert self.sock is not None and self.monitor is not None
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self.monitor, zmq.POLLIN)
        deadline = time.monotonic() + self.timeout_s
        while (left := deadline - time.monotonic()) > 0:
            ready = dict(poller.poll(int(left * 1000) + 1))
            if self.sock in ready:
                return
            if self.monitor in ready:
                event = recv_monitor_message(self.monitor)
                kind = int(event["event"])
                if kind == zmq.EVENT_CONNECTED:
                    self.connected = True
                    continue
                why = handshake_failure(kind, int(event["value"]), self.keys, who="ctl", endpoint=self.endpoint)
                if why is None and kind != zmq.EVENT_HANDSHAKE_SUCCEEDED:
                    why = no_detail_failure(self.keys)  # ctl never got in: say what is likely wrong
                if why is not None:
                    self._drop()
                    raise HandshakeRefused(why)
        self._drop()
        hint = "" if self.keys is not None or not self.connected else \
            f" (if it uses keys, give --keys DIR or set ${KEYS_ENV})"
        raise NoAnswer(no_answer(self.endpoint, self.timeout_s, who="ctl", connected=self.connected) + hint)

    def request(self, command: str, *args: str) -> dict[str, Any]:
        sock = self._connect()
        try:  # never block: a connection refused at the handshake leaves no pipe, and the monitor says why
            sock.send(encode(ControlRequest(command=command, args=list(args))), zmq.NOBLOCK)
        except zmq.Again:
            pass
        self._wait()
        frames = sock.recv_multipart()
        try:
            reply = decode(frames[-1])
        except CodecError as e:
            raise Refused(f"could not read the coordinator's answer: {e}") from None
        if isinstance(reply, Error):
            hint = ""
            if "ControlRequest" in reply.message:  # the workers endpoint answers ctl like this
                hint = " (is --control the `control=` endpoint of the ready line, not `workers=`?)"
            raise Refused(f"the coordinator answered with an error ({reply.code}): {reply.message}{hint}")
        if not isinstance(reply, ControlReply):
            raise Refused(f"the coordinator answered with an unexpected {type(reply).__name__}")
        if not reply.ok:
            raise Refused(reply.error or f"{command} failed (no reason given)")
        return reply.data

    def close(self) -> None:
        self._drop()
        self.ctx.term()


# --- formatting ----------------------------------------------------------------------------------


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths)).rstrip()]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
    return "\n".join(lines)


def _num(x: Any) -> str:
    """A compact number: 1.23k, 45.6M; '-' for None."""
    if x is None:
        return "-"
    if not isinstance(x, (int, float)) or isinstance(x, bool):
        return str(x)
    for scale, suffix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= scale:
            return f"{x / scale:.3g}{suffix}"
    return f"{x:.3g}" if isinstance(x, float) else str(x)


def _value(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.6g}"
    if isinstance(v, (dict, list)):
        return json.dumps(v, separators=(",", ":"))
    return str(v)


def _yes(b: Any) -> str:
    return "yes" if b else "no"


def format_status(d: dict[str, Any]) -> str:
    state = d.get("reason") or d.get("state") or "?"  # (coordinator.phase says what the job does and why)
    head = (f"job {d.get('job', '?')}  epoch {d.get('epoch', '?')}  step {d.get('step', '?')}/"
            f"{d.get('num_steps', '?')}  global batch {d.get('global_batch', '?')}  up {d.get('uptime_s', '?')} s\n"
            f"state: {state}  (pending {_yes(d.get('pending'))}, finished {_yes(d.get('finished'))})")
    if d.get("lr") is not None:
        head += f"\nlast step: lr {_num(d.get('lr'))}, gradient norm {_num(d.get('grad_norm'))} (before clipping)"
    ev = d.get("eval")
    if ev:
        head += f"\nlast evaluation: loss {ev.get('loss'):.4f} after step {ev.get('step')} ({ev.get('samples')} held-out samples)"
    ck = d.get("checkpoint")
    if ck:
        head += f"\nnewest checkpoint: step {ck.get('step')} at {ck.get('path')} ({_num(ck.get('bytes'))}B)"
    pin = d.get("layout_pin")
    if pin and pin != "auto":
        head += f"\nlayout pinned to {pin} (`layout auto` lets the planner choose)"
    resuming = d.get("resuming")
    if resuming:
        head += f"\nresuming from checkpoint {resuming.get('path')} (step {resuming.get('step')}) when workers are planned"
    refused = d.get("refused") or {}
    by = ", ".join(f"{k} {v}" for k, v in refused.items())
    head += (f"\nsecurity: {'CURVE keys' if d.get('secure', True) else 'none (--insecure)'}  "
             f"refused inputs: {d.get('refused_total', 0)}{f' ({by})' if by else ''}")
    workers = d.get("workers") or []
    if not workers:
        return head + "\nno workers"
    rows = [[str(w.get("name", "?")), str(w.get("role", "?")), _num(w.get("rank")), _num(w.get("share")),
             _num(w.get("step")), _num(w.get("epoch")),
             f"{w['last_seen_s']:.2f} s" if isinstance(w.get("last_seen_s"), (int, float)) else "-",
             _num(w.get("speed")), str(w.get("host", "-")), str(w.get("device", "-"))] for w in workers]
    headers = ["NAME", "ROLE", "RANK", "SHARE", "STEP", "EPOCH", "LAST SEEN", "SPEED", "HOST", "DEVICE"]
    return head + "\n\n" + _table(headers, rows)


_DEGREES = ("dp_replicate", "dp_shard", "pp", "tp")


def format_plan(d: dict[str, Any]) -> str:
    if d.get("plan", True) is None or "members" not in d:
        return f"no plan (epoch {d.get('epoch', 0)}): {d.get('detail') or '-'}"
    layout = d.get("layout") or {}
    lay = " x ".join(f"{k}={v}" for k, v in layout.items() if k in _DEGREES and v != 1) or "1 member"
    if layout and all(layout.get(k, 1) == 1 for k in _DEGREES[1:]):
        lay = f"replicated (dp_replicate={layout.get('dp_replicate', 1)})"
    elif layout and layout.get("dp_shard", 1) > 1:
        lay = f"sharded ({lay})"
    elif layout and layout.get("pp", 1) > 1:
        lay = f"pipeline ({lay})"
    predicted = d.get("predicted_step_s")
    pin = d.get("layout_pin")
    pinned = f" (pinned to {pin})" if pin and pin != "auto" else ""
    head = (f"epoch {d.get('epoch')}  mode {d.get('mode', '?')}  layout {lay}{pinned}  global batch "
            f"{d.get('global_batch')}  predicted step {f'{predicted:.4g} s' if isinstance(predicted, (int, float)) else '-'}")
    acked = set(d.get("acknowledged") or [])
    members, shares = d.get("members") or [], d.get("shares") or []
    rows = [[str(i), str(n), _num(s), _yes(n in acked)] for i, (n, s) in enumerate(zip(members, shares))]
    stages = layout.get("stages") or []
    if not stages:
        return head + "\n\n" + _table(["RANK", "MEMBER", "SHARE", "ACKED"], rows)
    per_stage = len(members) // len(stages)  # (ranks are pp-major: a stage's ranks are consecutive)
    for i, row in enumerate(rows):
        row.append(f"{i // per_stage}: {' '.join(stages[i // per_stage])}")
    return head + "\n\n" + _table(["RANK", "MEMBER", "SHARE", "ACKED", "STAGE: UNITS"], rows)


def _ms(x: Any) -> str:
    return f"{x * 1e3:.1f} ms" if isinstance(x, (int, float)) and not isinstance(x, bool) else "-"


def format_explain(d: dict[str, Any]) -> str:
    """The `explain` part of `plan --explain`."""
    e = d.get("explain") or {}
    members = e.get("members") or []
    if not members:  # no plan: the detail is why nothing trains now (coordinator.phase)
        return f"no plan: {e.get('detail', '')}"
    lines = [f"status {e.get('status')}: {e.get('detail', '')}"]
    rows = [[str(m.get("rank")), str(m.get("name")), _num(m.get("samples")), _num(m.get("speed")),
             _ms(m.get("compute_s")), _ms(m.get("overhead_s")), _ms(m.get("wait_s")), _ms(m.get("comm_s")),
             f"{_num(m.get('memory_bytes'))}B / {_num(m.get('memory_limit_bytes'))}B"] for m in members]
    lines += ["", f"predicted step {_ms(e.get('predicted_step_s'))} (objective with amortised switch cost "
                  f"{_ms(e.get('objective_s'))})",
              _table(["RANK", "MEMBER", "SAMPLES", "SAMPLES/S", "COMPUTE", "OVERHEAD", "WAIT", "ALL-REDUCE",
                      "MEMORY / LIMIT"], rows)]
    if e.get("standby"):
        lines += ["", f"standby: {', '.join(e['standby'])}"]
    runner = e.get("runner_up")
    if runner:
        lines += ["", f"runner-up: {runner.get('description')} ({', '.join(runner.get('members') or [])}): "
                      f"{_ms(runner.get('predicted_step_s'))}/step",
                  f"why this plan: {e.get('why', '')}"]
    candidates = e.get("candidates") or []
    if candidates:  # every layout weighed: its prediction and objective, or why it has none
        rows = [[("* " if c.get("chosen") else "  ") + str(c.get("layout")), _num(c.get("members") or None),
                 _ms(c.get("predicted_step_s")), _ms(c.get("objective_s")),
                 str(c.get("why_not") or c.get("description") or "")]
                for c in candidates]
        lines += ["", "candidates weighed (* the plan; objective: the step with the switch to it amortised; "
                      "a candidate with no prediction says why):",
                  _table(["  CANDIDATE", "MEMBERS", "PREDICTED STEP", "OBJECTIVE", "PLAN OR WHY NOT"], rows)]
    measured = e.get("measured")
    if measured:
        err = measured.get("median_error")
        lines += ["", f"measured so far: {measured.get('steps')} steps, median {_ms(measured.get('median_step_s'))} "
                      f"against {_ms(measured.get('predicted_step_s'))} predicted"
                      + (f" (median error {err:+.1%})" if isinstance(err, (int, float)) else "")]
    c = e.get("constants") or {}
    link = c.get("link") or {}
    factor = c.get("compute_factor")
    lines += ["", f"fitted: {link.get('scope', 'link')} alpha {_ms(link.get('alpha_s'))}, "
                  f"beta {_num((link.get('beta_s_per_byte') or 0) * 1e9)} ns/B ({link.get('measurements', 0)} "
                  f"measured all-reduces); epoch switch {_ms(c.get('switch_s'))} "
                  f"({c.get('migration_measurements', 0)} measured)"
                  + (f"; compute {factor:.2f}x FLOPs / calibrated FLOP/s" if isinstance(factor, (int, float)) else "")]
    for host, h in (c.get("contention") or {}).items():
        factors = ", ".join(f"{n} x{f:.2f}" for n, f in (h.get("factor") or {}).items())
        lines.append(f"contention on {host}: load {h.get('load')} threads/core, gamma {h.get('gamma')} "
                     f"({'learned' if h.get('learned') else 'not measured yet'}): {factors}")
    efficiency = c.get("efficiency") or {}
    if efficiency:  # (how each layout kind that ran computes, against the fits: 2.0 takes twice as long)
        lines.append("layout efficiency (compute time against the fits' units, learned from each kind's first steps): "
                     + ", ".join(f"{k} {v:.2f}" for k, v in efficiency.items()))
    placements = e.get("placements")
    if placements:
        lines.append("placements: " + ", ".join(f"{k} {v}" for k, v in placements.items()))
    for stage in e.get("stages") or []:
        lines.append(f"stage {stage.get('stage')}: units [{' '.join(stage.get('units') or [])}] on "
                     f"{', '.join(stage.get('members') or [])}")
    if e.get("changed"):
        lines += ["", "changed since this plan: " + "; ".join(e["changed"])]
    if e.get("kept"):
        lines += ["", f"a better plan was found but kept out: {e['kept']}"]
    return "\n".join(lines)


def format_layout(d: dict[str, Any]) -> str:
    """`layout`'s reply for people: what happens next."""
    pin = d.get("layout")
    then = ("the workers switch at the next step boundary; `plan` shows the result, `events` why when it "
            "must wait for workers")
    if pin == "auto":
        return f"re-planning with no layout pin (the planner chooses): {then}"
    return f"re-planning with the layout pinned to {pin}: {then}"


def format_graph(d: dict[str, Any]) -> str:
    def si(x: Any, unit: str) -> str:
        x = float(x or 0)
        for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
            if x >= scale:
                return f"{x / scale:.2f} {prefix}{unit}"
        return f"{x:.0f} {unit}"

    rows = [[str(layer.get("name")), str(layer.get("kind")), si(layer.get("param_bytes"), "B"),
             si(layer.get("flops"), "FLOP"), si(layer.get("activation_bytes"), "B"),
             si(layer.get("boundary_bytes"), "B")] for layer in d.get("layers") or []]
    head = (f"{len(rows)} layers, {si(d.get('param_bytes'), 'B')} of parameters, "
            f"{si(d.get('flops'), 'FLOP')} (forward + backward) and {si(d.get('activation_bytes'), 'B')} "
            "of saved activations per sample")
    return head + "\n\n" + _table(["LAYER", "KIND", "PARAMS", "FLOPS/SAMPLE", "ACTIVATIONS/SAMPLE",
                                     "BOUNDARY/SAMPLE"], rows)


def format_event(ev: dict[str, Any]) -> str:
    ts = ev.get("ts")
    if isinstance(ts, (int, float)):
        clock = time.strftime("%H:%M:%S", time.localtime(ts)) + f".{int((ts % 1) * 1000):03d}"
    else:
        clock = "??:??:??.???"
    fields = " ".join(f"{k}={_value(v)}" for k, v in ev.items() if k not in ("ts", "kind"))
    return f"{clock} {str(ev.get('kind', '?')):<8} {fields}".rstrip()


# --- commands ------------------------------------------------------------------------------------


def _print_json(data: Any) -> None:
    print(json.dumps(data, sort_keys=False), flush=True)


def cmd_simple(client: Client, a: argparse.Namespace) -> int:
    args: list[str] = []
    if a.command == "drain":
        args = [a.name]
    elif a.command == "slowdown":
        args = [a.name, a.factor]
    elif a.command == "plan" and a.explain:
        args = ["explain"]
    elif a.command == "layout":
        args = [a.spec]
    data = client.request(a.command, *args)
    if a.json:
        _print_json(data)
    elif a.command == "status":
        print(format_status(data))
    elif a.command == "plan":
        print(format_plan(data))
        if a.explain and data.get("members"):  # (without a plan, format_plan said why already)
            print("\n" + format_explain(data))
    elif a.command == "graph":
        print(format_graph(data))
    elif a.command == "drain":
        print(f"draining {data.get('draining', a.name)}: it is planned out and leaves at the next switch")
    elif a.command == "slowdown":
        print(f"{data.get('worker')}: compute stretched {data.get('factor'):g}x from its next step")
    elif a.command == "layout":
        print(format_layout(data))
    elif a.command == "stop":
        who = data.get("workers") or []
        print(f"stopping: told {len(who)} worker(s) to stop" + (f" ({', '.join(who)})" if who else ""))
    return 0


def cmd_save(client: Client, a: argparse.Namespace) -> int:
    """Ask for the save, then follow the events until the worker says it was written (or not)."""
    start = _newest_index(client)
    data = client.request("save", a.path)
    path = data.get("saving")
    if not a.json:
        print(f"saving to {path} at the next step boundary ({data.get('worker')} writes it)")
    e = _follow(client, start, a.wait, lambda e: e.get("kind") in ("saved", "save_failed") and e.get("path") == path)
    if e is None:
        if a.wait > 0:
            raise NoAnswer(f"asked for the save to {path}, but no worker reported it within {a.wait:g} s")
        return 0
    if a.json:
        _print_json(e)
    elif e["kind"] == "saved":
        print(f"saved the model after step {e['step']} to {path} ({_num(e.get('bytes'))}B)")
    if e["kind"] == "save_failed":
        raise Refused(f"{e.get('worker')} could not write {path}: {e.get('error')}")
    return 0


def cmd_checkpoint(client: Client, a: argparse.Namespace) -> int:
    """Ask for a checkpoint, then follow the events until it is written (or failed)."""
    start = _newest_index(client)
    data = client.request("checkpoint")
    if not a.json:
        print(f"checkpoint at the next step boundary after step {data.get('after_step')}, into {data.get('dir')} "
              f"({len(data.get('members') or [])} member(s) write their parts)")
    e = _follow(client, start, a.wait, lambda e: e.get("kind") in ("checkpoint", "checkpoint_failed"))
    if e is None:
        if a.wait > 0:
            raise NoAnswer(f"asked for a checkpoint, but none was reported within {a.wait:g} s")
        return 0
    if a.json:
        _print_json(e)
    elif e["kind"] == "checkpoint":
        print(f"checkpoint of step {e['step']} written to {e['path']} ({_num(e.get('bytes'))}B in {e.get('seconds')} s)")
    if e["kind"] == "checkpoint_failed":
        raise Refused(f"the checkpoint of step {e.get('step')} failed: {e.get('error')}")
    return 0


def _follow(client: Client, start: int, wait_s: float, match: Callable[[dict[str, Any]], bool]) -> dict[str, Any] | None:
    """The first event from index `start` on that `match`es, within `wait_s` seconds (None: none came)."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        page = client.request("events", str(start))
        start = int(page.get("next", start))
        events: list[dict[str, Any]] = page.get("events", [])
        found = next((e for e in events if match(e)), None)
        if found is not None:
            return found
        time.sleep(FOLLOW_POLL_S)
    return None


def _newest_index(client: Client) -> int:
    """The index the next event will get (events after a request come after it): the coordinator
    answers an index past the log's end with the end."""
    return int(client.request("events", str(2**62)).get("next", 0))


def _pages(client: Client, since: int) -> Iterator[tuple[list[dict[str, Any]], int]]:
    """Every page of events from index `since` up to now."""
    while True:
        data = client.request("events", str(since))
        events, since = list(data.get("events") or []), int(data.get("next", since))
        yield events, since
        if len(events) < EVENTS_PAGE:
            return


def cmd_events(client: Client, a: argparse.Namespace) -> int:
    emit: Callable[[dict[str, Any]], None] = (
        (lambda ev: _print_json(ev)) if a.json else (lambda ev: print(format_event(ev), flush=True)))
    if not a.follow:
        everything: list[dict[str, Any]] = []
        nxt = a.since
        for events, nxt in _pages(client, a.since):
            everything += events
        if a.json:
            _print_json({"events": everything, "next": nxt})
        else:
            for ev in everything:
                emit(ev)
            if not everything:
                print(f"no events since index {a.since}", file=sys.stderr)
        return 0
    nxt, answered = a.since, False
    try:
        while True:
            try:
                for events, nxt in _pages(client, nxt):
                    answered = True
                    for ev in events:
                        emit(ev)
            except (NoAnswer, HandshakeRefused):  # a coordinator that is going away may close mid-handshake
                if not answered:
                    raise
                print(f"ctl: the coordinator at {client.endpoint} stopped answering (the job is over, "
                      f"or it died); {nxt} events seen", file=sys.stderr)
                return 0
            time.sleep(FOLLOW_POLL_S)
    except KeyboardInterrupt:
        return 0


def _all_events(client: Client) -> list[dict[str, Any]]:
    everything: list[dict[str, Any]] = []
    for events, _ in _pages(client, 0):
        everything += events
    return everything


def cmd_report(client: Client | None, a: argparse.Namespace) -> int:
    """Summarise (and with --plot draw) the job's progress, from the live coordinator's events or
    from an events.jsonl (`--events`). Bad lines of the file are named on stderr and skipped."""
    if a.events is not None:
        source = str(a.events)
        try:
            read = report.read_events(a.events)
        except OSError as e:
            _die(f"cannot read the events file {a.events}: {e.strerror or e}", 2)
        for bad in read.bad:
            print(f"ctl: {a.events} line {bad.number}: {bad.why}; skipped", file=sys.stderr, flush=True)
        events = read.events
    else:
        assert client is not None
        source = client.endpoint
        events = _all_events(client)
    series = report.build_series(events)
    summary = report.summarize(series)
    if a.plot is not None:
        if not series.steps:
            _die(f"nothing to plot: no committed step in the {len(events)} events from {source}", 1)
        try:
            report.plot(series, a.plot, title=f"adaptrain: {source}")
        except (OSError, ValueError) as e:
            _die(f"cannot write the plot {a.plot}: {e}", 2)
    summary["plot"] = str(a.plot) if a.plot is not None else None
    if a.json:
        _print_json(summary)
    else:
        print(report.format_summary(summary))
        if a.plot is not None:
            print(f"plot written to {a.plot}")
    return 0


# --- arguments -----------------------------------------------------------------------------------


def _common(parser: argparse.ArgumentParser, *, suppress: bool) -> None:
    """Options accepted both before and after the command. On subcommands their defaults are
    suppressed, so a value given before the command is not overwritten by the subparser."""
    d = (lambda v: argparse.SUPPRESS) if suppress else (lambda v: v)
    parser.add_argument("--control", metavar="tcp://HOST:PORT", default=d(os.environ.get("ADAPTRAIN_CONTROL")),
                        help="the coordinator's control endpoint (`control=` in its ready line)")
    parser.add_argument("--timeout", type=float, metavar="S", default=d(5.0),
                        help="give up when the coordinator does not answer within S seconds (default 5)")
    parser.add_argument("--keys", metavar="DIR", default=d(None),
                        help=f"CURVE keys from `coordinator keygen` (server.key + ctl.key_secret); default ${KEYS_ENV}")
    parser.add_argument("--json", action="store_true", default=d(False),
                        help="print the coordinator's reply as JSON instead of tables")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Inspect and steer a running adaptrain job.",
                                epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    _common(p, suppress=False)
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True)

    def add(name: str, help: str) -> argparse.ArgumentParser:
        sp = sub.add_parser(name, help=help, description=help)
        _common(sp, suppress=True)
        return sp

    add("status", "the job, its epoch and progress, and every worker")
    pl = add("plan", "the current plan: members in rank order, their batch shares, the layout")
    pl.add_argument("--explain", action="store_true",
                    help="also the predicted step per member (compute, overhead, waiting, all-reduce), memory "
                         "against each limit, why it beat the runner-up, the fitted constants, and the "
                         "prediction against the steps measured so far")
    add("graph", "the model as the planner sees it: per layer parameters, FLOPs, activation bytes")
    ev = add("events", "the coordinator's event log (joined, left, failed, straggler, recovered, slowdown, "
                       "layout, plan, reshard, step)")
    ev.add_argument("--follow", "-f", action="store_true",
                    help=f"keep printing new events (polls every {FOLLOW_POLL_S} s) until Ctrl-C or the job ends")
    ev.add_argument("--since", type=int, default=0, metavar="N", help="start at event index N (default 0)")
    dr = add("drain", "plan a worker out at the next step boundary; it then leaves cleanly")
    dr.add_argument("name", metavar="NAME", help="the worker's name, as `status` shows it")
    sd = add("slowdown", "test knob: stretch a worker's compute by FACTOR (1 = full speed) from its next step")
    sd.add_argument("name", metavar="NAME", help="the worker's name, as `status` shows it")
    sd.add_argument("factor", metavar="FACTOR", help="1 (full speed) to 1000")
    sv = add("save", "write the model and optimizer state (model.pt, optimizer.pt: plain state_dicts) to "
                     "PATH at the next step boundary, and wait until it is written")
    sv.add_argument("path", metavar="PATH", help="a directory the workers can write (created if missing)")
    sv.add_argument("--wait", type=float, default=120.0, metavar="S",
                    help="how long to wait for the write (default 120 s; 0: do not wait)")
    ck = add("checkpoint", "write a durable checkpoint (torch.distributed.checkpoint, every member its part) at "
                           "the next step boundary into the coordinator's --checkpoint-dir, and wait until it "
                           "is complete")
    ck.add_argument("--wait", type=float, default=300.0, metavar="S",
                    help="how long to wait for it (default 300 s; 0: do not wait)")
    lo = add("layout", "pin the running job's layout to SPEC (or lift the pin: auto) and re-plan at once: the "
                       "workers reshard live at the next step boundary. A layout that needs more ready workers "
                       "than there are, or does not fit, waits for them while the current plan trains on (the "
                       "`plan` event, status infeasible, says why)")
    lo.add_argument("spec", metavar="SPEC",
                    help="as `coordinator --layout` takes it: dp=R (replicas), fsdp=S (members sharding the "
                         "state), both (dp=2,fsdp=2), or pp=P (pipeline stages, alone); or auto: no pin, the "
                         "planner chooses")
    add("stop", "stop every worker now (a step in flight is abandoned), then the coordinator exits")
    rp = add("report", "the job's progress over steps: samples/s, loss and members, with every join, leave, "
                       "failure, straggler, recovery, contention, plan (epoch), kept re-plan and reshard; a "
                       "summary, and a picture with --plot")
    rp.add_argument("--plot", type=Path, metavar="FILE.png",
                    help="draw samples/s (global batch / step time), loss and members over steps, each event "
                         "marked at the latest step committed when it happened, and write a PNG there")
    rp.add_argument("--events", type=Path, metavar="PATH",
                    help="read a job's events.jsonl (finished or running) instead of asking the coordinator; "
                         "then no --control is needed. Bad lines are named on stderr and skipped")
    rp.formatter_class = argparse.RawDescriptionHelpFormatter
    rp.epilog = REPORT_EPILOG

    a = p.parse_args(argv)
    offline = a.command == "report" and a.events is not None
    if not a.control and not offline:
        p.error("--control tcp://HOST:PORT is required (or set $ADAPTRAIN_CONTROL)"
                + ("; or give report --events PATH" if a.command == "report" else ""))
    if offline:
        a.control = None
    elif not a.control.startswith(("tcp://", "ipc://")):
        p.error(f"--control wants tcp://HOST:PORT, got {a.control!r}")
    else:
        try:  # at once, rather than a silent wait for --timeout
            check_connect_endpoint(a.control)
        except EndpointError as e:
            p.error(f"--control: {e}")
    if a.timeout <= 0:
        p.error("--timeout must be positive")
    if getattr(a, "since", 0) < 0:
        p.error("--since must be 0 or more")
    directory = keys_dir(a.keys)
    a.client_keys = None
    if directory is not None and not offline:
        try:
            a.client_keys = load_client_keys(directory, ROLE_CTL)
        except KeysError as e:
            p.error(str(e))
    return a


def _die(text: str, status: int) -> NoReturn:
    print(f"ctl: {text}", file=sys.stderr, flush=True)
    sys.exit(status)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a.control is None:  # report --events: a file, no coordinator
        try:
            return cmd_report(None, a)
        except BrokenPipeError:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return 0
    try:
        client = Client(a.control, a.timeout, a.client_keys)
    except zmq.ZMQError as e:
        _die(f"cannot use {a.control}: {e}", 2)
    try:
        if a.command == "events":
            return cmd_events(client, a)
        if a.command == "report":
            return cmd_report(client, a)
        if a.command == "save":
            return cmd_save(client, a)
        if a.command == "checkpoint":
            return cmd_checkpoint(client, a)
        return cmd_simple(client, a)
    except zmq.ZMQError as e:
        _die(f"cannot talk to {a.control}: {e}", 2)
    except NoAnswer as e:
        _die(str(e), 2)
    except Refused as e:
        _die(str(e), 1)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `ctl events | head`: the reader left; not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    finally:
        client.close()


if __name__ == "__main__":
    sys.exit(main())
