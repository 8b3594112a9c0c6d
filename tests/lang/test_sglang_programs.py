"""SGLang 0.5's own frontend test programs (`sglang/test/test_programs.py`) pass against ArborLM
both ways: through SGLang's `RuntimeEndpoint` against an ArborLM server (SGLang's frontend,
unchanged), and with `import arborlm as sgl` (ArborLM's frontend, same programs: against the
same server, and on an in-process engine).

SGLang itself is installed for these tests with `pip install --no-deps sglang==0.5.23` into the
cache (`$ARBORLM_CACHE_DIR/sglang/0.5.23`; the tests skip when that fails, e.g. offline); the
light packages its frontend imports are in the dev extra. The programs run on the tiny random
model, in a subprocess per mode (`tests/lang/sglang_programs.py`, which lists what it adapts).

The programs of sglang 0.5.23 and what they need:
- no trained model — these must pass both ways (`PROGRAMS`): `test_mt_bench`, `test_select`
  (`check_answer=False`), `test_expert_answer` (`check_answer=False`),
  `test_parallel_decoding`, `test_parallel_encoding` (`check_answer=False`), `test_stream`,
  `test_stream_logprobs`, `test_regex`, `test_dtype_gen`, `test_gen_min_new_tokens`;
- a trained model, as they assert the answer to a question (`NEED_A_TRAINED_MODEL`):
  `test_few_shot_qa` (capitals), `test_decode_int` (24 hours, 365 days), `test_tool_use` (the
  model must write the product's expression), `test_react` (it must finish with an answer
  naming Finland or the States), `test_decode_json` and `test_decode_json_regex` (their
  string regex, SGLang's `REGEX_STR` = `"[\\w\\d\\s]*"`, admits raw newlines and tabs, which JSON
  forbids inside strings, and does not make the model close a string within the token
  budget: a random model's JSON does not parse; SGLang skips the second as flaky), and the
  `check_answer=True` forms of `test_select`, `test_expert_answer` and
  `test_parallel_encoding`;
- not for a native runtime (`NOT_APPLICABLE`): `test_image_qa` (an image and a vision model),
  `test_completion_speculative` and `test_chat_completion_speculative` (API speculative
  execution, which SGLang runs on its OpenAI backend only).

On the default model, SmolLM2-135M-Instruct (run by hand, both ways, same outcomes):
`test_decode_json` and `test_decode_json_regex` pass; the others of the second group get the
same kind of wrong answers both ways ("New York", "Answer: False", days in a year as digits
that run on: "36524000..."), beyond a 135M model (SGLang's CI runs them on Llama-3.1-8B-Instruct).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.lang.conftest import REPO_ROOT

SGLANG_VERSION = "0.5.23"
RUN_TIMEOUT_S = 600

PROGRAMS: dict[str, dict[str, Any]] = {
    "test_mt_bench": {},
    "test_select": {"check_answer": False},
    "test_expert_answer": {"check_answer": False},
    "test_parallel_decoding": {},
    "test_parallel_encoding": {"check_answer": False},
    "test_stream": {},
    "test_stream_logprobs": {},
    "test_regex": {},
    "test_dtype_gen": {},
    "test_gen_min_new_tokens": {},
}
NEED_A_TRAINED_MODEL = ("test_few_shot_qa", "test_decode_int", "test_tool_use", "test_react",
                        "test_decode_json", "test_decode_json_regex")
NOT_APPLICABLE = ("test_image_qa", "test_completion_speculative",
                  "test_chat_completion_speculative")


@pytest.fixture(scope="session")
def sglang_path() -> Path:
    """A directory holding the `sglang` package (no dependencies), installed on first use."""
    from arborlm.runtime.models.factory import cache_root, cached_build

    def install(tmp: Path) -> None:
        cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
               "--no-deps", "--target", str(tmp), f"sglang=={SGLANG_VERSION}"]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if proc.returncode != 0:
            raise RuntimeError(proc.stderr[-2000:])

    try:
        return cached_build(cache_root() / "sglang" / SGLANG_VERSION, install)
    except (RuntimeError, subprocess.TimeoutExpired) as e:
        pytest.skip(f"cannot install sglang=={SGLANG_VERSION} (pip install --no-deps): {e}")


def run_programs(sglang_path: Path, mode: str, target: str) -> dict[str, dict[str, Any]]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(REPO_ROOT), str(sglang_path), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [sys.executable, "-m", "tests.lang.sglang_programs", mode, target,
         json.dumps(list(PROGRAMS.items()))],
        capture_output=True, text=True, env=env, cwd=REPO_ROOT, timeout=RUN_TIMEOUT_S)
    results = {}
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            result = json.loads(line)
            results[result["name"]] = result
    if not results:
        raise AssertionError(f"the programs did not run ({mode}):\n{proc.stderr[-4000:]}")
    return results


MODES = ("sglang", "arborlm", "arborlm-engine")


@pytest.fixture(scope="module")
def outcomes(sglang_path: Path, server: Any,
             tiny_path: Path) -> dict[str, dict[str, dict[str, Any]]]:
    targets = {"sglang": server.url, "arborlm": server.url, "arborlm-engine": str(tiny_path)}
    return {mode: run_programs(sglang_path, mode, targets[mode]) for mode in MODES}


def test_the_lists_cover_every_program_of_the_sglang_release(sglang_path):
    source = (sglang_path / "sglang" / "test" / "test_programs.py").read_text()
    names = {line.split("(")[0][4:] for line in source.splitlines() if line.startswith("def test_")}
    assert names == set(PROGRAMS) | set(NEED_A_TRAINED_MODEL) | set(NOT_APPLICABLE)


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", list(PROGRAMS))
def test_sglang_program(outcomes, mode, name):
    result = outcomes[mode].get(name)
    assert result is not None, f"{name} did not report (the runner stopped before it)"
    assert result["outcome"] == "passed", result["detail"]


def test_native_stream_follows_sglang_logprob_semantics(server):
    """What SGLang's frontend reads from a streamed `/generate`: cumulative text, per-chunk
    output logprob lists, `output_token_logprobs_length` counting them all, whole input lists."""
    body = {"text": "The quick brown fox", "return_logprob": True, "logprob_start_len": 0,
            "top_logprobs_num": 2, "sampling_params": {"temperature": 0, "max_new_tokens": 12,
                                                       "ignore_eos": True}}
    with httpx.Client(base_url=server.url, timeout=60) as http:
        final = http.post("/generate", json=body).json()
        with http.stream("POST", "/generate", json={**body, "stream": True}) as r:
            lines = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    chunks = [json.loads(line) for line in lines[:-1]]
    assert len(chunks) > 1
    assert final["meta_info"]["output_token_logprobs_length"] == 12
    want_inputs = final["meta_info"]["input_token_logprobs"]
    entries, tops = [], []
    for chunk in chunks:
        meta = chunk["meta_info"]
        entries += meta["output_token_logprobs"]
        tops += meta["output_top_logprobs"]
        assert meta["output_token_logprobs_length"] == len(entries) == meta["completion_tokens"]
        assert same_entries(meta["input_token_logprobs"], want_inputs)
        assert chunk["text"] == final["text"][:len(chunk["text"])]
    assert same_entries(entries, final["meta_info"]["output_token_logprobs"])
    assert len(tops) == len(entries) and all(len(row) == 2 for row in tops)


def same_entries(got: list, want: list) -> bool:
    """Same token ids, logprobs equal up to float noise (the second run hits the cache)."""
    return [e[1] for e in got] == [e[1] for e in want] and all(
        (a[0] is None and b[0] is None) or a[0] == pytest.approx(b[0], abs=1e-3)
        for a, b in zip(got, want))
