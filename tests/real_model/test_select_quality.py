"""`select` on the real model answers easy multiple-choice questions far above chance.

The questions were written for this test. Each runs as a plain "Question: ...\nAnswer:" prompt
followed by a `select` over three answers, scored by SGLang's default rule (highest mean token
logprob). (Asked as a chat turn, this 135M model picks worse: transformers gets 16 of 24 with "The
answer is" opening the reply, and 6 of 24 with the options listed in the question.) The reference
is transformers on the same GGUF in float32, scoring the same prompt text by the same rule: ArborLM
(in the default dtype) must get at least as many right as it, less one, and must agree with it on
most questions.
"""

from __future__ import annotations

import math
from typing import Any

import torch

import arborlm as sgl

QUESTIONS: list[tuple[str, list[str], str]] = [
    ("What is the capital of France?", ["Paris", "Madrid", "Berlin"], "Paris"),
    ("What is the capital of Japan?", ["Seoul", "Tokyo", "Beijing"], "Tokyo"),
    ("What is the capital of Italy?", ["Rome", "Vienna", "Athens"], "Rome"),
    ("How many days are in a week?", ["Five", "Seven", "Ten"], "Seven"),
    ("How many legs does a dog have?", ["Two", "Four", "Eight"], "Four"),
    ("What color is the sky on a clear day?", ["Green", "Blue", "Red"], "Blue"),
    ("What color is snow?", ["White", "Black", "Purple"], "White"),
    ("Which animal is known as the king of the jungle?", ["Rabbit", "Lion", "Mouse"], "Lion"),
    ("Which planet do we live on?", ["Mars", "Earth", "Jupiter"], "Earth"),
    ("What do bees make?", ["Milk", "Honey", "Silk"], "Honey"),
    ("What is frozen water called?", ["Ice", "Steam", "Sand"], "Ice"),
    ("Which season is the coldest?", ["Summer", "Winter", "Spring"], "Winter"),
    ("What is 2 + 2?", ["3", "4", "22"], "4"),
    ("What is 10 - 3?", ["7", "13", "3"], "7"),
    ("Which is the largest ocean on Earth?", ["Pacific", "Arctic", "Indian"], "Pacific"),
    ("What gas do humans need to breathe to live?", ["Helium", "Oxygen", "Neon"], "Oxygen"),
    ("Which star gives Earth its daylight?", ["The Moon", "The Sun", "Sirius"], "The Sun"),
    ("What language is mostly spoken in Spain?", ["Spanish", "Swedish", "Polish"], "Spanish"),
    ("Which animal says 'meow'?", ["Cow", "Cat", "Duck"], "Cat"),
    ("What do you use to write on a blackboard?", ["Chalk", "Soap", "Glue"], "Chalk"),
    ("Which fruit is yellow and curved?", ["Banana", "Grape", "Cherry"], "Banana"),
    ("Which organ pumps blood through the body?", ["Liver", "Heart", "Lung"], "Heart"),
    ("What is the opposite of hot?", ["Cold", "Loud", "Tall"], "Cold"),
    ("How many hours are in a day?", ["12", "24", "60"], "24"),
]


@sgl.function
def quiz(s: Any, question: str, choices: list[str]) -> None:
    s += f"Question: {question}\nAnswer:"
    s += sgl.select("answer", choices=[" " + c for c in choices])


def _prompt_before_answer(state: Any) -> str:
    text = state.text()
    return text[:text.rindex(state["answer"])]


def _hf_choice(model: Any, tokenizer: Any, prompt: str, choices: list[str]) -> str:
    """The choice with the highest mean token logprob after `prompt`, computed by transformers
    (the choice's tokens: those of prompt + choice beyond the prompt's own)."""
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    best, best_score = choices[0], -math.inf
    for choice in choices:
        ids = tokenizer(prompt + choice, add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0].float()
        logprobs = torch.log_softmax(logits, dim=-1)
        own = range(len(prompt_ids), len(ids))
        score = sum(logprobs[i - 1, ids[i]].item() for i in own) / len(own)
        if score > best_score:
            best, best_score = choice, score
    return best


def test_select_answers_easy_questions_far_above_chance(smollm2_engine, hf_smollm2):
    from arborlm.lang.backends.engine_backend import EngineBackend

    backend = EngineBackend(smollm2_engine)
    states = quiz.run_batch([{"question": q, "choices": c} for q, c, _ in QUESTIONS],
                            backend=backend)
    model, tokenizer = hf_smollm2
    ours = [s["answer"] for s in states]
    theirs = [_hf_choice(model, tokenizer, _prompt_before_answer(s), [" " + x for x in c])
              for s, (_, c, _) in zip(states, QUESTIONS)]
    right = [" " + a for _, _, a in QUESTIONS]
    our_score = sum(o == r for o, r in zip(ours, right))
    their_score = sum(t == r for t, r in zip(theirs, right))
    agree = sum(o == t for o, t in zip(ours, theirs))
    report = [f"{q!r}: ours {o!r}, transformers {t!r}"
              for (q, _, _), o, t in zip(QUESTIONS, ours, theirs)]
    chance = len(QUESTIONS) / 3
    assert their_score >= 2 * chance, ("the reference itself is near chance", report)
    assert our_score >= their_score - 1, (our_score, their_score, report)
    assert our_score >= 2 * chance, (our_score, report)
    assert agree >= len(QUESTIONS) - 2, (agree, report)
