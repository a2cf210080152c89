"""`coordinator --bind tcp://HOST:PORT --job PATH:NAME --keys DIR`: parse flags, check the job, run
the daemon. `coordinator keygen DIR [--worker NAME ...]`: write the cluster's CURVE keys.

Exit status: 0 when the job finished or was stopped (ctl stop, SIGTERM); 2 for a usage error, a job
that does not load, keys that cannot be used, or an address that cannot be bound.
"""

from __future__ import annotations

import argparse
import faulthandler
import sys
import tempfile
from pathlib import Path
from typing import TextIO

import trio

from coordinator.daemon import CoordinatorConfig, serve
from coordinator.jobinfo import JobRefused, inspect_job, journaled_job
from coordinator.state import JOIN_WAIT_MAX_S
from plan.layout import LayoutError, parse_pin
from transport.security import KEYS_ENV, KeysError, generate_keys, keys_dir, load_server_keys

EPILOG = """\
examples:
  coordinator keygen keys/                                     # once: the cluster's CURVE keys
  coordinator --bind tcp://0.0.0.0:5555 --job examples/gpt.py:job --keys keys/ --min-workers 2
  coordinator --bind tcp://127.0.0.1:0 --job examples/mlp.py:job --insecure   # trusted network only
  coordinator --bind tcp://0.0.0.0:5555 --job examples/gpt.py:job --keys keys/ --metrics-port 9400

Security: every socket (workers, control, the rendezvous store) uses ZeroMQ CURVE with the keys in
--keys DIR (or $ADAPTRAIN_KEYS): only workers holding worker.key_secret and ctl holding
ctl.key_secret get in; everyone else is refused at the handshake and counted (ctl status). CURVE
does not cover the torch.distributed data plane between workers: run that on a private network.
--insecure runs without keys, for trusted networks only.

Once listening it prints one line (shown here in two):
  ready workers=tcp://HOST:PORT control=tcp://HOST:PORT state_dir=DIR job=REF keys=curve|none(insecure) protocol=N
        metrics=http://HOST:PORT/metrics    (this field only with --metrics-port)
Workers join with `worker --join <workers endpoint>`; `adaptrain-ctl --control <control endpoint>
status` shows the job. Events go to STATE_DIR/events.jsonl, one JSON object a line.
SIGTERM or SIGINT: a durable checkpoint at the next step boundary (waiting up to --stop-grace for
it), then tell the workers to stop, wait for them (up to --stop-grace), exit 0.

Restarts: STATE_DIR/journal.sqlite keeps the job's membership, plan and progress. A coordinator
killed and started again with the same --state-dir (and --bind; port 0 reuses the journaled port)
takes the job over: the workers train on meanwhile, register again by themselves and re-send the
step reports it missed (events: restarted, recovered; those not back within --recovery-grace are
failed). A journal that cannot be read is moved aside (journal_damaged) and the newest checkpoint
is resumed. events.jsonl is the job's one log across restarts: a coordinator started on it reads
it first (a line cut short by a crash is skipped, with a warning), so `ctl events`, `ctl report`
and the metrics' counters cover the whole job, and logs `restarted` at each such start. The layout
pin `adaptrain-ctl layout` set survives a restart with the same --layout (or none again); a
restart with a different --layout takes that one (a `layout` event says so) and re-plans under it.

Checkpoints: the workers write STATE_DIR/checkpoints/step-<N>/ (or --checkpoint-dir) with
torch.distributed.checkpoint, every --checkpoint-every steps, on `adaptrain-ctl checkpoint` and on
SIGTERM; each holds DCP's files and adaptrain.json (sha256 of every file). When every worker
holding the state is lost at once, the next workers resume from the newest intact checkpoint, in
whatever layout they are planned (events: checkpoint, state_lost, resumed, checkpoint_corrupt).
Plain torch reads one: torch.distributed.checkpoint.format_utils.dcp_to_torch_save(DIR, FILE).

Metrics: --metrics-port N serves Prometheus metrics (adaptrain_members, adaptrain_epoch,
adaptrain_steps_committed_total, adaptrain_samples_per_second, adaptrain_loss, ...: see the
README) at http://HOST:N/metrics, HOST being the --bind host; a port in use is an error at start
(exit 2). The endpoint is plain HTTP without keys (it only reads): let only your Prometheus reach it.
"""


