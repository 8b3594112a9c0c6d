"""The detokenizer process: the scheduler's token ids → text, between the scheduler and the API.

`DetokenizerService(tokenizer_path, addrs)` (entry
`"arborlm.runtime.detokenizer_process:DetokenizerService"`) keeps one `RequestText` per
request (the text stage the in-process `ResponseBuilder` runs too): created from the
`DecodeOptions` in the request's first `BatchTokenOutput` entry, dropped with the entry that
carries its finish reason. It turns each `BatchTokenOutput` into one `BatchTextOutput` holding
cumulative text (stop strings trimmed, incomplete UTF-8 held back, a `stop_regex` match cut at
the end), the new ids, and logprob entries with their token text when
`return_text_in_logprobs`. Streaming requests get an entry per scheduler report (that is what
makes the stream's chunks); the others get one entry when they finish, holding all their ids
and logprobs, so the API process handles one message per request.

Control replies (flush, server info, health) are forwarded tagged with the replica's `dp_rank`
(one tokenizer manager hears every replica's detokenizer), `ErrorOutput`s unchanged; a
`ShutdownReq` is forwarded and ends the loop. An exception while detokenizing one request ends
that request with an `ErrorOutput` and nothing else. This module does not tokenize, sample or
schedule.
"""

from __future__ import annotations

import logging
from typing import Any

import msgspec

from arborlm.runtime.ipc import IpcAddresses
from arborlm.runtime.messages import (
    BatchTextOutput,
    BatchTokenOutput,
    DecodeOptions,
    ErrorOutput,
    FlushCacheResp,
    HealthCheckResp,
    LogprobChunk,
    Message,
    ServerInfoResp,
    ShutdownReq,
)
from arborlm.runtime.process_utils import StopFlag
from arborlm.runtime.request_text import RequestText
from arborlm.runtime.response import LOGPROB_KEYS, NESTED_LOGPROB_KEYS
from arborlm.runtime.tokenizer_utils import load_tokenizer
from arborlm.runtime.zmq_queues import PullQueue, PushQueue, terminate_context

logger = logging.getLogger(__name__)

IDLE_WAIT_S = 1.0  # longest wait for a message before the loop rechecks its stop flag
CLOSE_LINGER_S = 1.0


class _RequestState:
    """One request's text stage plus what it has not sent yet."""

    def __init__(self, tokenizer: Any, opts: DecodeOptions):
        self.opts = opts
        self.stage = RequestText(tokenizer, opts)
        self.unsent_ids: list[int] = []
        self.unsent_logprobs: LogprobChunk | None = None

    def add(self, ids: list[int], reason: dict[str, Any] | None, lp: LogprobChunk | None,
            completion_tokens: int) -> None:
        self.unsent_ids.extend(ids)
        if lp is not None:
            if self.unsent_logprobs is None:
                self.unsent_logprobs = lp
            else:
                for name in LOGPROB_KEYS:
                    getattr(self.unsent_logprobs, name).extend(getattr(lp, name))
        self.stage.add(ids, reason, completion_tokens)

    def take(self) -> tuple[list[int], LogprobChunk | None]:
        ids, lp = self.unsent_ids, self.unsent_logprobs
        self.unsent_ids, self.unsent_logprobs = [], None
        return ids, lp


def _text_batch(batch: BatchTokenOutput, sent: list[tuple[int, _RequestState]]
                ) -> BatchTextOutput:
    """Entries `i` of `batch` with each request's text and what it had not sent yet."""
    unsent = [req.take() for _, req in sent]
    jump = [batch.jump_forward_steps[i] if batch.jump_forward_steps else 0 for i, _ in sent]
    spec = [batch.spec[i] for i, _ in sent] if batch.spec else []
    return BatchTextOutput(
        rids=[batch.rids[i] for i, _ in sent], texts=[req.stage.text for _, req in sent],
        output_ids=[ids for ids, _ in unsent],
        finished_reasons=[batch.finished_reasons[i] for i, _ in sent],
        prompt_tokens=[batch.prompt_tokens[i] for i, _ in sent],
        completion_tokens=[batch.completion_tokens[i] for i, _ in sent],
        cached_tokens=[batch.cached_tokens[i] for i, _ in sent],
        logprobs=[lp for _, lp in unsent],
        matched_stops=[req.stage.matched_stop for _, req in sent],
        jump_forward_steps=jump if any(jump) else [], spec=spec)


