"""A test-only stand-in for torchvision, put on sys.path before SGLang is imported.

SGLang imports torchvision at module level (for its image models' transforms). The registry's
torchvision builds are for CUDA PyTorch and fail to load beside the CPU build this tier uses
('operator torchvision::nms does not exist'). The memory pools and HiCache storage classes the
tests use never call it: every name here is a placeholder that raises if it is ever used.
"""

from __future__ import annotations

import sys
import types


class _Unavailable:
    """A name of torchvision's: using it says this is a stand-in."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"{self._name}: torchvision is a test stand-in here")

    def __getattr__(self, attr: str) -> "_Unavailable":
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Unavailable(f"{self._name}.{attr}")

    def __mro_entries__(self, bases):
        return (object,)


def _placeholder(prefix: str):
    def __getattr__(attr: str) -> _Unavailable:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Unavailable(f"{prefix}.{attr}")

    return __getattr__


def _module(name: str) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__getattr__ = _placeholder(name)  # type: ignore[method-assign]
    module.__path__ = []  # a package: its submodules are made on import
    return module


class _Finder:
    """Makes any torchvision.* submodule on import."""

    @staticmethod
    def find_spec(fullname, path=None, target=None):
        if not fullname.startswith("torchvision."):
            return None
        import importlib.machinery

        return importlib.machinery.ModuleSpec(fullname, _Loader())


class _Loader:
    @staticmethod
    def create_module(spec):
        return _module(spec.name)

    @staticmethod
    def exec_module(module):
        return None


sys.meta_path.append(_Finder())
__version__ = "0.0.0+stand-in"
__getattr__ = _placeholder("torchvision")
