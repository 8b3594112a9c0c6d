"""`select` on each backend: decisions of all three methods against logprobs computed by hand
from full-prompt scoring requests (every input logprob from position 0)."""

from __future__ import annotations

import pytest

import arborlm.lang as sgl
from tests.lang.conftest import GREEDY

PROMPT = "Question: is the sky blue?\nAnswer:"
CHOICES = [" yes", " yes indeed", " no", " perhaps not"]


def choice_logprobs(backend, context_ids: list[int], full_ids: list[int]) -> list[float]:
    """Logprobs of the tokens of `full_ids` after its common prefix with `context_ids`, from a
    request that scores the whole sequence (its first entry is the null one)."""
    out = backend.request({"input_ids": full_ids, "sampling_params": {"max_new_tokens": 0},
                           "return_logprob": True, "logprob_start_len": 0})
    entries = out["meta_info"]["input_token_logprobs"]
    assert entries[0][0] is None and len(entries) == len(full_ids)
    start = 0
    while start < len(context_ids) and context_ids[start] == full_ids[start]:
        start += 1
    return [e[0] for e in entries[start:]]


def by_hand(backend, method: str) -> tuple[str, list[float]]:
    """The decision and per-choice scores, computed from scratch."""
    prompt_ids, *rows = backend.tokenize([PROMPT] + [PROMPT + c for c in CHOICES])
    cond = [choice_logprobs(backend, prompt_ids, row) for row in rows]
    if method == "token_length_normalized":
        scores = [sum(c) / len(c) for c in cond]
    elif method == "unconditional_likelihood_normalized":
        bos = backend.tokenize([""])[0]
        scores = []
        for c, row in zip(cond, rows):
            tokens = row[len(row) - len(c):]
            u = choice_logprobs(backend, bos, bos + tokens)
            scores.append(sum(a - b for a, b in zip(c, u)) / len(c))
    else:  # greedy_token_selection: first position where one choice is strictly best
        width = max(len(c) for c in cond)
        padded = [c + [sum(c) / len(c)] * (width - len(c)) for c in cond]
        alive = list(range(len(CHOICES)))
        for j in range(width):
            best = max(padded[i][j] for i in alive)
            alive = [i for i in alive if padded[i][j] > best - 1e-4]
            if len(alive) == 1:
                break
        return CHOICES[alive[0]], [sum(c) / len(c) for c in cond]
    return CHOICES[max(range(len(scores)), key=scores.__getitem__)], scores


@sgl.function
def pick(s, method):
    s += PROMPT
    s += sgl.select("answer", choices=CHOICES, choices_method=method)


@pytest.mark.parametrize("method", ["token_length_normalized", "greedy_token_selection",
                                    "unconditional_likelihood_normalized"])
def test_select_matches_hand_computed_logprobs(backend, method):
    state = pick.run(getattr(sgl, method), backend=backend, **GREEDY)
    decision, scores = by_hand(backend, method)
    assert state["answer"] == decision
    assert state.text() == PROMPT + decision
    meta = state.get_meta_info("answer")
    key = ("normalized_unconditional_prompt_logprobs"
           if method == "unconditional_likelihood_normalized" else "normalized_prompt_logprobs")
    assert meta[key] == pytest.approx(scores, abs=1e-3)
    # Exactly each choice's own tokens are scored (tokenize adds a BOS to each alone).
    assert [len(e) for e in meta["input_token_logprobs"]] == \
        [len(t) - 1 for t in backend.tokenize(CHOICES)]


def test_select_in_a_chat_turn_and_choice_order(backend):
    @sgl.function
    def quiz(s):
        s += sgl.user("Pick a colour.")
        s += sgl.assistant(sgl.select("colour", choices=["red", "green", "blue"]))

    state = quiz.run(backend=backend)
    assert state["colour"] in ("red", "green", "blue")
    assert state.messages()[-1] == {"role": "assistant", "content": state["colour"]}
    scores = state.get_meta_info("colour")["normalized_prompt_logprobs"]
    assert state["colour"] == ["red", "green", "blue"][scores.index(max(scores))]


def test_endpoint_without_a_local_tokenizer_uses_the_servers(server, endpoint_backend):
    """A server on another machine: tokenization for select goes through POST /tokenize."""
    from arborlm.lang.backends.runtime_endpoint import RuntimeEndpoint

    remote = RuntimeEndpoint(server.url)
    remote.tokenizer = None  # as when the server's tokenizer path is not on this machine
    texts = [PROMPT + c for c in CHOICES] + [""]
    assert remote.tokenize(texts) == endpoint_backend.tokenize(texts)
    method = sgl.unconditional_likelihood_normalized
    assert pick.run(method, backend=remote)["answer"] == \
        pick.run(method, backend=endpoint_backend)["answer"]
