"""What the job is doing now, and why: the one answer `ctl status` and `ctl plan [--explain]` give.

`phase(state, min_workers=...) -> Phase(name, reason)` is a pure function of the membership state
(and the one flag that gates the first plan), so the state a person reads and its reason never
disagree between commands, and never lag behind the state: a plan that failed earlier (the
planner's last answer, `State.result`) is not the reason when the state has moved on since. In
particular after a total loss (every worker gone; `replan._nothing_fits`) the epoch stays where it
was but nothing trains: the job waits for workers (with `--min-workers` ready ones before the next
plan, as at the start) and then resumes from the newest checkpoint.

Names, checked in this order:
  finished             some worker ran the last step
  stopping             the workers were told to stop (ctl stop, SIGTERM, a lost state with no checkpoint)
  recovering           a restarted coordinator waits for the journaled plan's members to register again
  resuming             a plan whose members load a checkpoint is not acknowledged by all of them yet
  switching            the latest plan is not acknowledged by all of its members yet
  training             the latest plan is in place everywhere
  waiting_for_fit      no plan: workers that could train exist, but no plan fits them
                       (survivors of a failure keep the state meanwhile)
  waiting_for_workers  no plan: fewer ready workers than a plan needs (`--min-workers`, the members
                       the layout pin in force implies, or none)
"""

from __future__ import annotations

from dataclasses import dataclass

from coordinator.state import State, pin_text, workers_needed

PHASES = ("finished", "stopping", "recovering", "resuming", "switching", "training", "waiting_for_fit",
          "waiting_for_workers")


@dataclass(frozen=True, slots=True)
class Phase:
    name: str  # one of PHASES
    reason: str  # one line for people, beginning with what the name says


def _names(names: list[str] | set[str] | frozenset[str]) -> str:
    shown = sorted(names)
    return ", ".join(shown[:8]) + (f" and {len(shown) - 8} more" if len(shown) > 8 else "")


def phase(state: State, *, min_workers: int = 1) -> Phase:
    """The job's phase and why (see the module's comment)."""
    s = state
    if s.finished:
        return Phase("finished", f"finished: the last step ({s.last_step}) is committed")
    if s.stopping:
        return Phase("stopping", f"stopping: {_names(set(s.workers)) or 'no worker'} told to stop; the coordinator "
                                 "exits once they are gone")
    if s.recovered_plan is not None:
        return Phase("recovering", f"recovering: the coordinator restarted; waiting for {_names(s.recovering)} to "
                                   f"register again (epoch {s.epoch}; they train on meanwhile)")
    plan = s.plan
    if plan is not None:
        waiting = set(plan.members) - s.acked
        if waiting and s.resume is not None:
            return Phase("resuming", f"resuming from checkpoint {s.resume.path} (step {s.resume.step}): epoch "
                                     f"{s.epoch} waits for {_names(waiting)} to load it")
        if waiting:
            return Phase("switching", f"switching to epoch {s.epoch}: waiting for {_names(waiting)} to acknowledge it")
        return Phase("training", f"training: epoch {s.epoch}, {len(plan.members)} member(s)")
    ready = {n for n, w in s.workers.items() if w.ready and w.leaving is None}
    loading = {n for n, w in s.workers.items() if not w.ready}
    holders = s.holders
    if holders:  # survivors of a failure keep the state; min_workers does not hold them back
        why = s.result.reason if s.result is not None and s.result.plan is None else "no plan yet"
        return Phase("waiting_for_fit", f"waiting for a device that fits: {_names(set(holders))} keep(s) the "
                                        f"training state ({why})")
    then = (f"; then resuming from checkpoint {s.resume.path} (step {s.resume.step})" if s.resume is not None
            else "; the training state was lost with no checkpoint: training starts over from step 0"
            if s.epoch > 0 and s.last_step == 0 else "")
    needed = workers_needed(s.layout, min_workers)
    if len(ready) < needed:
        more = f", {len(loading)} loading" if loading else ""
        gate = (f"--min-workers {min_workers}" if needed == max(min_workers, 1)
                else f"the layout pinned to {pin_text(s.layout)} needs {needed}")
        return Phase("waiting_for_workers", f"waiting for workers: {len(ready)} ready{more}, {gate}{then}")
    why = s.result.reason if s.result is not None and s.result.plan is None else "not planned yet"
    return Phase("waiting_for_fit", f"waiting for a device that fits: {len(ready)} ready worker(s), no plan "
                                    f"({why}){then}")