def parse_args(argv: list[str] | None) -> tuple[CoordinatorConfig, str]:
    p = argparse.ArgumentParser(prog="coordinator", description="Run an adaptrain job's coordinator "
                                "(`coordinator keygen --help`: make its keys).",
                                epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bind", required=True, metavar="tcp://HOST:PORT",
                   help="where workers connect (port 0: pick a free port; the ready line prints it)")
    p.add_argument("--control", metavar="tcp://HOST:PORT",
                   help="where ctl connects (default: the --bind host, a free port)")
    p.add_argument("--job", required=True, metavar="PATH.py:NAME|module:NAME",
                   help="the job: a function returning worker.Job (examples/gpt.py:job)")
    p.add_argument("--state-dir", type=Path, metavar="DIR",
                   help="where events.jsonl goes (default: a new temporary directory); one live coordinator "
                        "per directory (a second one is refused)")
    p.add_argument("--min-workers", type=int, default=1, metavar="N",
                   help="workers to wait for before the first plan (default 1)")
    p.add_argument("--max-workers", type=int, metavar="N", help="at most N replicas; the rest wait on standby")
    p.add_argument("--lease", type=float, default=1.5, metavar="S",
                   help="a worker silent for S seconds is declared failed (default 1.5)")
    p.add_argument("--heartbeat", type=float, default=0.25, metavar="S",
                   help="how often workers heartbeat (default 0.25; keep well under --lease)")
    p.add_argument("--drain-deadline", type=float, default=25.0, metavar="S",
                   help="a drained or preempted (SIGTERM) worker must hand its state over within S seconds "
                        "(default 25, under a spot notice's usual 30); past it the coordinator lets it go as "
                        "failed (a drain_deadline event) and its part comes from the copies or replicas")
    p.add_argument("--ack-timeout", type=float, default=20.0, metavar="S",
                   help="every member of a new plan must acknowledge it (its group formed, its state in place) "
                        "within S seconds plus two of the plan's predicted steps (default 20); a member that has "
                        "not is declared failed (a failed event, detected_by ack_timeout): the others re-plan "
                        "without it, and it joins again as a newcomer if it is alive. No plan stays pending longer")
    p.add_argument("--recovery-grace", type=float, default=10.0, metavar="S",
                   help="restarted on a state dir whose journal holds a running plan: wait up to S seconds for "
                        "its members to register again (they train on meanwhile; default 10); those not back "
                        "by then are failed and the others re-plan")
    p.add_argument("--stop-grace", type=float, default=10.0, metavar="S",
                   help="on SIGTERM or ctl stop, wait up to S seconds for workers to leave (and, on SIGTERM, "
                        "first up to S seconds for the checkpoint)")
    p.add_argument("--checkpoint-dir", type=Path, metavar="PATH",
                   help="where the workers write durable checkpoints (DCP), one step-<N> directory each; a "
                        "path every worker can write (default: STATE_DIR/checkpoints). A coordinator started "
                        "on a directory holding checkpoints of this job resumes from the newest complete one")
    p.add_argument("--checkpoint-every", type=int, default=0, metavar="N",
                   help="a checkpoint after every N-th step (default 0: only on `ctl checkpoint` and SIGTERM); "
                        "written in the background, so a step waits only for the state to be copied aside")
    p.add_argument("--checkpoint-keep", type=int, default=3, metavar="N",
                   help="keep the newest N complete checkpoints, deleting older ones (default 3; 0: keep all)")
    p.add_argument("--planner", choices=("milp", "even"), default="milp",
                   help="milp (default): the cost model and MILP choose devices and shares; even: every "
                        "usable worker, equal shares (a baseline to compare with)")
    p.add_argument("--solve-time-limit", type=float, default=0.5, metavar="S",
                   help="time limit of one MILP solve (default 0.5); a stopped solve keeps its best plan "
                        "and the plan event says time-limited")
    p.add_argument("--solver", choices=("auto", "search", "milp"), default="auto",
                   help="how the class-level plan is solved: search (an exact search over ring sizes, "
                        "milliseconds at 1,024 devices), milp (the PuLP model on HiGHS, CBC if HiGHS is "
                        "missing), auto (default: search, the MILP when the search space is too large)")
    p.add_argument("--stability", choices=("calm", "legacy"), default="calm",
                   help="calm (default): co-located workers' contention is predicted, a straggler is a lasting "
                        "change over a window, and a re-plan no membership change forced must pay for its "
                        "switch (else a `kept` event says why); legacy: the planner before that, a baseline "
                        "for benchmarks")
    p.add_argument("--horizon", type=int, default=200, metavar="STEPS",
                   help="steps over which a re-plan's one-off cost (new group, state moved) is amortised "
                        "when deciding whether a new plan pays off (default 200, or the steps left)")
    p.add_argument("--join-abandons", choices=("auto", "always", "never"), default="auto",
                   help="whether the members abandon the step in flight to take a newcomer in at once, instead of "
                        "switching at the next step boundary (up to a step later). auto (default): when the cost model "
                        "predicts it pays: the new plan is faster and little enough of the step has run (with M equal "
                        "members and one more like them, the first 1/(M+1) of the step); the plan event's detail says "
                        "so. always: whenever a step is in flight (the fastest join; the step is done again). never: "
                        "a join always waits for the step boundary. A plan that reaches a member after its switch vote "
                        "would wait for the whole next step: auto and always weigh that step at its start and may "
                        "abandon it (an abandon event). Nothing is lost either way")
    p.add_argument("--join-wait-max", type=_seconds_or_none, default=UNSET, metavar="SECONDS|none",
                   help="with --join-abandons auto: also abandon the step in flight when the rest of it is "
                        "predicted to take longer than SECONDS, so that a newcomer never waits longer than that for "
                        "the step boundary (its entry, ~0.3 s for a 10M-parameter model, comes after). The price: "
                        "the members' work on the abandoned step, under one step each, once per join. "
                        f"Default {JOIN_WAIT_MAX_S:g}; none: no bound (a join then waits up to a step where "
                        "abandoning does not pay for itself: the most throughput, the slowest joins)")
    p.add_argument("--layout", metavar="dp=R,fsdp=S|pp=P[,dp=R][,fsdp=S][,tp=T]|tp=T[,dp=R][,fsdp=S]",
                   help="pin the layout's degrees: dp = replicas (dp_replicate), fsdp = members that shard the "
                        "state between them (dp_shard, FSDP2), pp = pipeline stages; an omitted one is planned. E.g. "
                        "--layout dp=1 shards over every member, --layout fsdp=1 keeps every member a replica, "
                        "--layout fsdp=2 makes replicas of shard groups of 2 (HSDP), --layout dp=2,fsdp=2 exactly "
                        "2 x 2 (both pinned: training waits for R x S ready workers, and more than --max-workers is "
                        "refused). --layout pp=2 cuts the model into 2 pipeline stages, sized to each member's "
                        "measured speed and memory, on the 2 fastest workers (the model must be an nn.Sequential "
                        "of its units); --layout pp=2,dp=2 runs 2 such pipelines, each on half the batch, a stage's gradients "
                        "summed over its replicas; --layout pp=2,fsdp=2 shards each stage's state over 2 members "
                        "(FSDP2 within the stage), and --layout pp=2,dp=2,fsdp=2 makes 2 replicas of that (HSDP within each "
                        "stage). --layout tp=2 splits the model's Linears over 2 members (tensor parallel: the job's "
                        "Job.tp_plan, or a Hugging Face model's own; a degree that does not divide the attention heads "
                        "is refused at start), --layout tp=2,dp=2 makes 2 replicas of that, --layout tp=2,fsdp=2 shards each "
                        "member's part over 2 (FSDP2), --layout pp=2,tp=2 a pipeline of 2 stages each split over 2, "
                        "--layout pp=2,fsdp=2,tp=2 every degree at once. Default: the planner chooses (sharded when no "
                        "replica fits a worker's memory, or when it predicts sharding faster; tp of each degree the "
                        "model admits, and pipelines, weighed once speeds are measured). "
                        "`adaptrain-ctl layout SPEC` changes the pin of the running job (SPEC as here, or auto). "
                        "A restart on a --state-dir keeps the pin the last `ctl layout` set when --layout is the "
                        "same as the journaling coordinator's; a different --layout (or none where there was "
                        "one) wins: the command line at the restart is the operator's latest word")
    p.add_argument("--keys", metavar="DIR",
                   help=f"CURVE keys written by `coordinator keygen DIR` (default: ${KEYS_ENV})")
    p.add_argument("--insecure", action="store_true",
                   help="run without keys: anyone who can reach the ports can join, read events or stop the "
                        "job. Only for a trusted network (or loopback)")
    p.add_argument("--max-joining", type=int, default=64, metavar="N",
                   help="at most N workers joined but not yet ready at once; more Joins are told to retry "
                        "(default 64)")
    p.add_argument("--metrics-port", type=int, metavar="N",
                   help="serve Prometheus metrics over HTTP at http://HOST:N/metrics, HOST being the --bind "
                        "host (0: a free port; the ready line prints the URL). Default: no metrics endpoint")
    p.add_argument("--quiet", action="store_true", help="print only the ready line and errors")
    a = p.parse_args(argv)
    for flag, endpoint in (("--bind", a.bind), ("--control", a.control)):
        if endpoint is not None and not endpoint.startswith(("tcp://", "ipc://")):
            p.error(f"{flag} wants tcp://HOST:PORT, got {endpoint!r}")
    if a.min_workers < 1:
        p.error("--min-workers must be at least 1")
    if a.max_workers is not None and a.max_workers < a.min_workers:
        p.error("--max-workers must be at least --min-workers")
    if a.solve_time_limit <= 0:
        p.error("--solve-time-limit must be positive")
    if a.horizon < 1:
        p.error("--horizon must be at least 1")
    if a.max_joining < 1:
        p.error("--max-joining must be at least 1")
    if a.metrics_port is not None and not 0 <= a.metrics_port <= 65535:
        p.error(f"--metrics-port wants a port number from 0 (a free one) to 65535, got {a.metrics_port}")
    layout = None
    if a.layout is not None:
        try:
            layout = parse_pin(a.layout)
        except LayoutError as e:
            p.error(str(e))
        if layout.members is not None and a.max_workers is not None and layout.members > a.max_workers:
            p.error(f"--layout {a.layout} needs {layout.members} members, but --max-workers is {a.max_workers}")
        if layout.members is not None and a.min_workers < layout.members:
            # (the core waits for them, `coordinator.state.workers_needed`, from the pin in force: a
            # `ctl layout` that needs fewer members then lets the job start with the workers it has)
            print(f"[coordinator] --layout {a.layout} needs {layout.members} members: training starts once "
                  f"{layout.members} workers are ready (--min-workers {a.min_workers} raised to {layout.members})",
                  file=sys.stderr, flush=True)
    directory = keys_dir(a.keys)
    if a.insecure and a.keys is not None:
        p.error("--insecure and --keys contradict each other: choose one")
    keys = None
    if not a.insecure:
        if directory is None:
            p.error(f"no keys: give --keys DIR (make them once with `coordinator keygen DIR`) or set ${KEYS_ENV}; "
                    "on a trusted network, --insecure runs without them")
        try:
            keys = load_server_keys(directory)
        except KeysError as e:
            p.error(str(e))
    if a.checkpoint_every < 0:
        p.error(f"--checkpoint-every must be 0 (only when asked) or a number of steps, got {a.checkpoint_every}")
    if a.checkpoint_keep < 0:
        p.error(f"--checkpoint-keep must be 0 (keep all) or more, got {a.checkpoint_keep}")
    if a.recovery_grace <= 0:
        p.error(f"--recovery-grace must be positive seconds, got {a.recovery_grace}")
    if isinstance(a.join_wait_max, float) and not a.join_wait_max >= 0:
        p.error(f"--join-wait-max must be seconds >= 0 or none, got {a.join_wait_max}")
    if a.join_wait_max is not UNSET and a.join_abandons != "auto":
        p.error(f"--join-wait-max bounds the wait of --join-abandons auto; with --join-abandons {a.join_abandons} "
                "a join " + ("always abandons the step in flight" if a.join_abandons == "always"
                             else "always waits for the step boundary") + ": drop one of the two")
    if a.ack_timeout <= 0:
        p.error(f"--ack-timeout must be positive seconds, got {a.ack_timeout}")
    if a.drain_deadline <= 0:
        p.error(f"--drain-deadline must be positive seconds, got {a.drain_deadline}")
    if a.lease <= 0 or a.heartbeat <= 0 or a.heartbeat >= a.lease:
        p.error("--heartbeat and --lease must be positive, with --heartbeat below --lease")
    control = a.control
    if control is None:
        host = a.bind.rsplit(":", 1)[0] if a.bind.startswith("tcp://") else "tcp://127.0.0.1"
        control = f"{host}:0"
    state_dir = a.state_dir or Path(tempfile.mkdtemp(prefix="adaptrain-"))
    # the bound is auto's (never and always have none); not given: the default; `none`: no bound
    wait_max = None if a.join_abandons != "auto" else JOIN_WAIT_MAX_S if a.join_wait_max is UNSET else a.join_wait_max
    cfg = CoordinatorConfig(bind=a.bind, control=control, state_dir=state_dir, keys=keys,
                            max_joining=a.max_joining, min_workers=a.min_workers,
                            max_workers=a.max_workers, lease_s=a.lease, heartbeat_s=a.heartbeat,
                            stop_grace_s=a.stop_grace, drain_deadline_s=a.drain_deadline, quiet=a.quiet,
                            ack_timeout_s=a.ack_timeout,
                            planner=a.planner,
                            solve_time_limit_s=a.solve_time_limit, horizon_steps=a.horizon, stability=a.stability,
                            layout=layout, checkpoint_dir=a.checkpoint_dir or state_dir / "checkpoints",
                            checkpoint_every=a.checkpoint_every, checkpoint_keep=a.checkpoint_keep,
                            recovery_grace_s=a.recovery_grace, join_abandons=a.join_abandons,
                            join_wait_max_s=wait_max, solver=a.solver, metrics_port=a.metrics_port,
                            metrics_host=metrics_host(a.bind))
    return cfg, a.job


