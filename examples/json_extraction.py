"""JSON extraction: `gen(json_schema=...)` makes the runtime decode only JSON that matches.

    python examples/json_extraction.py [--url URL]
"""

from __future__ import annotations

import json

from example_backend import backend_from_args

import arborlm as sgl

PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "city": {"type": "string", "maxLength": 12},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}


@sgl.function
def extract_person(s, text):
    s += sgl.system("Extract the person described in the text as JSON.")
    s += sgl.user(text)
    s += sgl.assistant(sgl.gen("person", json_schema=PERSON_SCHEMA, max_tokens=256))


def main(argv: list[str] | None = None) -> sgl.ProgramState:
    with backend_from_args(__doc__.splitlines()[0], argv) as backend:
        state = extract_person.run(
            text="Ada Lovelace, 36, lived in London and wrote the first program.",
            backend=backend, temperature=0)
        print("generated:", state["person"])
        try:
            print("parsed:", json.loads(state["person"]))
        except json.JSONDecodeError:
            reason = state.get_meta_info("person")["finish_reason"]
            print(f"not valid JSON: generation ended early ({reason})")
        return state


# What this printed on the default model (SmolLM2-135M-Instruct, Q4_1 GGUF, bfloat16 on
# an AVX512-BF16 CPU), in-process:
# generated: {"name": "Ada Lovelace", "age": 37, "city": "London"}
# parsed: {'name': 'Ada Lovelace', 'age': 37, 'city': 'London'}


if __name__ == "__main__":
    main()
