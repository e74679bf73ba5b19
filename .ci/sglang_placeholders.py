"""Placeholder modules for SGLang's third-party imports that a CPU test never exercises (shared by
.ci/sglang_plugin.py, the pytest plugin of .ci/sglang_suite.sh, and .ci/sglang_runtime.sh, which loads this module
in every process, spawned SGLang workers included, through a .pth file).

Each top-level name in STUBBED resolves, only when that package is not installed at all, to a module whose
attributes are permissive placeholder classes. An installed package is always the real one, submodules included.
Nothing of a placeholder runs: a test that did call into one would fail on it, not pass silently.
"""

from __future__ import annotations

import abc
import importlib.abc
import importlib.machinery
import re
import sys
import types

# Top-level packages replaced by placeholders when missing (found by importing the three test files' imports).
STUBBED = frozenset(
    [
        "IPython",
        "httpx",
        "uvloop",
        "fastapi",
        "uvicorn",
        "imageio_ffmpeg",
        "aiohttp",
        "PIL",
        "addict",
        "cache_dit",
        "compressed_tensors",
        "diffusers",
        "dill",
        "einops",
        "gguf",
        "huggingface_hub",
        "imageio",
        "msgspec",
        "openai",
        "orjson",
        "partial_json_parser",
        "psutil",
        "pybase64",
        "pydantic",
        "pydantic_core",
        "regex",
        "requests",
        "safetensors",
        "scipy",
        "sentencepiece",
        "starlette",
        "torchvision",
        "tqdm",
        "transformers",
        "tvm_ffi",
        "yaml",
        "zmq",
    ]
)
stubbed_loaded: list[str] = []
#: Placeholders that transformers' availability checks (`_is_package_available`, its `find_spec` probe) must not
#: see: with a torchvision placeholder "available", transformers picks its torchvision image-processor backend
#: and fails on the placeholder (LingBot-World's CLIP image processor); hidden, it takes its PIL backend, as on a
#: machine without torchvision. SGLang's own module-level `import torchvision` still gets the placeholder.
HIDDEN_FROM_TRANSFORMERS = frozenset(["torchvision"])


class _StubMeta(abc.ABCMeta):
    """Placeholder classes: any attribute is another placeholder; usable as a base class, a decorator, a generic
    alias (`X[int]`, `X | None`), a registry (`X[k] = v`, `X.register(...)`)."""

    def __new__(mcs, name, bases, ns, **kw):
        return super().__new__(mcs, name, bases, ns)

    def __init__(cls, name, bases, ns, **kw):
        super().__init__(name, bases, ns)

    def __getattr__(cls, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return _placeholder(name)

    def __getitem__(cls, item):
        return cls

    def __setitem__(cls, key, value):
        pass

    def __contains__(cls, key):
        return False

    def __iter__(cls):
        return iter(())

    def __bool__(cls):
        return False

    def __or__(cls, other):
        return cls

    def __ror__(cls, other):
        return cls

    def register(cls, *args, **kwargs):
        return args[0] if args else None

    def __call__(cls, *args, **kwargs):
        if cls.__dict__.get("_root") and len(args) == 1 and callable(args[0]) and not kwargs:
            return args[0]  # used as a decorator
        return super().__call__(*args, **kwargs)


class _Placeholder(metaclass=_StubMeta):
    _root = True

    def __init__(self, *args, **kwargs):
        pass

    def __init_subclass__(cls, **kwargs):
        pass

    def __getattr__(self, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return _placeholder(name)

    def __call__(self, *args, **kwargs):
        return _placeholder("result")


def _placeholder(name: str) -> type:
    return _StubMeta(name, (_Placeholder,), {"_root": True})


class _StubModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__") and name.endswith("__"):
            if name == "__version__":
                return "0.0.0"
            raise AttributeError(name)
        value = _placeholder(name)
        setattr(self, name, value)
        return value


class _StubLoader(importlib.abc.Loader):
    def create_module(self, spec):
        module = _StubModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        stubbed_loaded.append(module.__name__)
        if module.__name__ == "regex":  # `import regex as re`: the stdlib module does what the imports need
            module.__dict__.update({k: v for k, v in vars(re).items() if not k.startswith("__")})
        elif module.__name__ == "dill":  # called at import time to serialise a class into a default string
            module.dumps = lambda *a, **k: b""
            module.loads = lambda *a, **k: None


def _asked_by_transformers_availability_check(depth: int = 8) -> bool:
    frame = sys._getframe(2)
    while frame is not None and depth > 0:
        if frame.f_code.co_name == "_is_package_available" and frame.f_globals.get("__name__", "").startswith(
            "transformers."
        ):
            return True
        frame, depth = frame.f_back, depth - 1
    return False


class _StubFinder(importlib.abc.MetaPathFinder):
    def __init__(self) -> None:
        self._installed: dict[str, bool] = {}

    def _is_installed(self, top: str) -> bool:
        if top not in self._installed:
            self._installed[top] = False  # while looking (the lookup re-enters this finder)
            found = False
            for finder in sys.meta_path:
                if finder is self:
                    continue
                try:
                    found = finder.find_spec(top, None) is not None
                except (ImportError, ValueError, AttributeError):
                    continue
                if found:
                    break
            self._installed[top] = found
        return self._installed[top]

    def find_spec(self, name, path, target=None):
        top = name.split(".")[0]
        if top not in STUBBED or self._is_installed(top):
            return None  # not ours, or the real package is installed: use it (submodules included)
        if top in HIDDEN_FROM_TRANSFORMERS and _asked_by_transformers_availability_check():
            return None
        return importlib.machinery.ModuleSpec(name, _StubLoader(), is_package=True)


if not any(isinstance(f, _StubFinder) for f in sys.meta_path):
    sys.meta_path.append(_StubFinder())