UNSET = object()  # (--join-wait-max not given: the default applies under auto; not a string: argparse
#                   runs `type` on a string default)


def _seconds_or_none(text: str) -> float | None:
    """--join-wait-max's value: seconds, or "none" (no bound)."""
    if text.strip().lower() == "none":
        return None
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"seconds or none, got {text!r}") from None


def metrics_host(bind: str) -> str:
    """The address the metrics endpoint listens on: the host of `--bind` (`*` is every interface,
    IPv6 loses its brackets; an ipc:// bind has none, so loopback)."""
    if not bind.startswith("tcp://"):
        return "127.0.0.1"
    host = bind[len("tcp://"):].rsplit(":", 1)[0]
    if host == "*":
        return "0.0.0.0"
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


KEYGEN_EPILOG = """\
writes (existing key files are kept, so it is safe to run again to add --worker keys):
  DIR/server.key, DIR/server.key_secret    the coordinator's pair (the secret stays on the coordinator)
  DIR/worker.key, DIR/worker.key_secret    the key every worker uses
  DIR/ctl.key, DIR/ctl.key_secret          the key of the control tool
  DIR/workers/NAME.key(_secret)            with --worker NAME: a key that can only join as NAME

to hand keys to a spot instance, give it a directory with server.key and worker.key_secret only
(or server.key and workers/NAME.key_secret), e.g. from your secrets manager at boot, and start
`worker --keys THAT_DIR`; ctl needs server.key and ctl.key_secret.
"""


