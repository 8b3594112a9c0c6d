"""The scheduler process: the same `Scheduler` the in-process engine runs, behind ZeroMQ.

`SchedulerService(args, addrs)` (started by `process_utils.spawn_child` with the entry
`"arborlm.runtime.scheduler_process:SchedulerService"`) loads the model, binds the
tokenizer-to-scheduler socket and runs `drive_scheduler` (the in-process client's loop too):

    receive messages (block only when idle) → add requests / aborts → scheduler.step()
    → one BatchTokenOutput for the step's reports → answer control requests

Control requests (flush, server info, health, shutdown) are answered after the step, so they see
the effect of the aborts received with them: an aborted request is released by that step.
`server_info` adds `integrity_ok` / `integrity`: the result of `Scheduler.check_integrity()`
when the scheduler is idle (False with the reason while requests are pending).

Failure policy: an exception while adding one request ends that request with an `ErrorOutput`
(400 for invalid requests, 500 otherwise) and nothing else. Inside `step()`, the scheduler's
per-request guards end a request whose own work fails with an abort (500) and go on (see
`Scheduler`); any other exception there leaves the scheduler's state unknown, so it ends the
process; `process_utils` reports the error to the parent, which fails every pending call with it.

This is tensor-parallel rank 0: it owns the sockets. With `tp_size` > 1 its model runner starts
the other ranks and broadcasts each batch to them over torch.distributed (`runtime/distributed/`);
a rank that dies fails the step, which ends this process like any other scheduler failure. This
module does not tokenize, detokenize, or know about HTTP.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

from arborlm.errors import InvalidRequestError
from arborlm.runtime import startup
from arborlm.runtime.config import EngineArgs
from arborlm.runtime.ipc import IpcAddresses
from arborlm.runtime.messages import (
    AbortReq,
    BatchTokenizedGenerateReq,
    BatchTokenOutput,
    DecodeOptions,
    ErrorOutput,
    FlushCacheReq,
    FlushCacheResp,
    GetServerInfoReq,
    HealthCheckReq,
    HealthCheckResp,
    LogprobChunk,
    Message,
    ServerInfoResp,
    ShutdownReq,
    TokenizedGenerateReq,
)
from arborlm.runtime.platforms.cpu import kernels as cpu_kernels
from arborlm.runtime.process_utils import StopFlag
from arborlm.runtime.request import Req
from arborlm.runtime.request_text import decode_options
from arborlm.runtime.sampling_params import SamplingParams
from arborlm.runtime.scheduler.outputs import ReqOutput
from arborlm.runtime.scheduler.scheduler import Scheduler
from arborlm.runtime.scheduler_loop import drive_scheduler
from arborlm.runtime.tokenizer_utils import load_tokenizer
from arborlm.runtime.zmq_queues import PullQueue, PushQueue, terminate_context

logger = logging.getLogger(__name__)

# Longest wait for a message while idle; the loop then rechecks its stop flag.
IDLE_WAIT_S = 1.0
CLOSE_LINGER_S = 1.0
_CONTROL = (FlushCacheReq, GetServerInfoReq, HealthCheckReq, ShutdownReq)


@dataclass
class _Live:
    """What the process remembers about a request it is serving."""

    options: DecodeOptions | None  # sent with the request's first output, then None
    return_logprob: bool


class SchedulerService:
    def __init__(self, args: EngineArgs, addrs: IpcAddresses):
        config = args.resolve()
        if args.device == "cpu":
            startup.phase("compiling kernels")
            cpu_kernels.build()  # here, so that a slow or failed build shows as its own phase
        startup.phase("loading weights")
        self.scheduler = Scheduler(config, load_tokenizer(config.tokenizer_path))
        self.debug_integrity = args.debug_integrity
        self.recv = PullQueue(addrs.tokenizer_to_scheduler, bind=True)
        self.send = PushQueue(addrs.scheduler_to_detokenizer, bind=False)
        self.live: dict[str, _Live] = {}
        self.shutdown_requested = False

    def ready_info(self) -> dict[str, Any]:
        return {"max_total_tokens": self.scheduler.max_total_tokens, "pid": os.getpid()}

    def run(self, stop: StopFlag) -> None:
        control: list[Message] = []  # received with this step's input, answered after the step

        def receive(block: bool) -> bool:
            msgs = self._receive(block)
            control[:] = self._handle(msgs)
            return bool(msgs)

        def after_step() -> None:
            for msg in control:
                self._answer(msg)
            if self.shutdown_requested:
                self.send.put(ShutdownReq())
                stop.set("shutdown requested")

        drive_scheduler(self.scheduler, receive=receive, emit=self._send_outputs,
                        stopped=stop.is_set, after_step=after_step,
                        debug_integrity=self.debug_integrity)

    def close(self) -> None:
        self.scheduler.close()
        self.recv.close()
        self.send.close(linger_s=CLOSE_LINGER_S)  # let the last messages (a ShutdownReq) out
        terminate_context()

    # --- input --------------------------------------------------------------------------------

    def _receive(self, block: bool) -> list[Message]:
        if block:
            first = self.recv.get(timeout=IDLE_WAIT_S)
            return [] if first is None else [first, *self.recv.get_nowait_all()]
        return self.recv.get_nowait_all()

    def _handle(self, msgs: list[Message]) -> list[Message]:
        """Add requests and apply aborts now; return the control requests for after the step."""
        control = []
        for msg in msgs:
            if isinstance(msg, TokenizedGenerateReq):
                self._add(msg)
            elif isinstance(msg, BatchTokenizedGenerateReq):
                for req in msg.reqs:
                    self._add(req)
            elif isinstance(msg, AbortReq):
                self.scheduler.abort(msg.rid, msg.abort_all)
            elif isinstance(msg, _CONTROL):
                control.append(msg)
            else:
                logger.warning("scheduler ignores unexpected %s", type(msg).__name__)
        return control

    def _add(self, msg: TokenizedGenerateReq) -> None:
        try:
            params = SamplingParams.from_dict(msg.sampling_params)
            req = Req(msg.rid, msg.input_ids, params, return_logprob=msg.return_logprob,
                      logprob_start_len=msg.logprob_start_len,
                      top_logprobs_num=msg.top_logprobs_num,
                      token_ids_logprob=msg.token_ids_logprob, extra_key=msg.extra_key,
                      seed=msg.seed or 0, priority=msg.priority, stream=msg.stream)
            options = decode_options(params, msg.input_ids, stream=msg.stream,
                                     return_text_in_logprobs=msg.return_text_in_logprobs)
            self.live[msg.rid] = _Live(options, msg.return_logprob)
            self.scheduler.add_request(req)
        except Exception as e:  # noqa: BLE001 - this request fails, the others go on
            self.live.pop(msg.rid, None)
            logger.warning("request %s failed when added: %r", msg.rid, e)
            invalid = isinstance(e, InvalidRequestError)
            text = str(e) if invalid else f"{type(e).__name__}: {e}"
            self.send.put(ErrorOutput(rid=msg.rid, message=text,
                                      status_code=400 if invalid else 500,
                                      param=e.param if invalid else None))

    # --- output -------------------------------------------------------------------------------

    def _send_outputs(self, outputs: list[ReqOutput]) -> None:
        """One `BatchTokenOutput` for the step; a request's first entry carries its options."""
        entries = []
        for out in outputs:
            live = self.live.get(out.rid)
            if live is None:
                logger.warning("report for unknown request %s dropped", out.rid)
                continue
            options, live.options = live.options, None
            entries.append((out, options, _logprob_chunk(out) if live.return_logprob else None))
            if out.finished_reason is not None:
                del self.live[out.rid]
        if entries:
            self.send.put(_token_batch(entries))

    def _answer(self, msg: Message) -> None:
        if isinstance(msg, FlushCacheReq):
            ok, text = self.scheduler.flush_cache()
            self.send.put(FlushCacheResp(ok=ok, message=text))
        elif isinstance(msg, GetServerInfoReq):
            ok, text = self._integrity()
            info = {**self.scheduler.server_info(), "integrity_ok": ok, "integrity": text}
            self.send.put(ServerInfoResp(info=info))
        elif isinstance(msg, HealthCheckReq):
            self.send.put(HealthCheckResp(ok=True))
        elif isinstance(msg, ShutdownReq):
            self.shutdown_requested = True

    def _integrity(self) -> tuple[bool, str]:
        if not self.scheduler.is_idle:
            running, waiting = self.scheduler.num_requests()
            return False, (f"not checked: requests are pending ({running} running, "
                           f"{waiting} waiting)")
        try:
            self.scheduler.check_integrity()
        except AssertionError as e:
            return False, str(e) or "integrity check failed"
        return True, "ok"


