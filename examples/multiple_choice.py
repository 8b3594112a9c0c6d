"""Multiple choice with `select`: the model scores each option; a batch of questions shares
the few-shot prefix, which `run_batch` prefills once.

    python examples/multiple_choice.py [--url URL]
"""

from __future__ import annotations

from example_backend import backend_from_args

import arborlm as sgl

FEW_SHOT = (
    "Question: Which planet is closest to the sun?\nAnswer: Mercury\n\n"
    "Question: What is 3 + 4?\nAnswer: 7\n\n"
)
QUESTIONS = [
    {"question": "What is the capital of France?", "options": ["Madrid", "Paris", "Berlin"]},
    {"question": "Which animal says 'meow'?", "options": ["Cow", "Cat", "Duck"]},
    {"question": "What do bees make?", "options": ["Milk", "Silk", "Honey"]},
]

@sgl.function
def answer(s, question, options, method=sgl.token_length_normalized):
    s += FEW_SHOT
    s += f"Question: {question}\nAnswer:"
    s += sgl.select("answer", choices=[" " + o for o in options], choices_method=method)


def main(argv: list[str] | None = None) -> list[sgl.ProgramState]:
    with backend_from_args(__doc__.splitlines()[0], argv) as backend:
        states = answer.run_batch(QUESTIONS, backend=backend, progress_bar=True)
        for q, state in zip(QUESTIONS, states):
            scores = state.get_meta_info("answer")["normalized_prompt_logprobs"]
            print(f"{q['question']:<32} ->{state['answer']}   scores "
                  + " ".join(f"{x:.2f}" for x in scores))
        # Another scoring rule: discount options that are likely whatever the question says.
        other = answer.run(**QUESTIONS[0], method=sgl.unconditional_likelihood_normalized,
                           backend=backend)
        print("unconditional_likelihood_normalized:", other["answer"])
        return states


# What this printed on the default model (SmolLM2-135M-Instruct, Q4_1 GGUF, bfloat16 on
# an AVX512-BF16 CPU), in-process:
# What is the capital of France?   -> Paris   scores -9.37 -0.18 -7.49
# Which animal says 'meow'?        -> Cat   scores -4.14 -2.66 -9.05
# What do bees make?               -> Honey   scores -9.82 -11.21 -1.79
# unconditional_likelihood_normalized:  Paris


if __name__ == "__main__":
    main()
