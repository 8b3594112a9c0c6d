"""`GenerateRequest`: the one internal shape of a generation call, and its normalization.

The Engine API, the native HTTP route and the OpenAI adapters all build a `GenerateRequest`.
`normalize()` validates it and expands batches (lists of prompts) and `n > 1` into
`SingleRequest`s, one per sequence to generate. Validation against the model (prompt length vs
context, token ids vs vocabulary) happens in `validate_single`, once the prompt is tokenized.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from arborlm.errors import InvalidRequestError
from arborlm.runtime.request_limits import (
    INT32_MAX,
    INT32_MIN,
    MAX_ID_CHARS,
    MAX_TOKEN_IDS_LOGPROB,
    SEED_MAX,
    SEED_MIN,
    check_int,
    check_text,
)
from arborlm.runtime.sampling_params import SamplingParams

MAX_TOP_LOGPROBS = 64
MAX_BATCH = 4096


@dataclass
class SingleRequest:
    rid: str
    text: str | None
    input_ids: list[int] | None
    sampling_params: SamplingParams
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    token_ids_logprob: list[int] | None = None
    return_text_in_logprobs: bool = False
    stream: bool = False
    extra_key: str | None = None
    priority: int = 0
    index: int = 0  # position in the caller's batch (after n-expansion)


@dataclass
class GenerateRequest:
    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    rid: str | list[str] | None = None
    return_logprob: bool | list[bool] = False
    logprob_start_len: int | list[int] = -1
    top_logprobs_num: int | list[int] = 0
    token_ids_logprob: list[int] | list[list[int]] | None = None
    return_text_in_logprobs: bool = False
    stream: bool = False
    priority: int | None = None
    extra_key: str | list[str] | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def is_batch(self) -> bool:
        if self.text is not None:
            return isinstance(self.text, list)
        return bool(self.input_ids) and isinstance(self.input_ids[0], list)

    def normalize(self) -> list[SingleRequest]:
        """Validate and expand into one `SingleRequest` per generated sequence."""
        if (self.text is None) == (self.input_ids is None):
            raise InvalidRequestError("exactly one of text / input_ids must be given", "text")
        prompts = self._prompts()
        n_prompts = len(prompts)
        if n_prompts == 0:
            raise InvalidRequestError("the batch of prompts is empty", "text")
        if n_prompts > MAX_BATCH:
            raise InvalidRequestError(f"at most {MAX_BATCH} prompts per request", "text")
        params = _per_prompt(self.sampling_params, n_prompts, "sampling_params", {})
        rids = _per_prompt(self.rid, n_prompts, "rid", None)
        for rid in rids:
            if rid is not None:
                check_text(rid, "rid", MAX_ID_CHARS)
        if self.priority is not None:
            check_int(self.priority, "priority", INT32_MIN, INT32_MAX)
        if self.rid is not None and len(set(r for r in rids if r is not None)) != len(rids):
            raise InvalidRequestError("duplicate rid in one batch", "rid")
        out: list[SingleRequest] = []
        for i, prompt in enumerate(prompts):
            sp = SamplingParams.from_dict(params[i])
            base = rids[i] or uuid.uuid4().hex
            for j in range(sp.n):
                seed = sp.sampling_seed
                copy = sp.clone(n=1, sampling_seed=None if seed is None else _seed_plus(seed, j))
                out.append(self._single(i, n_prompts, prompt, copy,
                                        base if sp.n == 1 else f"{base}-{j}", len(out)))
        return out

    def _prompts(self) -> list[Any]:
        if self.text is not None:
            texts = self.text if isinstance(self.text, list) else [self.text]
            if not all(isinstance(t, str) for t in texts):
                raise InvalidRequestError("text must be a string or a list of strings", "text")
            for text in texts:
                check_text(text, "text")
            return texts
        ids = self.input_ids
        if not isinstance(ids, list):
            raise InvalidRequestError("input_ids must be a list of token ids", "input_ids")
        batch = ids if ids and isinstance(ids[0], list) else [ids]
        for row in batch:
            if not isinstance(row, list) or not all(
                    isinstance(t, int) and not isinstance(t, bool) for t in row):
                raise InvalidRequestError("input_ids must hold integer token ids", "input_ids")
            for t in row:
                check_int(t, "input_ids", 0, INT32_MAX, "token ids")
        return batch

    def _single(self, i: int, n: int, prompt: Any, sp: SamplingParams, rid: str,
                index: int) -> SingleRequest:
        """Prompt `i` of `n` with its per-prompt options."""
        rl = _per_prompt(self.return_logprob, n, "return_logprob", False)[i]
        start = _per_prompt(self.logprob_start_len, n, "logprob_start_len", -1)[i]
        top = _per_prompt(self.top_logprobs_num, n, "top_logprobs_num", 0)[i]
        ids_lp = _per_prompt(self.token_ids_logprob, n, "token_ids_logprob", None, nested=True)[i]
        check_int(top, "top_logprobs_num", 0, MAX_TOP_LOGPROBS)
        check_int(start, "logprob_start_len", -1, INT32_MAX, ">= -1")
        if ids_lp is not None:
            if not isinstance(ids_lp, list) or len(ids_lp) > MAX_TOKEN_IDS_LOGPROB:
                raise InvalidRequestError(
                    f"token_ids_logprob must be a list of at most {MAX_TOKEN_IDS_LOGPROB} token "
                    "ids", "token_ids_logprob")
            for t in ids_lp:
                check_int(t, "token_ids_logprob", 0, INT32_MAX, "token ids")
        extra_key = _per_prompt(self.extra_key, n, "extra_key", None)[i]
        if extra_key is not None:
            check_text(extra_key, "extra_key", MAX_ID_CHARS)
        return SingleRequest(
            rid=rid,
            text=prompt if isinstance(prompt, str) else None,
            input_ids=None if isinstance(prompt, str) else list(prompt),
            sampling_params=sp,
            return_logprob=bool(rl),
            logprob_start_len=start,
            top_logprobs_num=top,
            token_ids_logprob=list(ids_lp) if ids_lp else None,
            return_text_in_logprobs=self.return_text_in_logprobs,
            stream=self.stream,
            extra_key=extra_key,
            priority=self.priority or 0,
            index=index,
        )


def _seed_plus(seed: int, j: int) -> int:
    """Sequence j's seed: `seed + j`, wrapped into the signed 64-bit range of seeds."""
    span = SEED_MAX - SEED_MIN + 1
    return (seed + j - SEED_MIN) % span + SEED_MIN


