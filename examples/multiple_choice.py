"""Multiple choice with `select`: the model scores each option; a batch of questions shares
the few-shot prefix, which `run_batch` prefills once.

    python examples/multiple_choice.py [--url URL]
"""

from __future__ import annotations

from example_backend import backend_from_args

import arborlm as sgl

FEW_SHOT = (
    "Answer each question with the letter of the right option.\n\n"
    "Question: Which planet is closest to the sun?\nA. Venus\nB. Mercury\nC. Mars\nAnswer: B\n\n"
    "Question: What is 3 + 4?\nA. 7\nB. 8\nC. 12\nAnswer: A\n\n"
)
QUESTIONS = [
    {"question": "Which gas do plants absorb?", "options": ["Oxygen", "Nitrogen", "CO2"]},
    {"question": "How many legs has a spider?", "options": ["Six", "Eight", "Ten"]},
    {"question": "Which is a prime number?", "options": ["9", "15", "7"]},
]


@sgl.function
def answer(s, question, options, method=sgl.token_length_normalized):
    s += FEW_SHOT
    s += f"Question: {question}\n"
    for letter, option in zip("ABC", options):
        s += f"{letter}. {option}\n"
    s += "Answer:" + sgl.select("letter", choices=[" A", " B", " C"], choices_method=method)


def main(argv: list[str] | None = None) -> list[sgl.ProgramState]:
    with backend_from_args(__doc__.splitlines()[0], argv) as backend:
        states = answer.run_batch(QUESTIONS, backend=backend, progress_bar=True)
        for q, state in zip(QUESTIONS, states):
            scores = state.get_meta_info("letter")["normalized_prompt_logprobs"]
            print(f"{q['question']:<32} ->{state['letter']}   scores "
                  + " ".join(f"{x:.2f}" for x in scores))
        # Another scoring rule: discount options that are likely whatever the question says.
        other = answer.run(**QUESTIONS[0], method=sgl.unconditional_likelihood_normalized,
                           backend=backend)
        print("unconditional_likelihood_normalized:", other["letter"])
        return states


if __name__ == "__main__":
    main()