class DetokenizerService:
    def __init__(self, tokenizer_path: str, addrs: IpcAddresses, dp_rank: int = 0):
        self.dp_rank = dp_rank
        self.tokenizer = load_tokenizer(tokenizer_path)
        self.recv = PullQueue(addrs.scheduler_to_detokenizer, bind=True)
        self.send = PushQueue(addrs.detokenizer_to_tokenizer, bind=False)
        self.requests: dict[str, _RequestState] = {}
        self.failed: set[str] = set()  # failed here; the scheduler's later reports are dropped
        self._token_texts: dict[int, str] = {}

    def ready_info(self) -> dict[str, Any]:
        return {}

    def run(self, stop: StopFlag) -> None:
        while not stop.is_set():
            first = self.recv.get(timeout=IDLE_WAIT_S)
            if first is None:
                continue
            for msg in [first, *self.recv.get_nowait_all()]:
                self.handle(msg)
                if isinstance(msg, ShutdownReq):
                    stop.set("shutdown requested")
                    break

    def close(self) -> None:
        self.recv.close()
        self.send.close(linger_s=CLOSE_LINGER_S)  # let the last messages (a ShutdownReq) out
        terminate_context()

    def handle(self, msg: Message) -> None:
        """Answer one message from the scheduler (the loop's body)."""
        if isinstance(msg, BatchTokenOutput):
            out = self._detokenize(msg)
            if out.rids:
                self.send.put(out)
            return
        if isinstance(msg, ErrorOutput):
            self.requests.pop(msg.rid, None)
        elif isinstance(msg, FlushCacheResp | ServerInfoResp | HealthCheckResp):
            msg = msgspec.structs.replace(msg, dp_rank=self.dp_rank)
        self.send.put(msg)

    def _detokenize(self, batch: BatchTokenOutput) -> BatchTextOutput:
        """Text for the streaming requests of `batch` and for those it finishes."""
        sent: list[tuple[int, _RequestState]] = []
        for i, rid in enumerate(batch.rids):
            reason = batch.finished_reasons[i]
            try:
                req = self._update(rid, batch.decode_options[i], batch.new_token_ids[i], reason,
                                   batch.logprobs[i], batch.completion_tokens[i])
            except Exception as e:  # noqa: BLE001 - this request fails, the others go on
                logger.exception("detokenizing %s failed", rid)
                self.requests.pop(rid, None)
                self.failed.add(rid)
                self.send.put(ErrorOutput(rid=rid, message=f"detokenizer: {e!r}",
                                          status_code=500))
                req = None
            if reason is not None:
                self.failed.discard(rid)
            if req is not None and (reason is not None or req.opts.stream):
                sent.append((i, req))
        return _text_batch(batch, sent)

    def _update(self, rid: str, opts: DecodeOptions | None, ids: list[int],
                reason: dict[str, Any] | None, lp: LogprobChunk | None,
                completion_tokens: int) -> _RequestState | None:
        if opts is not None:
            self.requests[rid] = _RequestState(self.tokenizer, opts)
        req = self.requests.get(rid)
        if req is None:
            if rid not in self.failed:
                logger.warning("report for unknown request %s dropped", rid)
            return None
        if lp is not None and req.opts.return_text_in_logprobs:
            lp = self._with_texts(lp)
        req.add(ids, reason, lp, completion_tokens)
        if reason is not None:
            del self.requests[rid]
        return req

    def _token_text(self, token_id: int) -> str:
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.tokenizer.decode([token_id])
        return text

    def _with_texts(self, lp: LogprobChunk) -> LogprobChunk:
        def entries(row: list) -> list:
            return [(v, t, self._token_text(t)) for v, t, _ in row]

        return LogprobChunk(**{
            name: [None if row is None else entries(row) for row in getattr(lp, name)]
            if name in NESTED_LOGPROB_KEYS else entries(getattr(lp, name))
            for name in LOGPROB_KEYS})
