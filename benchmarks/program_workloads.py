"""The program workloads of `programs.py`: each builds a DSL program and its batch arguments.

Texts are synthetic but shaped like the SGLang paper's benchmarks (MMLU-style few-shot
questions, GSM-style word problems, a chat with a long system prompt, JSON extraction); they
are generated deterministically so every run sends the same requests.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import arborlm as sgl

NAMES = ["Ada", "Bruno", "Chen", "Dana", "Emeka", "Farah", "Goran", "Hana", "Ivo", "Jun"]
CITIES = ["Lisbon", "Osaka", "Lagos", "Quito", "Tromso", "Perth", "Tunis", "Riga"]


def _mc_question(rng: random.Random) -> tuple[str, list[str], int]:
    a, b = rng.randint(10, 99), rng.randint(10, 99)
    answer = a + b
    options = [answer, answer + rng.randint(1, 9), answer - rng.randint(1, 9), answer + 10]
    rng.shuffle(options)
    return f"What is {a} plus {b}?", [str(o) for o in options], options.index(answer)


def _format_mc(question: str, options: list[str]) -> str:
    lines = [f"Question: {question}"] + [f"{L}. {o}" for L, o in zip("ABCD", options)]
    return "\n".join(lines) + "\nAnswer:"


def few_shot_mc(n: int) -> tuple[Any, list[dict[str, Any]]]:
    rng = random.Random(0)
    shots = []
    for _ in range(20):
        q, opts, k = _mc_question(rng)
        shots.append(_format_mc(q, opts) + f" {'ABCD'[k]}\n\n")
    prefix = ("The following are multiple choice questions about arithmetic. Answer with the "
              "letter of the correct option.\n\n" + "".join(shots))

    @sgl.function
    def mc(s, question, options):
        s += prefix
        s += _format_mc(question, options)
        s += sgl.select("answer", choices=[" A", " B", " C", " D"])

    batch = []
    for _ in range(n):
        q, opts, _ = _mc_question(rng)
        batch.append({"question": q, "options": opts})
    return mc, batch


TOT_CONTEXT = (
    "You solve word problems by planning. For each problem, propose a plan, break the plan "
    "into short steps, then compare the plans and choose the one most likely to give the "
    "right answer. A good plan names the quantities involved, the operations to apply and the "
    "order in which to apply them. A good step does one operation and states its result. "
    "Avoid guessing; check each step against the problem statement; prefer plans with fewer "
    "steps when they are equally reliable.\n\n"
    "Example problem: A baker makes 24 rolls in the morning and 18 in the afternoon and sells "
    "all but 7. How many rolls does she sell?\n"
    "Plan 1: add the morning and afternoon rolls, then subtract the unsold rolls.\n"
    "Step 1: 24 + 18 = 42 rolls baked.\nStep 2: 42 - 7 = 35 rolls sold.\n"
    "Plan 2: subtract the unsold rolls from the afternoon batch, then add the morning batch.\n"
    "Step 1: 18 - 7 = 11.\nStep 2: 11 + 24 = 35 rolls sold.\n"
    "Best plan: 1\n\n")


def tree_of_thought(n: int) -> tuple[Any, list[dict[str, Any]]]:
    @sgl.function
    def tot(s, question):
        s += TOT_CONTEXT
        s += f"Problem: {question}\n"
        plans = s.fork(2)
        plans += lambda i: f"Plan {i + 1}:" + sgl.gen("plan", max_tokens=8, stop="\n") + "\n"
        for plan in plans:
            steps = plan.fork(2)
            steps += lambda j: f"Step {j + 1}:" + sgl.gen("step", max_tokens=8, stop="\n")
            steps.join()
        plans.join()
        s += "Best plan:" + sgl.select("best", choices=[" 1", " 2"])

    rng = random.Random(1)
    batch = [{"question": f"{rng.choice(NAMES)} has {rng.randint(5, 60)} marbles, gives away "
                          f"{rng.randint(1, 5)} and buys {rng.randint(2, 20)} more. How many "
                          f"marbles are left?"} for _ in range(n)]
    return tot, batch


CHAT_SYSTEM = (
    "You are the help desk assistant of a city library. You answer questions about opening "
    "hours, borrowing rules, fees, events and accounts. Opening hours: Monday to Friday 9:00 "
    "to 20:00, Saturday 10:00 to 16:00, closed on Sunday and public holidays. Members may "
    "borrow up to 12 items for three weeks and renew twice unless another member reserved the "
    "item. Late fees are 20 cents per item per day, capped at 5 euros per item. Lost items "
    "are charged at their replacement cost. Events: a reading club on Tuesdays, language "
    "cafes on Thursdays and a children's story hour on Saturday mornings. Be brief and "
    "friendly, and ask a follow-up question when a request is ambiguous.")
CHAT_TURNS = ["Hi! When are you open on Saturday?", "How many books can I borrow at once?",
              "And what if I return one late?", "Is there anything for kids this weekend?"]


def multi_turn_chat(n: int) -> tuple[Any, list[dict[str, Any]]]:
    @sgl.function
    def chat(s, name, turns):
        s += sgl.system(CHAT_SYSTEM)
        for i, turn in enumerate(turns):
            s += sgl.user(f"{name}: {turn}" if i == 0 else turn)
            s += sgl.assistant(sgl.gen(f"reply_{i}", max_tokens=8))

    rng = random.Random(2)
    batch = [{"name": rng.choice(NAMES), "turns": rng.sample(CHAT_TURNS, 3)} for _ in range(n)]
    return chat, batch


PERSON_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12},
                   "age": {"type": "integer", "minimum": 0, "maximum": 120},
                   "city": {"type": "string", "maxLength": 12}},
    "required": ["name", "age", "city"], "additionalProperties": False,
}
JSON_INSTRUCTIONS = (
    "Extract the person described in the text as a JSON object with the fields name (string), "
    "age (integer) and city (string). Output only the JSON object, with no comments.\n\n"
    "Text: Mara Lind, aged 41, moved to Bergen last spring to teach chemistry.\n"
    'JSON: {"name": "Mara Lind", "age": 41, "city": "Bergen"}\n\n'
    "Text: The youngest finalist, Tomas (19), trains every morning in Valencia.\n"
    'JSON: {"name": "Tomas", "age": 19, "city": "Valencia"}\n\n'
    "Text: In Nairobi, 67-year-old Grace Wanjiru still runs the family bakery.\n"
    'JSON: {"name": "Grace Wanjiru", "age": 67, "city": "Nairobi"}\n\n')


def json_decode(n: int) -> tuple[Any, list[dict[str, Any]]]:
    @sgl.function
    def extract(s, text):
        s += JSON_INSTRUCTIONS
        s += f"Text: {text}\nJSON: "
        s += sgl.gen("person", json_schema=PERSON_SCHEMA, max_tokens=24)

    rng = random.Random(3)
    batch = [{"text": f"{rng.choice(NAMES)}, {rng.randint(18, 90)}, lives in "
                      f"{rng.choice(CITIES)} and collects stamps."} for _ in range(n)]
    return extract, batch


WORKLOADS: dict[str, Callable[[int], tuple[Any, list[dict[str, Any]]]]] = {
    "few_shot_mc": few_shot_mc, "tree_of_thought": tree_of_thought,
    "multi_turn_chat": multi_turn_chat, "json_decode": json_decode,
}
