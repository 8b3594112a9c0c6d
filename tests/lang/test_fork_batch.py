"""fork / join semantics, run_batch against sequential runs, and prefix sharing visible in
`cached_tokens` (forked branches, repeated runs, run_batch's precached prefix)."""

from __future__ import annotations

import arborlm.lang as sgl
from tests.lang.conftest import GREEDY

PREFIX = ("You are a careful planner. Think about the problem step by step, consider several "
          "options and explain each of them briefly.\n")


def greedy_text(backend, text: str, n: int) -> str:
    params = {"temperature": 0, "max_new_tokens": n,
              "stop": list(backend.get_chat_template().stop_str)}
    return backend.request({"text": text, "sampling_params": params})["text"]


@sgl.function
def branches(s, n):
    s += PREFIX
    forks = s.fork(n)
    forks += lambda i: f"Option {i}:" + sgl.gen("idea", max_tokens=4)
    forks.join()
    s += "Summary:" + sgl.gen("summary", max_tokens=3)


def test_fork_join_gathers_variables_in_branch_order(backend):
    state = branches.run(3, backend=backend, **GREEDY)
    ideas = state["idea"]
    assert ideas == [greedy_text(backend, PREFIX + f"Option {i}:", 4) for i in range(3)]
    # gather_variable leaves the parent's text as it was before the fork.
    assert state.text() == PREFIX + "Summary:" + state["summary"]


def test_fork_branches_continue_from_the_parent(backend):
    @sgl.function
    def prog(s):
        s += sgl.user_begin() + "Hello"
        forks = s.fork(2)
        forks += [" first", " second"]
        assert forks[0].text().endswith("Hello first")
        assert len(forks) == 2 and [f.text() for f in forks][1].endswith("Hello second")
        forks.join("concate_and_append")
        s += sgl.user_end()
        s += sgl.assistant("done")

    state = prog.run(backend=backend)
    assert state.error() is None
    assert state.messages() == [{"role": "user", "content": "Hello first second"},
                                {"role": "assistant", "content": "done"}]


def test_nested_forks(backend):
    @sgl.function
    def tree(s):
        s += PREFIX
        outer = s.fork(2)
        for i, branch in enumerate(outer):
            branch += f"Plan {i}."
            inner = branch.fork(2)
            inner += lambda j: f" Step {j}:" + sgl.gen("step", max_tokens=2)
            inner.join()
        outer.join()

    state = tree.run(backend=backend, **GREEDY)
    steps = state["step"]
    assert len(steps) == 2 and all(len(row) == 2 for row in steps)
    assert steps[1][0] == greedy_text(backend, PREFIX + "Plan 1. Step 0:", 2)


def test_forked_branches_and_repeated_runs_hit_the_cache(backend):
    assert sgl.flush_cache(backend)

    @sgl.function
    def fan(s):
        s += PREFIX * 3
        forks = s.fork(3)
        forks += lambda i: f"Branch {i}:" + sgl.gen("x", max_tokens=2)
        metas = [branch.get_meta_info("x") for branch in forks]
        forks.join()
        return metas

    state = fan.run(backend=backend, **GREEDY)
    prefix_tokens = len(backend.tokenize([PREFIX * 3])[0])
    # The fork prefilled the shared prefix once; each branch reuses all but its last token
    # or two (where the branch's own text may merge with it).
    assert all(m["cached_tokens"] >= prefix_tokens - 2 for m in state.ret_value), \
        state.ret_value

    @sgl.function
    def repeat(s):
        s += PREFIX + "Repeat:"
        s += sgl.gen("x", max_tokens=2)

    first = repeat.run(backend=backend, **GREEDY).get_meta_info("x")
    second = repeat.run(backend=backend, **GREEDY).get_meta_info("x")
    assert first["cached_tokens"] < first["prompt_tokens"] - 1
    assert second["cached_tokens"] == second["prompt_tokens"] - 1


@sgl.function
def small_chat(s, question):
    s += sgl.system(PREFIX)
    s += sgl.user(question)
    s += sgl.assistant(sgl.gen("answer", max_tokens=5))


def test_run_batch_matches_sequential_runs(backend):
    questions = [{"question": f"Question number {i}?"} for i in range(64)]
    batch = small_chat.run_batch(questions, backend=backend, progress_bar=True, **GREEDY)
    assert len(batch) == 64 and all(s.error() is None for s in batch)
    sequential = [small_chat.run(backend=backend, **q, **GREEDY) for q in questions]
    assert [s.text() for s in batch] == [s.text() for s in sequential]


def test_run_batch_precaches_the_constant_prefix(backend):
    assert sgl.flush_cache(backend)
    constant = small_chat.constant_prefix(backend)
    assert constant.startswith("<|im_start|>system\n" + PREFIX)
    batch = small_chat.run_batch([{"question": f"Q{i}"} for i in range(4)], backend=backend,
                                 num_threads=4, **GREEDY)
    constant_tokens = len(backend.tokenize([constant])[0])
    for state in batch:
        assert state.get_meta_info("answer")["cached_tokens"] >= constant_tokens - 2


def test_without_a_prefix_cache_warmups_are_skipped_and_results_unchanged(tiny_path,
                                                                           engine_backend):
    from arborlm.lang.backends.engine_backend import EngineBackend

    with EngineBackend(model_path=str(tiny_path), disable_radix_cache=True,
                       dtype="float32") as no_cache:  # as engine_backend, for equal text
        assert not no_cache.prefix_cache_enabled and engine_backend.prefix_cache_enabled
        before = no_cache.get_server_info()["prefill_tokens"]

        @sgl.function
        def fan(s):
            s += PREFIX
            forks = s.fork(3)
            forks += lambda i: f"Option {i}:" + sgl.gen("idea", max_tokens=4)
            metas = [f.get_meta_info("idea") for f in forks]
            forks.join()
            return metas

        state = fan.run(backend=no_cache, **GREEDY)
        prefilled = no_cache.get_server_info()["prefill_tokens"] - before
        # Only the three branch prompts were prefilled: no warm-up of the shared prefix.
        assert prefilled == sum(m["prompt_tokens"] for m in state.ret_value)
        assert all(m["cached_tokens"] == 0 for m in state.ret_value)
        assert state["idea"] == fan.run(backend=engine_backend, **GREEDY)["idea"]
