"""Put on PYTHONPATH of a real SGLang server on a CPU-only host (tests and
docs/sglang.md only): every SGLang process (server, scheduler, detokenizer)
then gets the test harness's stand-ins for the modules no CPU wheel
provides (sglang-kernel's ``sgl_kernel`` is a CUDA-13 build, torchvision's
ops link libtorch_cuda). Real installed modules still win."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import standins

standins.install()
