"""`worker --join tcp://HOST:PORT`: calibrate, join, take the job from the coordinator, train.

Exit status: 0 when the job finished, the worker was drained or preempted (SIGTERM) or stopped;
1 when the job failed on this worker; 2 for a usage error or a coordinator that refused it.
A crash in native code (exit -11, SIGSEGV; -6, SIGABRT) writes every thread's Python stack to
stderr first (`faulthandler`), so the worker's log says where it was.
"""

from __future__ import annotations

import argparse
import dataclasses
import faulthandler
import hashlib
import os
import signal
import socket
import sys
from dataclasses import dataclass
from types import FrameType
from typing import Any

from transport import PROTOCOL_VERSION, GraphUpload, Leave, check_name
from transport.endpoints import EndpointError, check_connect_endpoint
from transport.security import KEYS_ENV, ROLE_WORKER, ClientKeys, KeysError, keys_dir, load_client_keys

PAUSE_PHASES = ("forward", "backward", "exchange", "vote", "optimizer", "abandon", "reshard", "save")

EPILOG = """\
examples:
  worker --join tcp://10.0.0.5:5555 --keys /etc/adaptrain/keys   # a spot instance joins a running job
  worker --join tcp://127.0.0.1:5555 --name w3 --threads 1      # keys from $ADAPTRAIN_KEYS
  worker --join tcp://coord:5555 --device cuda:0 --keys keys/   # GPU worker (NCCL data plane)

Keys: --keys DIR (or $ADAPTRAIN_KEYS) holds server.key and worker.key_secret (or
workers/NAME.key_secret, a key that may only join as NAME) from `coordinator keygen`. Without
keys the worker connects without CURVE, which only a coordinator started with --insecure accepts.

The job (model, data, optimizer) comes from the coordinator, so a new machine needs nothing but
adaptrain installed and the coordinator's address. SIGTERM (a spot preemption notice) makes the
worker hand its share back at the next step boundary and exit 0.
"""


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkerConfig:
    join: str
    name: str
    device: str
    threads: int
    memory_limit_gib: float | None
    digest_every: int
    log_every: int
    group_timeout_s: float
    connect_timeout_s: float
    coordinator_timeout_s: float
    slowdown: float
    keys: ClientKeys | None
    trace_steps: str | None
    pause_at: tuple[str, int] | None = None
    host: str | None = None  # the machine the planner groups it under (None: the host name)


