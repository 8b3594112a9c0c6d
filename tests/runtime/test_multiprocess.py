"""The multi-process engine with real processes: same answers as in-process, failures, cleanup.

One module-scoped multi-process engine (and an in-process twin) on a tiny float32 Llama serves
the behaviour tests; the failure tests start their own engines (or a whole Python process) and
check that nothing — process or socket file — is left behind.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import selectors
import signal
import subprocess
import sys
import tempfile
import time

import psutil
import pytest

from arborlm import Engine
from arborlm.errors import EngineDeadError, GrammarError, InvalidRequestError
from arborlm.runtime.config import EngineArgs
from arborlm.runtime.detokenizer import decode_text
from arborlm.runtime.detokenizer_process import DetokenizerService
from arborlm.runtime.generate_request import GenerateRequest
from arborlm.runtime.ipc import IpcAddresses
from arborlm.runtime.messages import (
    BatchTokenOutput,
    DecodeOptions,
    ErrorOutput,
    TokenizedGenerateReq,
)
from arborlm.runtime.scheduler_process import SchedulerService
from arborlm.runtime.zmq_queues import PullQueue
from tests.conftest import REPO_ROOT

GREEDY = {"temperature": 0.0, "max_new_tokens": 12, "ignore_eos": True}
LONG = {"temperature": 0.0, "max_new_tokens": 1800, "ignore_eos": True}
LOGPROB_KEYS = ("input_token_logprobs", "output_token_logprobs", "input_top_logprobs",
                "output_top_logprobs", "input_token_ids_logprobs", "output_token_ids_logprobs")
WORDS = "the quick brown fox jumps over a lazy dog while seven small owls sing".split()


@pytest.fixture(scope="module")
def llama_path(make_tiny_model):
    return str(make_tiny_model("llama"))


@pytest.fixture(scope="module")
def inproc(llama_path):
    engine = Engine(llama_path, dtype="float32", debug_integrity=True)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def multiproc(llama_path):
    engine = Engine(llama_path, mode="multiprocess", dtype="float32", debug_integrity=True)
    yield engine
    engine.shutdown()


def _untimed(obj):
    """`obj` without its timing fields (the only part allowed to differ between modes)."""
    if isinstance(obj, list):
        return [_untimed(x) for x in obj]
    meta = {k: v for k, v in obj["meta_info"].items() if k != "e2e_latency"}
    return {**obj, "meta_info": meta}


def _leftovers(pids: list[int], run_dir: str, wait_s: float = 10.0) -> list[str]:
    """What is still there after `wait_s`: live (non-zombie) processes and the socket dir."""
    deadline = time.monotonic() + wait_s
    while True:
        left = []
        for pid in pids:
            try:
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    left.append(f"process {pid}")
            except psutil.NoSuchProcess:
                pass
        if os.path.exists(run_dir):
            left.append(f"directory {run_dir}: {os.listdir(run_dir)}")
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.1)


async def _gather(engine, prompts, params):
    return await asyncio.gather(*[engine.async_generate(p, sp) for p, sp in zip(prompts, params)])


async def _stream(engine, *args, **kwargs):
    return [chunk async for chunk in await engine.async_generate(*args, stream=True, **kwargs)]


# --- same answers as in-process ----------------------------------------------------------------


def test_200_concurrent_requests_match_inprocess(inproc, multiproc):
    rng = random.Random(0)
    prompts = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 40))) for _ in range(200)]
    params = [{**GREEDY, "max_new_tokens": rng.randint(1, 16)} for _ in prompts]
    start = time.monotonic()
    got = asyncio.run(_gather(multiproc, prompts, params))
    elapsed = time.monotonic() - start
    want = asyncio.run(_gather(inproc, prompts, params))
    assert [o["output_ids"] for o in got] == [o["output_ids"] for o in want]
    assert [o["text"] for o in got] == [o["text"] for o in want]
    assert [o["meta_info"]["finish_reason"] for o in got] == [
        {"type": "length", "length": p["max_new_tokens"]} for p in params]
    assert elapsed < 30, f"200 requests took {elapsed:.1f} s"
    multiproc.check_integrity()


def _stop_case(inproc, prompt):
    text = inproc.generate(prompt, {"temperature": 0.0, "max_new_tokens": 24})["text"]
    return {"temperature": 0.0, "max_new_tokens": 24, "stop": [text[6:8], "zzz"]}


CASES = {
    "batch_n2_sampled_logprobs": (
        ["The quick brown fox", "Hello"],
        {"temperature": 0.8, "top_k": 50, "max_new_tokens": 6, "n": 2, "sampling_seed": 7},
        {"return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 3,
         "token_ids_logprob": [5, 7], "return_text_in_logprobs": True}),
    "stop_string": ("Once upon a time", "stop", {}),
    "stop_regex_no_trim": ("Once upon a time", {"temperature": 0.0, "max_new_tokens": 24,
                                                "stop_regex": ["[aeiou][a-z]"]}, {}),
    "special_tokens_kept": ("Hello", {"temperature": 0.0, "max_new_tokens": 10,
                                      "logit_bias": {4: 4.0, 5: 4.0}, "ignore_eos": True,
                                      "skip_special_tokens": False}, {}),
    "prompt_logprobs_only": ("1 2 3 4 5", {"max_new_tokens": 0},
                             {"return_logprob": True, "logprob_start_len": 1}),
    "input_ids_extra_key": (None, GREEDY, {"input_ids": [1, 40, 41, 42], "extra_key": "salt"}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_same_json_as_inprocess(inproc, multiproc, case):
    prompt, params, kwargs = CASES[case]
    if params == "stop":
        params = _stop_case(inproc, prompt)
    rid = [f"{case}-{i}" for i in range(len(prompt))] if isinstance(prompt, list) else case
    results = []
    for engine in (inproc, multiproc):
        engine.flush_cache()  # cached_tokens must not depend on what ran before
        results.append(engine.generate(prompt, params, rid=rid, **kwargs))
    assert _untimed(results[1]) == _untimed(results[0])


def test_stream_ends_equal_to_non_stream(inproc, multiproc):
    kwargs = {"return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 2,
              "rid": "streamed"}
    params = {"temperature": 0.0, "max_new_tokens": 16, "stop": ["zz"]}
    multiproc.flush_cache()
    chunks = asyncio.run(_stream(multiproc, "The quick brown fox", params, **kwargs))
    multiproc.flush_cache()
    final = multiproc.generate("The quick brown fox", params, **kwargs)
    assert len(chunks) > 2
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
    assert all(b["text"].startswith(a["text"]) for a, b in zip(chunks, chunks[1:]))
    last = chunks[-1]
    assert (last["text"], last["output_ids"]) == (final["text"], final["output_ids"])
    assert last["meta_info"]["finish_reason"] == final["meta_info"]["finish_reason"]
    for key in LOGPROB_KEYS:
        assert [e for c in chunks for e in c["meta_info"][key]] == final["meta_info"][key], key
    inproc.flush_cache()
    assert _untimed(chunks) == _untimed(asyncio.run(_stream(inproc, "The quick brown fox",
                                                            params, **kwargs)))


@pytest.mark.parametrize("prompt,params", [
    ("Hello", {"max_new_tokens": -1}),
    ("", {}),
    ("Hello", {"top_p": 0}),
    ("word " * 3000, {}),
    ("Hello", {"bogus": 1}),
])
def test_invalid_requests_raise_as_inprocess(inproc, multiproc, prompt, params):
    errors = []
    for engine in (inproc, multiproc):
        with pytest.raises(InvalidRequestError) as info:
            engine.generate(prompt, params)
        errors.append((str(info.value), info.value.param))
    assert errors[0] == errors[1]


def test_duplicate_request_id_answers_as_inprocess(inproc, multiproc):
    async def run(engine):
        stream = await engine.async_generate("Hello", LONG, stream=True, rid="dup")
        await stream.__anext__()
        second = await engine.async_generate("Hi", GREEDY, rid="dup")
        engine.abort("dup")
        rest = [c async for c in stream]
        return second, rest[-1]["meta_info"]["finish_reason"]

    answers = [asyncio.run(run(e)) for e in (inproc, multiproc)]
    assert answers[0] == answers[1]
    assert answers[1][0]["meta_info"]["finish_reason"]["message"] == "duplicate request id 'dup'"
    assert answers[1][1] == {"type": "abort", "message": "aborted", "status_code": 499}


# --- abort, errors, control ------------------------------------------------------------------


def test_abort_mid_generation_frees_kv(multiproc):
    async def abort_by_rid():
        chunks = []
        async for chunk in await multiproc.async_generate("Hello", LONG, stream=True, rid="a1"):
            chunks.append(chunk)
            if len(chunks) == 3:
                multiproc.abort("a1")
        return chunks

    async def abort_by_closing():
        stream = await multiproc.async_generate("Hi there", LONG, stream=True)
        await stream.__anext__()
        await stream.aclose()

    chunks = asyncio.run(asyncio.wait_for(abort_by_rid(), 60))
    assert chunks[-1]["meta_info"]["finish_reason"] == {
        "type": "abort", "message": "aborted", "status_code": 499}
    assert 3 <= len(chunks[-1]["output_ids"]) < LONG["max_new_tokens"]
    multiproc.check_integrity()
    asyncio.run(abort_by_closing())
    multiproc.check_integrity()


def test_error_in_one_request_ends_only_that_request(multiproc):
    """A request the scheduler process refuses (here: sampling values past the API side's
    checks) raises for its caller alone; a concurrent request and the engine carry on."""
    tm = multiproc.client.tm
    bad = GenerateRequest(text="Hello", sampling_params={"max_new_tokens": 4}).normalize()[0]
    bad.sampling_params.top_p = 5.0

    async def run():
        good = asyncio.ensure_future(multiproc.async_generate("The quick brown fox", GREEDY))
        with pytest.raises(InvalidRequestError, match=r"top_p must be in \(0, 1\]"):
            async for _ in tm.generate_prepared([(bad, tm.tokenizer.encode("Hello"))]):
                pass
        return await good

    good = asyncio.run(asyncio.wait_for(run(), 60))
    assert good["meta_info"]["finish_reason"] == {"type": "length", "length": 12}
    assert multiproc.healthy()
    multiproc.check_integrity()


def test_bad_grammar_raises_as_inprocess(inproc, multiproc):
    errors = []
    for engine in (inproc, multiproc):
        with pytest.raises(GrammarError) as info:
            engine.generate(["Hello", "Hi"], [GREEDY, {**GREEDY, "regex": "(unclosed"}])
        errors.append(str(info.value))
    assert errors[0] == errors[1] and "regex" in errors[1]
    multiproc.check_integrity()


def test_control_requests(multiproc):
    assert multiproc.flush_cache() == (True, "cache flushed")
    info = multiproc.get_server_info()
    assert info["max_total_num_tokens"] == multiproc.client.max_total_tokens
    assert (info["integrity_ok"], info["integrity"]) == (True, "ok")

    async def while_busy():
        assert await multiproc.client.health_check() is True
        stream = await multiproc.async_generate("Hello", LONG, stream=True)
        await stream.__anext__()
        flushed = await multiproc.client.flush_cache()
        busy = await multiproc.client.server_info()
        await stream.aclose()
        return flushed, busy

    flushed, busy = asyncio.run(asyncio.wait_for(while_busy(), 60))
    assert flushed[0] is False and "pending" in flushed[1]
    assert busy["integrity_ok"] is False and busy["num_running_reqs"] == 1
    multiproc.check_integrity()


def test_idle_children_do_not_spin(multiproc):
    multiproc.generate("Hello", GREEDY)
    procs = [psutil.Process(pid) for pid in multiproc.client.pids().values()]
    before = [sum(p.cpu_times()[:2]) for p in procs]
    time.sleep(2.0)
    used = [sum(p.cpu_times()[:2]) - b for p, b in zip(procs, before)]
    assert max(used) < 0.2, used


def test_detokenizer_failure_ends_only_that_request(llama_path):
    """A token id the tokenizer cannot decode fails its request alone (the service's handler,
    run here without a process)."""
    addrs = IpcAddresses.create()
    to_api = PullQueue(addrs.detokenizer_to_tokenizer, bind=True)
    service = DetokenizerService(llama_path, addrs)
    opts, done = DecodeOptions(stream=True), {"type": "length", "length": 2}

    def step(ids, reasons, options):
        return BatchTokenOutput(rids=["good", "bad"], new_token_ids=ids, finished_reasons=reasons,
                                prompt_tokens=[2, 2], completion_tokens=[len(ids[0])] * 2,
                                cached_tokens=[0, 0], decode_options=options,
                                logprobs=[None, None])

    try:
        service.handle(step([[40], [-1]], [None, None], [opts, opts]))
        service.handle(step([[41], [42]], [done, done], [None, None]))
        msgs = [to_api.get(timeout=5) for _ in range(3)]
        assert service.requests == {} and service.failed == set()
    finally:
        service.recv.close()
        service.send.close()
        to_api.close()
        addrs.cleanup()
    assert isinstance(msgs[0], ErrorOutput) and msgs[0].rid == "bad"
    assert msgs[0].status_code == 500 and "OverflowError" in msgs[0].message
    assert [m.rids for m in msgs[1:]] == [["good"], ["good"]]
    assert msgs[2].texts == [decode_text(service.tokenizer, [40, 41])]
    assert msgs[2].finished_reasons == [done]


def test_scheduler_refusal_names_the_field(llama_path):
    """A request the scheduler refuses as invalid fails alone with a 400 that names the
    offending field (the service's handler, run here without a process)."""
    addrs = IpcAddresses.create()
    to_detok = PullQueue(addrs.scheduler_to_detokenizer, bind=True)
    service = SchedulerService(EngineArgs(model_path=llama_path, dtype="float32"), addrs)
    try:
        service._add(TokenizedGenerateReq(rid="bad", input_ids=[5, 6, 7],
                                          sampling_params={"top_p": 0.0}))
        msg = to_detok.get(timeout=5)
        assert service.live == {}
    finally:
        service.recv.close()
        service.send.close()
        to_detok.close()
        addrs.cleanup()
    assert isinstance(msg, ErrorOutput) and msg.rid == "bad"
    assert (msg.status_code, msg.param) == (400, "top_p") and "top_p" in msg.message


# --- failures and cleanup ----------------------------------------------------------------------


def test_kill_9_scheduler_fails_pending_calls(llama_path):
    engine = Engine(llama_path, mode="multiprocess", dtype="float32")
    pids, run_dir = engine.client.pids(), engine.client.addrs.run_dir

    async def run():
        pending = asyncio.ensure_future(engine.async_generate("Hello", LONG))
        stream = await engine.async_generate("Hi", LONG, stream=True)
        await stream.__anext__()
        os.kill(pids["scheduler"], signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(EngineDeadError, match=r"scheduler process died \(exit code -9\)"):
            await pending
        with pytest.raises(EngineDeadError, match="scheduler process died"):
            async for _ in stream:
                pass
        return time.monotonic() - start

    assert asyncio.run(asyncio.wait_for(run(), 30)) < 5
    assert not engine.healthy()
    start = time.monotonic()
    with pytest.raises(EngineDeadError, match="scheduler process died"):
        engine.generate("Hello", GREEDY)
    with pytest.raises(EngineDeadError):
        engine.get_server_info()
    assert time.monotonic() - start < 1
    engine.shutdown()
    assert _leftovers(list(pids.values()), run_dir) == []


@pytest.mark.slow
def test_child_startup_failure_raises_its_error(llama_path, monkeypatch):
    run_root = tempfile.mkdtemp(prefix="arb")  # short: socket paths are limited to 107 bytes
    monkeypatch.setattr(tempfile, "tempdir", run_root)
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    with pytest.raises(InvalidRequestError, match="max_total_tokens must be at least 2"):
        Engine(llama_path, mode="multiprocess", dtype="float32", max_total_tokens=1)
    new = [p.pid for p in psutil.Process().children(recursive=True) if p.pid not in before]
    new = [pid for pid in new if "resource_tracker" not in " ".join(psutil.Process(pid).cmdline())]
    assert _leftovers(new, run_root, wait_s=5) == [f"directory {run_root}: []"]
    os.rmdir(run_root)


OWNER_SCRIPT = """
import json, signal, sys, time
import psutil
from arborlm import Engine

if __name__ == "__main__":
    # Ctrl-C as in a terminal, even when the suite runs as a background job (whose commands
    # inherit SIGINT ignored, and Python then installs no KeyboardInterrupt handler).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    engine = Engine(sys.argv[1], mode="multiprocess", dtype="float32")
    engine.generate("Hello", {"max_new_tokens": 2})
    heavy = [m for m in ("arborlm.runtime.scheduler", "arborlm.runtime.models.llama", "fastapi")
             if m in sys.modules]
    descendants = [p.pid for p in psutil.Process().children(recursive=True)]
    print(json.dumps({"pids": descendants, "run_dir": engine.client.addrs.run_dir,
                      "heavy": heavy}), flush=True)
    time.sleep(300)
"""


def _read_line(proc: subprocess.Popen, timeout: float) -> str:
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    if not sel.select(timeout):
        proc.kill()
        raise AssertionError(f"no output within {timeout} s: {proc.stderr.read()}")
    return proc.stdout.readline()


@pytest.mark.slow
@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM", "SIGKILL"])
def test_owner_process_signal_leaves_nothing_behind(llama_path, sig):
    """Ctrl-C (SIGINT to the process group) and SIGTERM run the engine's shutdown; after a
    SIGKILL of the owner, the children notice, exit and remove the socket directory. No
    descendant of the owner (multiprocessing's resource tracker included) outlives it."""
    proc = subprocess.Popen([sys.executable, "-c", OWNER_SCRIPT, llama_path], cwd=REPO_ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        line = _read_line(proc, 120)
        info = json.loads(line)
        if sig == "SIGINT":
            os.killpg(proc.pid, signal.SIGINT)
        else:
            os.kill(proc.pid, getattr(signal, sig))
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.stdout.close()
        proc.stderr.close()
    assert info["heavy"] == []
    assert _leftovers(info["pids"], info["run_dir"]) == []


def test_api_side_imports_no_model_code():
    code = ("import sys, json\n"
            "import arborlm.runtime.tokenizer_manager, arborlm.runtime.multiprocess_client\n"
            "api = [m for m in ('arborlm.runtime.scheduler', 'arborlm.runtime.models.llama')"
            " if m in sys.modules]\n"
            "import arborlm.runtime.scheduler_process\n"
            "print(json.dumps({'api': api, 'fastapi': 'fastapi' in sys.modules}))\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True,
                         text=True, timeout=120, check=True)
    assert json.loads(out.stdout) == {"api": [], "fastapi": False}