def _token_batch(entries: list[tuple[ReqOutput, DecodeOptions | None, LogprobChunk | None]]
                 ) -> BatchTokenOutput:
    outs = [out for out, _, _ in entries]
    jump = [o.jump_forward_steps for o in outs]
    spec = [(o.spec_verify_ct, o.spec_accepted_tokens) for o in outs]
    return BatchTokenOutput(
        rids=[o.rid for o in outs], new_token_ids=[o.new_token_ids for o in outs],
        finished_reasons=[o.finished_reason for o in outs],
        prompt_tokens=[o.prompt_tokens for o in outs],
        completion_tokens=[o.completion_tokens for o in outs],
        cached_tokens=[o.cached_tokens for o in outs],
        decode_options=[options for _, options, _ in entries],
        logprobs=[lp for _, _, lp in entries], jump_forward_steps=jump if any(jump) else [],
        spec=spec if any(v for v, _ in spec) else [])


def _entries(pairs: list) -> list:
    return [(lp, tid, None) for lp, tid in pairs]


def _rows(rows: list) -> list:
    return [None if row is None else _entries(row) for row in rows]


def _logprob_chunk(out: ReqOutput) -> LogprobChunk:
    """A report's (logprob, id) pairs as message entries (the text is the detokenizer's job)."""
    return LogprobChunk(
        output_token_logprobs=_entries(out.output_token_logprobs),
        output_top_logprobs=_rows(out.output_top_logprobs),
        output_token_ids_logprobs=_rows(out.output_token_ids_logprobs),
        input_token_logprobs=_entries(out.input_token_logprobs or []),
        input_top_logprobs=_rows(out.input_top_logprobs or []),
        input_token_ids_logprobs=_rows(out.input_token_ids_logprobs or []))
