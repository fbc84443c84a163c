"""A stand-in for ``torchvision``, installed only where the real one cannot import.

Not a look-alike of SGLang: SGLang's config package imports image-model
helpers (``sglang.srt.multimodal.internvl_utils``) that import
``torchvision.transforms`` at module level, and this machine has only a
CUDA build of torchvision, which fails on the CPU torch (``operator
torchvision::nms does not exist``). No grammar code uses it; every name
here is a placeholder that raises if it is ever called.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
import types

__all__ = ["install"]

_MODULES = ("torchvision", "torchvision.transforms", "torchvision.transforms.functional")


class _Placeholder:
    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> _Placeholder:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Placeholder(f"{self._name}.{attr}")

    def __call__(self, *args: object, **kwargs: object) -> None:
        raise RuntimeError(f"{self._name}: torchvision is not installed (test stand-in)")


def _module(name: str) -> types.ModuleType:
    mod = types.ModuleType(name)

    def attribute(attr: str) -> _Placeholder:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Placeholder(f"{name}.{attr}")

    mod.__getattr__ = attribute  # type: ignore[method-assign]
    mod.__path__ = []  # a package, so the submodules resolve
    mod.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
    mod.__version__ = "0.0.0+gramcoord-standin"
    return mod


def _real_torchvision_imports() -> bool:
    if importlib.util.find_spec("torchvision") is None:
        return False
    try:
        import torchvision.transforms  # noqa: F401
    except Exception:
        return False
    return True


def install() -> bool:
    """Put the stand-in in ``sys.modules`` unless a working torchvision exists."""
    if "torchvision" in sys.modules or _real_torchvision_imports():
        return False
    # transformers caches "torchvision is absent" before the stand-in exists,
    # so its image processors never reach for the stand-in.
    from transformers.utils import import_utils

    assert not import_utils.is_torchvision_available()
    for name in _MODULES:
        sys.modules[name] = _module(name)
    sys.modules["torchvision"].transforms = sys.modules["torchvision.transforms"]
    sys.modules["torchvision.transforms"].functional = sys.modules[
        "torchvision.transforms.functional"
    ]
    return True
