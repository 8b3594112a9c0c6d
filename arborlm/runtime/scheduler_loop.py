"""`drive_scheduler`: the loop that runs a `Scheduler`, the same in both engine modes.

    take in what has arrived (waiting only while the scheduler is idle) → stop if asked
    → step → hand the step's reports out → check integrity when idle (`debug_integrity`)
    → after-step work (control replies)

The in-process client runs it on its scheduler thread (in: the callers' queue of commands;
out: each report to its request's `ResponseBuilder`); the scheduler process runs it behind
ZeroMQ (in: request, abort and control messages; out: one `BatchTokenOutput` per step, then
the control replies, so that they see the step's effect). How messages come in and go out is
the caller's: this module knows no sockets, threads or response formats. An exception ends the
loop and propagates, since each mode has its own policy for a scheduler that failed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from arborlm.runtime.scheduler.outputs import ReqOutput
    from arborlm.runtime.scheduler.scheduler import Scheduler


def drive_scheduler(scheduler: Scheduler, *, receive: Callable[[bool], bool],
                    emit: Callable[[list[ReqOutput]], None], stopped: Callable[[], bool],
                    after_step: Callable[[], None] | None = None,
                    debug_integrity: bool = False) -> None:
    """Run `scheduler` until `stopped()`.

    `receive(block)` takes in and applies what has arrived (requests, aborts, commands) and
    returns whether anything did; with `block` (the scheduler is idle) it waits for the first
    item, for as long as it chooses. An idle scheduler whose wait ended empty-handed is not
    stepped, only told it idles (`Scheduler.idle`: tensor-parallel rank 0's keep-alive).
    `emit(outputs)` gets every step's reports, `after_step()` runs after each step.
    """
    while not stopped():
        idle = scheduler.is_idle
        if not receive(idle) and idle:
            scheduler.idle()
            continue
        if stopped():
            break
        emit(scheduler.step())
        if debug_integrity and scheduler.is_idle:
            scheduler.check_integrity()
        if after_step is not None:
            after_step()