def parse_args(argv: list[str] | None) -> WorkerConfig:
    p = argparse.ArgumentParser(prog="worker", description="Join an adaptrain job and train on this machine.",
                                epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--join", required=True, metavar="tcp://HOST:PORT",
                   help="the coordinator's workers endpoint (its `ready` line prints it)")
    p.add_argument("--name", help="how events and ctl name this worker (default: HOST-PID); must be unique")
    p.add_argument("--device", default="cpu", help="cpu (gloo) or cuda[:N] (NCCL); default cpu")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    p.add_argument("--memory-limit", type=float, metavar="GIB", dest="memory_limit",
                   help="report at most this much memory to the planner (fractions work: 0.001 is 1 MiB); "
                        "the planner gives this worker no more samples than fit")
    p.add_argument("--slowdown", type=float, default=1.0, metavar="FACTOR",
                   help="test knob: stretch every step's compute by FACTOR (>= 1; default 1), as a throttled "
                        "or shared device would; change it live with `ctl.py slowdown NAME FACTOR`. "
                        "Join-time calibration is not slowed, so the coordinator finds it from step timings")
    p.add_argument("--pause-at", metavar="PHASE@STEP", dest="pause_at",
                   help="fault-injection knob for tests: in step STEP (1-based) of a sharded layout, sleep 60 s (or "
                        "until the epoch is superseded: the step is given up there) at PHASE (forward: after the "
                        "forward, in a replicated layout too; backward: after the backward; exchange: after the "
                        "gradient slices went to the copy's keeper; optimizer: after the step's all-reduce, "
                        "before the update), saying so in the log, so that a test can SIGKILL or SIGSTOP it there; "
                        "abandon: after the all-reduce, drop the step as if its result never arrived (the others "
                        "apply it: a roll forward follows at the next failure); vote (either layout): just before its "
                        "switch vote, wait until a planned delta arrives, so that the others vote before it (a "
                        "missed vote); reshard: in the first epoch "
                        "entered at or after step STEP in which it sends slices, before any moves; save: before "
                        "the first `ctl save` taken at or after the end of step STEP (the others gather without it)")
    p.add_argument("--keys", metavar="DIR",
                   help=f"CURVE keys from `coordinator keygen` (server.key + worker.key_secret); default ${KEYS_ENV}; "
                        "none: connect without CURVE (only an --insecure coordinator accepts that)")
    p.add_argument("--digest-every", type=int, default=0, metavar="N",
                   help="hash the parameters every N steps and report it (to check replicas agree); 0: off")
    p.add_argument("--trace-steps", metavar="FILE",
                   help="append every step this worker reports (share, compute, communication and step time) to "
                        "FILE as JSON lines: to study timings, or to record series the planner's tests replay")
    p.add_argument("--host", metavar="NAME",
                   help="the machine this worker runs on, as the planner groups devices: workers with one host "
                        "share its cores and its fast links, and a copy of a member's state is kept on another "
                        "host where there is one (default: the host name; set it where containers or network "
                        "namespaces on one machine have host names of their own, or machines share one)")
    p.add_argument("--log-every", type=int, default=10, metavar="N", help="print progress every N steps")
    p.add_argument("--group-timeout", type=float, default=60.0, metavar="S",
                   help="torch.distributed timeout of each epoch's group (failures are detected long before)")
    p.add_argument("--connect-timeout", type=float, default=60.0, metavar="S",
                   help="give up if the coordinator does not answer within S seconds (default 60; a host name "
                        "that does not resolve fails at once)")
    p.add_argument("--coordinator-timeout", type=float, default=600.0, metavar="S",
                   help="give up (exit 2) once the coordinator has been unreachable for S seconds while this worker "
                        "needs it, waiting for a plan (default 600); a plan in place trains on without it")
    a = p.parse_args(argv)
    if not a.join.startswith(("tcp://", "ipc://")):
        p.error(f"--join wants tcp://HOST:PORT, got {a.join!r}")
    try:  # now, not after --connect-timeout: zmq would retry a name that never resolves in silence
        check_connect_endpoint(a.join)
    except EndpointError as e:
        p.error(f"--join: {e}")
    if a.threads < 1:
        p.error("--threads must be at least 1")
    if a.host is not None and not a.host.strip():
        p.error("--host must not be empty")
    if a.memory_limit is not None and a.memory_limit <= 0:
        p.error("--memory-limit must be positive")
    if not 1.0 <= a.slowdown <= 1000.0:
        p.error("--slowdown must be between 1 (full speed) and 1000")
    if not (a.device == "cpu" or a.device.startswith("cuda")):
        p.error(f"--device must be cpu or cuda[:N], got {a.device!r}")
    name = a.name or f"{socket.gethostname()}-{os.getpid()}"
    try:
        check_name(name)
    except ValueError as e:
        p.error(f"--name: {e}" if a.name else f"{e}; pass --name")
    directory = keys_dir(a.keys)
    keys = None
    if directory is not None:
        try:
            keys = load_client_keys(directory, ROLE_WORKER, name=name)
        except KeysError as e:
            p.error(str(e))
    pause_at = None
    if a.pause_at is not None:
        phase, _, step = a.pause_at.partition("@")
        if phase not in PAUSE_PHASES or not step.isdigit() or int(step) < 1:
            p.error(f"--pause-at wants PHASE@STEP with PHASE one of {', '.join(PAUSE_PHASES)}, got {a.pause_at!r}")
        pause_at = (phase, int(step))
    return WorkerConfig(keys=keys, trace_steps=a.trace_steps, pause_at=pause_at, join=a.join, name=name, device=a.device, threads=a.threads,
                        memory_limit_gib=a.memory_limit, digest_every=a.digest_every, log_every=a.log_every,
                        group_timeout_s=a.group_timeout, connect_timeout_s=a.connect_timeout,
                        coordinator_timeout_s=a.coordinator_timeout,
                        slowdown=a.slowdown, host=a.host)


def capture(name: str, job: Any) -> Any:
    """The model's graph (its units, for FSDP2, and what the planner reads), captured before the
    worker says it is ready, so that a join to a sharded job does not pay for it (about 1.3 s for the
    10M GPT). A model that cannot be captured gets the coarse one-unit graph and one warning line;
    the job's own mistake (`JobError`, e.g. `Job.blocks` naming no module) stops the worker with its
    message; running out of memory here is reported and left to the trainer (None)."""
    from worker.graph import capture_graph
    from worker.job import JobError

    try:
        return capture_graph(job, warn=lambda line: print(f"[{name}] {line}", flush=True))
    except JobError:
        raise
    except Exception as e:  # noqa: BLE001 (this machine's memory: reported; the trainer tries again)
        print(f"[{name}] could not capture the model's graph: {type(e).__name__}: {e}", flush=True)
        return None


def main(argv: list[str] | None = None) -> int:
    """Run a worker; the process ends here with its exit status (see `_exit`)."""
    _exit(_main(argv))
    return 0  # not reached


