"""Quick start: a multi-turn chat program with system / user / assistant roles.

    python examples/quick_start.py                      # in-process, the default model
    python examples/quick_start.py --url http://127.0.0.1:30000
"""

from __future__ import annotations

from example_backend import backend_from_args

import arborlm as sgl


@sgl.function
def multi_turn_question(s, question_1, question_2):
    s += sgl.system("You are a helpful assistant.")
    s += sgl.user(question_1)
    s += sgl.assistant(sgl.gen("answer_1", max_tokens=24))
    s += sgl.user(question_2)
    s += sgl.assistant(sgl.gen("answer_2", max_tokens=24))


def main(argv: list[str] | None = None) -> sgl.ProgramState:
    with backend_from_args(__doc__.splitlines()[0], argv) as backend:
        sgl.set_default_backend(backend)
        state = multi_turn_question.run(
            question_1="What is the capital of the United States?",
            question_2="List two local attractions.",
            temperature=0)
        for message in state.messages():
            print(f"{message['role']:>9}: {message['content']!r}")
        print("meta of answer_1:", state.get_meta_info("answer_1"))
        return state


# What this printed on the default model (SmolLM2-135M-Instruct, Q4_1 GGUF, bfloat16 on
# an AVX512-BF16 CPU), in-process:
#    system: 'You are a helpful assistant.'
#      user: 'What is the capital of the United States?'
# assistant: 'The capital of the United States is New York City.'
#      user: 'List two local attractions.'
# assistant: 'Two local attractions in New York City are the Statue of Liberty and the Empire
#             State Building.'
# meta of answer_1: {..., 'finish_reason': {'type': 'stop', 'matched': 2}, 'prompt_tokens': 29,
#                    'completion_tokens': 12, ...}


if __name__ == "__main__":
    main()
