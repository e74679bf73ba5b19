"""pytest plugin for .ci/sglang_suite.sh: run SGLang 0.5.23's own kv-cache unit tests, unmodified, against pagedqvg.

1. Stub modules for the third-party packages SGLang's import chain pulls in and the kv-cache tests never exercise
   (transformers, diffusers, PIL, ...): each name in STUBBED resolves, only when it is not installed, to a module
   whose attributes are permissive placeholder classes. Nothing of these packages runs in the tests; a test that
   did call into one would fail on a placeholder, not pass silently on it.
2. `pagedqvg.integrations.sglang.install()` before the test modules are imported, so every
   `CausalSelfAttentionKVCache` / `QVGPackedCausalKVCache` the tests build (directly or through the stages'
   `_allocate_causal_kv_cache`) is pagedqvg's, over one shared pool.

Set PAGEDQVG_SGLANG_INSTALL=0 to run the same tests against SGLang's own classes (the baseline).
"""

from __future__ import annotations

import abc
import importlib.abc
import importlib.machinery
import os
import re
import sys
import types

# Top-level packages replaced by placeholders when missing (found by importing the three test files' imports).
STUBBED = frozenset(
    [
        "IPython",
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


class _StubFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] not in STUBBED:
            return None
        for finder in sys.meta_path:
            if finder is self:
                continue
            try:
                if finder.find_spec(name, path, target) is not None:
                    return None  # the real package is installed: use it
            except (ImportError, ValueError, AttributeError):
                continue
        return importlib.machinery.ModuleSpec(name, _StubLoader(), is_package=True)


sys.meta_path.append(_StubFinder())
_patched: list[str] = []


def pytest_configure(config):
    if os.environ.get("PAGEDQVG_SGLANG_INSTALL", "1") != "0":
        from pagedqvg.integrations import sglang as pagedqvg_sglang

        _patched.extend(pagedqvg_sglang.install(budget_bytes=int(os.environ.get("PAGEDQVG_SGLANG_BUDGET", 256 << 20))))


def pytest_report_header(config):
    if not _patched:
        return ["pagedqvg: NOT installed (SGLang's own classes)"]
    return ["pagedqvg.integrations.sglang.install() patched:", *("  " + p for p in _patched)]


def _paged_caches_built() -> int:
    from pagedqvg.integrations import sglang as pagedqvg_sglang

    return sum(pool._owner_serial for pool in pagedqvg_sglang._pools.values())


def pytest_sessionfinish(session, exitstatus):
    # Installed but no pagedqvg cache was built: the tests ran on SGLang's own classes; that must not pass.
    if _patched and session.testscollected and _paged_caches_built() == 0:
        session.exitstatus = 1


def pytest_terminal_summary(terminalreporter):
    tops = sorted({name.split(".")[0] for name in stubbed_loaded})
    terminalreporter.write_line(f"placeholder modules used ({len(tops)}): {' '.join(tops)}")
    if _patched:
        terminalreporter.write_line(
            f"pagedqvg: install() patched {len(_patched)} bindings; {_paged_caches_built()} pagedqvg caches were "
            f"built in the shared pool(s)"
        )
    else:
        terminalreporter.write_line("pagedqvg: NOT installed (SGLang's own classes)")