def _exit(code: int) -> None:
    """End the process now. An epoch abandoned mid-collective leaves gloo threads with an op that will
    never complete; at a normal interpreter exit their C++ destructors call std::terminate (seen:
    exit -6, "terminate called without an active exception", after `ctl stop`). Everything worth
    keeping is written and flushed by then, so the process ends without running those destructors."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _main(argv: list[str] | None) -> int:
    cfg = parse_args(argv)
    faulthandler.enable(all_threads=True)  # a native crash (torch, gloo, zmq) leaves its stacks in the log
    from worker import collector
    from worker.heap import keep_freed_memory

    collector.pause()  # no cyclic collections while start-up builds its objects (worker.collector)

    keep_freed_memory()  # before torch allocates: a step's freed memory serves the next (worker.heap)
    import torch  # after argument parsing: --help stays fast
    import torch._dynamo  # noqa: F401  (part of torch's import cost: the first optimizer pulls it in)

    from worker.agent import Agent, FatalError
    from worker.calibrate import calibrate
    from worker.checkpoint import check_writable
    from worker.failure import describe
    from worker.job import JobError, load_job
    from worker.trainer import Trainer, TrainerConfig

    torch.set_num_threads(cfg.threads)
    if cfg.device.startswith("cuda") and not torch.cuda.is_available():
        print(f"worker: --device {cfg.device} but torch sees no CUDA device", file=sys.stderr)
        return 2
    calibration = calibrate(cfg.device, memory_limit_gib=cfg.memory_limit_gib)
    if cfg.host is not None:
        calibration = dataclasses.replace(calibration, host=cfg.host)
    agent = Agent(cfg.join, cfg.name, calibration, slowdown=cfg.slowdown, keys=cfg.keys)
    trainer: Trainer | None = None
    preempted = False

    def on_sigterm(signum: int, frame: FrameType | None) -> None:
        # A spot preemption notice: ask to be planned out; the trainer leaves at the step boundary.
        nonlocal preempted
        preempted = True
        if trainer is not None:
            trainer.leave_reason = "preempted"
        agent.send(Leave(name=cfg.name, reason="preempted"))

    signal.signal(signal.SIGTERM, on_sigterm)
    agent.start()
    keys = f"CURVE key {cfg.keys.path}" if cfg.keys is not None else "no keys"
    print(f"[{cfg.name}] joining {cfg.join} ({calibration.flops / 1e9:.1f} GFLOP/s, "
          f"{calibration.memory_bytes / 2**30:.1f} GiB; protocol v{PROTOCOL_VERSION}, {keys})", flush=True)
    try:
        welcome = agent.wait_welcome(cfg.connect_timeout_s)
        if hashlib.sha256(welcome.job_source.encode()).hexdigest() != welcome.job_sha256:
            raise JobError("the job source arrived damaged (sha256 mismatch)")
        job = load_job(welcome.job_source, welcome.job_name, filename=welcome.job_ref.rpartition(":")[0] or welcome.job_ref)
        trainer = Trainer(job, agent, cfg.join, TrainerConfig(group_timeout_s=cfg.group_timeout_s,
                                                              delta_timeout_s=cfg.coordinator_timeout_s,
                                                              digest_every=cfg.digest_every,
                                                              log_every=cfg.log_every, device=cfg.device,
                                                              keys=cfg.keys, trace_path=cfg.trace_steps,
                                                              pause_at=cfg.pause_at,
                                                              final_dir=welcome.final_dir,
                                                              checkpoint_dir=welcome.checkpoint_dir,
                                                              checkpoint_every=welcome.checkpoint_every,
                                                              checkpoint_keep=welcome.checkpoint_keep,
                                                              job_sha256=welcome.job_sha256))
        if welcome.checkpoint_dir:  # said now, before any work is planned here, not at the first write
            try:
                check_writable(welcome.checkpoint_dir)
            except OSError as e:
                why = f"cannot write the checkpoint dir {welcome.checkpoint_dir}: {e.strerror or e}"
                print(f"worker: {why} (give every worker write access to the coordinator's --checkpoint-dir)",
                      file=sys.stderr)
                agent.say_goodbye(Leave(name=cfg.name, reason=why[:500]))  # (waits for its answer)
                agent.close()
                return 2
        if preempted:  # SIGTERM while loading: we were never planned in, so just go
            agent.close()
            return 0
        graph = capture(cfg.name, job)
        if graph is not None:
            trainer.use_graph(graph)
            if welcome.want_graph:
                agent.send(GraphUpload(name=cfg.name, graph=graph.to_dict()))
        collector.settle()  # what start-up built is long-lived: out of the collector's way
        agent.mark_ready()
        outcome = trainer.run()
    except (FatalError, TimeoutError) as e:
        print(f"worker: {e}", file=sys.stderr)
        agent.close()
        return 2
    except JobError as e:
        print(f"worker: {e}", file=sys.stderr)
        agent.close()
        return 1
    except Exception as e:  # the job's own code failed mid-training: its traceback, then leave cleanly
        failure = describe(e, trainer.step if trainer is not None else 0)
        print(failure.report, file=sys.stderr, flush=True)
        agent.say_goodbye(Leave(name=cfg.name, reason=f"error: {failure.error}"[:500], error=failure.error,
                                where=failure.where[:300]))
        agent.close()
        return 1
    print(f"[{cfg.name}] done: {outcome} at step {trainer.step}", flush=True)
    agent.close()
    return 0
