"""Stand-ins for the GPU-only modules SGLang imports at module level.

SGLang's disaggregation code runs on CPU, but importing it reaches triton,
tvm_ffi, torchvision and CUDA kernel packages through shared utility modules.
These stand-ins exist in the test harness only, never in kvconn_sglang: a
real SGLang host has the real modules. Anything called on a stand-in that the
disaggregation path actually needs would show up as a test failure, because a
stand-in returns stand-ins, never numbers.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from collections.abc import Sequence
from typing import Any

GPU_ONLY_TOP_LEVEL = ("triton", "tvm_ffi", "sgl_kernel", "flashinfer", "deep_gemm", "torchvision")
# transformers probes these with find_spec and then reads their metadata:
# it must keep seeing them as absent, so its probes run before the stand-ins.
_PROBED_BY_TRANSFORMERS = (
    "is_torchvision_available",
    "is_torchvision_v2_available",
    "is_torchcodec_available",
)

#: Real triton on a host with no GPU driver raises when asked for the active
#: driver's target (SGLang's kernels then fall back to "cpu"): so does this.
_NO_DRIVER = "triton.runtime.driver."


class _StandInMeta(type):
    """Every stand-in is a class, so torch's isinstance checks and subclassing work."""

    def __getattr__(cls, item: str) -> Any:
        if item.startswith("__") and item.endswith("__"):
            raise AttributeError(item)
        return _stand_in(f"{cls.__qualname__}.{item}")

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        if cls.__qualname__.startswith(_NO_DRIVER):
            raise RuntimeError("0 active drivers (triton stand-in: no GPU here)")
        # Used as a bare decorator (@triton.jit): hand the function back.
        if len(args) == 1 and not kwargs and callable(args[0]):
            return args[0]
        return _stand_in(f"{cls.__qualname__}()")

    def __getitem__(cls, item: Any) -> Any:
        return _stand_in(f"{cls.__qualname__}[]")


def _stand_in(name: str) -> Any:
    return _StandInMeta(name.rsplit(".", 1)[-1], (), {"__qualname__": name})


class _StandInModule(types.ModuleType):
    def __getattr__(self, item: str) -> Any:
        if item.startswith("__") and item.endswith("__"):
            raise AttributeError(item)
        return _stand_in(f"{self.__name__}.{item}")


class _StandInFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname.split(".")[0] not in GPU_ONLY_TOP_LEVEL:
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = _StandInModule(spec.name)
        module.__path__ = []
        module.__version__ = "0.0.0+standin"
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        return None


def install() -> None:
    """Put the stand-ins behind every real module: a real triton wins."""
    if any(isinstance(f, _StandInFinder) for f in sys.meta_path):
        return
    import transformers.utils.import_utils as probes

    for name in _PROBED_BY_TRANSFORMERS:
        probe = getattr(probes, name, None)
        if probe is not None:
            probe()  # cached by transformers: stays False once the stand-ins are in
    sys.meta_path.append(_StandInFinder())