def _per_prompt(value: Any, n: int, name: str, default: Any, nested: bool = False) -> list[Any]:
    """A field given once for every prompt, or as a list with one entry per prompt.

    With `nested`, the field's own value is a list (token_ids_logprob), so only a list of lists
    counts as per-prompt.
    """
    if value is None:
        return [default] * n
    per_prompt = isinstance(value, list) and (not nested or (value and isinstance(value[0], list)))
    if not per_prompt:
        return [value] * n
    if len(value) != n:
        raise InvalidRequestError(f"{name} has {len(value)} entries for {n} prompts", name)
    return list(value)


def validate_single(req: SingleRequest, input_ids: list[int], *, context_length: int,
                    max_total_tokens: int, vocab_size: int) -> None:
    """Checks that need the tokenized prompt and the model's limits."""
    n = len(input_ids)
    if n == 0 or req.text == "":
        raise InvalidRequestError("the prompt is empty", "text" if req.text is not None
                                  else "input_ids")
    if any(t < 0 or t >= vocab_size for t in input_ids):
        raise InvalidRequestError(f"input_ids must be in [0, {vocab_size})", "input_ids")
    if n >= context_length:
        raise InvalidRequestError(
            f"the prompt has {n} tokens, longer than the model's context length "
            f"({context_length} tokens, which must also hold at least one generated token)",
            "text" if req.text is not None else "input_ids")
    # Like vLLM, generation stops at the context length (finish reason `length`).
    sp = req.sampling_params
    sp.max_new_tokens = min(sp.max_new_tokens, context_length - n)
    sp.min_new_tokens = min(sp.min_new_tokens, sp.max_new_tokens)
    if n + 1 > max_total_tokens:
        raise InvalidRequestError(
            f"the prompt has {n} tokens but the KV cache holds only {max_total_tokens}",
            "text" if req.text is not None else "input_ids")
    if req.logprob_start_len >= n:
        raise InvalidRequestError(
            f"logprob_start_len ({req.logprob_start_len}) must be below the prompt length ({n})",
            "logprob_start_len")
    req.sampling_params.validate(vocab_size)
    if req.token_ids_logprob and any(not 0 <= t < vocab_size for t in req.token_ids_logprob):
        raise InvalidRequestError(f"token_ids_logprob must be in [0, {vocab_size})",
                                  "token_ids_logprob")


def prepare_request(req: GenerateRequest, tokenizer: Any, *, context_length: int,
                    max_total_tokens: int,
                    vocab_size: int) -> list[tuple[SingleRequest, list[int]]]:
    """Normalize, tokenize and validate every sequence; raises before anything is queued."""
    from arborlm.runtime.tokenizer_utils import encode

    out = []
    for single in req.normalize():
        ids = single.input_ids if single.input_ids is not None else encode(tokenizer, single.text)
        validate_single(single, ids, context_length=context_length,
                        max_total_tokens=max_total_tokens, vocab_size=vocab_size)
        out.append((single, ids))
    return out