def keygen(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="coordinator keygen", description="Write the cluster's CURVE keys.",
                                epilog=KEYGEN_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dir", type=Path, metavar="DIR")
    p.add_argument("--worker", action="append", default=[], metavar="NAME",
                   help="also write a per-worker key that may only join as NAME (repeatable)")
    a = p.parse_args(argv)
    try:
        written = generate_keys(a.dir, workers=a.worker)
    except (KeysError, OSError) as e:
        print(f"coordinator keygen: {e}", file=sys.stderr)
        return 2
    for path in written:
        print(f"wrote {path}")
    if not written:
        print(f"all keys already exist in {a.dir}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["keygen"]:
        return keygen(args[1:])
    cfg, job_ref = parse_args(args)
    faulthandler.enable(all_threads=True)  # a native crash (zmq, the solver) leaves its stacks in the log
    try:  # (a restart on this job's state dir: the journal knows the job, and listening comes first)
        job = journaled_job(cfg.state_dir / "journal.sqlite", job_ref) or inspect_job(job_ref)
    except JobRefused as e:
        print(f"coordinator: refusing job {job_ref}: {e}", file=sys.stderr)
        return 2
    if cfg.layout is not None and (why := job.refuses(cfg.layout.tp)):
        print(f"coordinator: refusing --layout {cfg.layout.describe()} for job {job_ref}: {why}", file=sys.stderr)
        return 2
    try:
        lock = lock_state_dir(cfg.state_dir)
    except StateDirBusy as e:
        print(f"coordinator: {e}", file=sys.stderr)
        return 2
    try:
        trio.run(serve, cfg, job)
    except OSError as e:
        print(f"coordinator: {e}", file=sys.stderr)
        return 2
    finally:
        lock.close()
    return 0


class StateDirBusy(Exception):
    """Another coordinator is alive on this state directory."""


def lock_state_dir(state_dir: Path) -> TextIO:
    """Hold `STATE_DIR/coordinator.lock` (an flock, released by the OS when this process dies, even
    by SIGKILL) so that two coordinators never write one job's state; the file names the holder."""
    import fcntl
    import os

    state_dir.mkdir(parents=True, exist_ok=True)
    path = state_dir / "coordinator.lock"
    f = open(path, "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "another process"
        f.close()
        raise StateDirBusy(f"{state_dir} is in use by a live coordinator ({holder}); stop it, or give another "
                           "--state-dir") from None
    f.seek(0)
    f.truncate()
    f.write(f"pid {os.getpid()}\n")
    f.flush()
    return f
