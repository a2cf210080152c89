"""The worker's side of the protocol, without I/O: what the coordinator has said, and what to answer.

One object (in the manner of h11) holds the worker's view of the conversation: the welcome, plan
deltas (newest last: a planned one waits for the step boundary, an aborting one supersedes every
older epoch at once), the highest aborted epoch, `Stop`, fencing, `ctl save` and `ctl checkpoint`
requests, and a fatal refusal. `receive(msg, now)` folds in one message from the coordinator and
returns the messages to send back; `join()`, `heartbeat()` and `sent()` make and record what the
worker says of its own accord. No socket, no thread, no clock (`now` is passed in, monotonic):
the worker's agent drives it from its socket thread, and the protocol fuzzer and the planner's
latency benchmark drive the same object for their simulated workers.

The rules it keeps:

* fencing (`ERR_STALE_EPOCH`: the coordinator no longer counts this worker as a member) drops the
  plans of the old membership and joins again (then says Ready, if the worker was ready); answers to
  heartbeats sent before that Join landed (within REJOIN_GRACE_S) are not news;
* a restarted coordinator answers its plan's members with `ERR_REJOIN`: register again with the
  epoch and step, and once welcomed send again every step report after its `last_step`;
* `ERR_BUSY` before the welcome: join again after JOIN_RETRY_S;
* an `Error` before the welcome, or a control socket's `ControlReply` (the wrong endpoint), is
  fatal, with a sentence saying why;
* once the final `Leave` is sent (`leaving()`), fencing no longer re-joins, and the `Stop` that
  answers it is the goodbye.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field, replace

from transport.codec import CodecError, decode
from transport.messages import (
    ERR_BUSY,
    ERR_REJOIN,
    ERR_STALE_EPOCH,
    PLANNED_EXITS,
    Abort,
    CheckpointNow,
    ControlReply,
    Error,
    Heartbeat,
    Join,
    Message,
    PlanDelta,
    Ready,
    SaveModel,
    Slowdown,
    StepReport,
    Stop,
    Welcome,
)

JOIN_RETRY_S = 1.0
REJOIN_GRACE_S = 1.0  # stale-epoch answers this soon after a Join are echoes of older heartbeats
REPORTS_KEPT = 10_000  # step reports kept for a coordinator that restarts (it logs those it has not seen)
IGNORED_LOGGED = 5  # the first unusable frames are logged, then one in a thousand


@dataclass(slots=True)
class WorkerSide:
    """The conversation of the worker named in `join` (whose epoch and step are filled in when sent)."""

    join_template: Join
    endpoint: str = ""
    epoch: int = 0  # what heartbeats and joins report (the trainer's)
    step: int = 0
    ready: bool = False  # the trainer is built: (re)joins announce Ready at once
    gone: bool = False  # the final Leave was sent
    slowdown: float = 1.0  # the test knob the coordinator sets (`Slowdown`)
    welcome: Welcome | None = None
    deltas: list[PlanDelta] = field(default_factory=list)
    aborted_epoch: int = 0  # every epoch <= this one is abandoned
    stop: str | None = None
    goodbye_answered: bool = False  # a Stop came after the final Leave was sent
    fenced: bool = False
    fatal: str | None = None
    joined_at: float = 0.0  # of the last Join made
    retry_join_at: float | None = None  # the coordinator was busy: join again then
    saves: list[str] = field(default_factory=list)  # `ctl save` paths to write at the next step boundary
    checkpoints: int = 0  # `ctl checkpoint` requests (or the coordinator's SIGTERM) not taken yet
    rejoining: bool = False  # registering again with a restarted coordinator
    rejoined_at: float = 0.0
    ignored: int = 0  # frames from the coordinator that could not be used
    reports: deque[StepReport] = field(default_factory=lambda: deque(maxlen=REPORTS_KEPT))
    logs: list[str] = field(default_factory=list)  # lines for the worker's log, taken by `take_logs`

    @property
    def name(self) -> str:
        return self.join_template.name

    # --- what the worker says ------------------------------------------------------------------

    def join(self, now: float) -> Join:
        self.joined_at = now
        return replace(self.join_template, epoch=self.epoch, step=self.step)

    def heartbeat(self) -> Heartbeat:
        return Heartbeat(name=self.name, epoch=self.epoch, step=self.step)

    def sent(self, msg: Message) -> None:
        """Record what went out: step reports are kept for a coordinator that restarts."""
        if isinstance(msg, StepReport):
            self.reports.append(msg)

    def leaving(self) -> None:
        """The final Leave goes out: from now on no re-join, and the next Stop is the goodbye."""
        self.gone = True

    def join_due(self, now: float) -> Join | None:
        """The Join again, when a busy coordinator asked for a retry and its time has come."""
        if self.retry_join_at is None or now < self.retry_join_at:
            return None
        self.retry_join_at = None
        return self.join(now)

    # --- what the coordinator says -------------------------------------------------------------

    def receive_frame(self, frame: bytes, now: float) -> list[Message]:
        try:
            msg = decode(frame)
        except CodecError as e:
            self._ignore(f"an undecodable frame from the coordinator: {e}")
            return []
        return self.receive(msg, now)

    def receive(self, msg: Message, now: float) -> list[Message]:
        """Fold in one message from the coordinator; the messages to answer with, in order."""
        out: list[Message] = []
        match msg:
            case Welcome():
                if self.rejoining:  # a restarted coordinator took us back: what it has not logged
                    self.rejoining = False
                    again = [r for r in self.reports if r.step > msg.last_step]
                    out += again
                    self.logs.append(f"registered again with the restarted coordinator; re-sent {len(again)} "
                                     f"step report(s) after step {msg.last_step}")
                self.welcome = msg
            case PlanDelta():
                self.deltas = [d for d in self.deltas if d.epoch < msg.epoch] + [msg]
            case Abort(epoch=epoch):
                self.aborted_epoch = max(self.aborted_epoch, epoch)
            case Slowdown(factor=factor):
                self.logs.append(f"slowdown {factor:g} (compute stretched from the next step)")
                self.slowdown = factor
            case Stop(reason=reason):
                self.stop = reason
                self.goodbye_answered |= self.gone
            case SaveModel(path=path):
                self.saves.append(path)
            case CheckpointNow():
                self.checkpoints += 1
            case Error(code=code, message=text) if code == ERR_STALE_EPOCH:
                # Answers to heartbeats sent before our new Join landed are not news; once gone,
                # the coordinator forgetting us is the point.
                if not self.gone and not self.fenced and now - self.joined_at > REJOIN_GRACE_S:
                    self.logs.append(f"fenced out by the coordinator ({text}); joining again")
                    self.fenced = True
                    self.deltas = []  # plans for the old membership; new ones follow the re-join
                    out += self._join_again(now)
            case Error(code=code, message=text) if code == ERR_REJOIN:
                if not self.gone and now - self.rejoined_at > REJOIN_GRACE_S:
                    self.logs.append(f"{text}: registering again at epoch {self.epoch}, step {self.step}")
                    self.rejoining, self.rejoined_at = True, now
                    out += self._join_again(now)
            case Error(code=code, message=text) if code == ERR_BUSY and self.welcome is None:
                self.logs.append(f"the coordinator is busy ({text}); joining again in {JOIN_RETRY_S:g} s")
                self.retry_join_at = now + JOIN_RETRY_S
            case ControlReply() if self.welcome is None:  # only the control socket sends these
                self.fatal = (f"{self.endpoint} is the coordinator's control endpoint, not its workers endpoint: "
                              "use the `workers=` address of its ready line")
            case Error(code=code, message=text):
                if self.welcome is None:
                    self.fatal = f"the coordinator refused this worker: {text}"
                else:
                    self.logs.append(f"coordinator error {code}: {text}")
            case _:
                self._ignore(f"an unexpected {type(msg).__name__} from the coordinator")
        return out

    def _join_again(self, now: float) -> list[Message]:
        return [self.join(now), *([Ready(name=self.name)] if self.ready else [])]

    def _ignore(self, what: str) -> None:
        """Drop an unusable frame, logging the first few and then one in a thousand (a flood must
        not flood the log)."""
        self.ignored += 1
        if self.ignored <= IGNORED_LOGGED or self.ignored % 1000 == 0:
            self.logs.append(f"ignoring {what} ({self.ignored} so far)")

    def take_logs(self) -> list[str]:
        logs, self.logs = self.logs, []
        return logs

    # --- what the worker asks of it --------------------------------------------------------------

    def superseded(self, epoch: int) -> bool:
        """Whether work of `epoch` must be abandoned now (a failure, fencing, or a stop). A stop that
        lets a planned-out worker go (PLANNED_EXITS) comes once every member has switched at the
        agreed step boundary: the step this worker may still be finishing is that boundary's,
        already done by its peers, so it is finished, not abandoned."""
        if self.fenced or self.aborted_epoch >= epoch or self.fatal is not None:
            return True
        if self.stop is not None and self.stop not in PLANNED_EXITS:
            return True
        return any(d.abort and d.epoch > epoch for d in self.deltas)

    def newest_after(self, epoch: int) -> PlanDelta | None:
        """The newest delta of an epoch after `epoch`, if one arrived."""
        later = [d for d in self.deltas if d.epoch > epoch]
        return later[-1] if later else None

    def pending_planned(self, epoch: int) -> PlanDelta | None:
        """The planned delta waiting for the step boundary, if one newer than `epoch` arrived."""
        newest = self.newest_after(epoch)
        return newest if newest is not None and not newest.abort else None
