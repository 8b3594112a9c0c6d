"""Run the Triton kernels in Triton's CPU interpreter unless the tests target a GPU.

`TRITON_INTERPRET` must be set before the kernel modules are imported (Triton reads it when a
kernel is decorated), so it is set here, ahead of the test modules. `ARBORLM_TEST_DEVICE=cuda`
(what `benchmarks/gpu_check.py` sets) runs the same tests compiled on the GPU instead.
"""

import os

if os.environ.get("ARBORLM_TEST_DEVICE", "cpu") == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")
