"""What the scheduler reports per request after a step, and logprob extraction.

`ReqOutput` carries only what is new since the last report for that request (new token ids and
their logprob entries); input logprobs come once, with the first report after the prompt has
been prefilled. Tokens a semantic guard may still roll back (those of an open value it checks
when the value closes, `GrammarMatcher.held_from`) are held back until that value validates or
the request finishes, so a client never sees text that is taken back. Logprob entries are
`(logprob, token_id)` pairs; the text is added on the detokenizing side when asked for.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from arborlm.runtime.request import Req

LogprobEntry = tuple[float | None, int]


@dataclass
class ReqOutput:
    rid: str
    new_token_ids: list[int]
    finished_reason: dict | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    output_token_logprobs: list[LogprobEntry] = field(default_factory=list)
    output_top_logprobs: list[list[LogprobEntry]] = field(default_factory=list)
    output_token_ids_logprobs: list[list[LogprobEntry]] = field(default_factory=list)
    input_token_logprobs: list[LogprobEntry] | None = None
    input_top_logprobs: list[list[LogprobEntry] | None] | None = None
    input_token_ids_logprobs: list[list[LogprobEntry] | None] | None = None
    jump_forward_steps: int = 0
    # Speculative decoding: verifies of the request's drafts, and the draft tokens accepted.
    spec_verify_ct: int = 0
    spec_accepted_tokens: int = 0


def make_output(req: Req) -> ReqOutput:
    """Report for `req`: what was added since `req.emitted_ids`; advances that counter."""
    start, end = req.emitted_ids, len(req.output_ids)
    if req.grammar is not None and not req.finished:
        held = req.grammar.held_from()
        if held is not None:
            end = max(start, min(end, held))
    new_ids = req.output_ids[start:end]
    out = ReqOutput(
        rid=req.rid,
        new_token_ids=new_ids,
        finished_reason=req.finished_reason.to_json() if req.finished_reason else None,
        prompt_tokens=req.prompt_len,
        completion_tokens=end,
        cached_tokens=req.cached_tokens,
        jump_forward_steps=req.jump_forward_steps,
    )
    if req.spec is not None:
        out.spec_verify_ct = req.spec.stats["verify_ct"]
        out.spec_accepted_tokens = req.spec.stats["accepted"]
    if req.return_logprob:
        out.output_token_logprobs = req.output_token_logprobs[start:end]
        if req.top_logprobs_num:
            out.output_top_logprobs = req.output_top_logprobs[start:end]
        if req.token_ids_logprob:
            out.output_token_ids_logprobs = req.output_token_ids_logprobs[start:end]
        if req.input_logprobs_done and not req.input_logprobs_sent and req.wants_input_logprobs:
            req.input_logprobs_sent = True
            out.input_token_logprobs = req.input_token_logprobs
            out.input_top_logprobs = req.input_top_logprobs if req.top_logprobs_num else []
            out.input_token_ids_logprobs = (req.input_token_ids_logprobs
                                            if req.token_ids_logprob else [])
    req.emitted_ids = end
    return out


def chosen_logprobs(logprobs: torch.Tensor, ids: torch.Tensor) -> list[float]:
    """logprobs `[N, V]`, ids `[N]` -> the logprob of each chosen id."""
    return logprobs.gather(1, ids[:, None])[:, 0].tolist()


def top_logprobs(logprobs: torch.Tensor, k: int) -> list[list[LogprobEntry]]:
    values, idx = torch.topk(logprobs, k, dim=-1)
    return [list(zip(v, i)) for v, i in zip(values.tolist(), idx.tolist())]


def ids_logprobs(logprobs: torch.Tensor, ids: list[int]) -> list[list[LogprobEntry]]:
    t = torch.tensor(ids, dtype=torch.int64)
    vals = logprobs[:, t].tolist()
    return [list(zip(v, ids)) for v in vals]
