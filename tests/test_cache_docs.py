"""The API explains itself: `help(PagedCausalKVCache)` (and the SGLang-signature classes) documents every
constructor argument, every public method and property, the arguments of `update_and_get_attention_kv`, and uses
no undefined contract symbols; references point to docs/SEMANTICS.md, which exists."""

from __future__ import annotations

import inspect
import pathlib
import pydoc
import re

import pytest

import pagedqvg
from pagedqvg.integrations.sglang.integration import PagedCausalSelfAttentionKVCache, PagedQVGPackedCausalKVCache

REPO = pathlib.Path(__file__).resolve().parent.parent
CLASSES = [pagedqvg.PagedCausalKVCache, PagedCausalSelfAttentionKVCache, PagedQVGPackedCausalKVCache]
# The contract's shorthand (docs/SEMANTICS.md): fine there, undefined in a docstring.
SYMBOL = re.compile(r"(?<![\w.\[`-])`?(G|L|E|P|PL|C|W|S|GS)`?(?![\w.(\]`-])")


def public_members(cls):
    for name, obj in inspect.getmembers(cls):
        if not name.startswith("_"):
            yield name, obj


def doc_of(obj) -> str:
    return (obj.__doc__ or "") if isinstance(obj, property) else (inspect.getdoc(obj) or "")


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_every_constructor_argument_is_documented(cls):
    doc = cls.__doc__ or ""
    missing = [p for p in inspect.signature(cls.__init__).parameters if p != "self" and not re.search(rf"\b{p}\b", doc)]
    assert not missing, f"{cls.__name__} docstring lacks constructor arguments {missing}"


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_every_public_method_and_property_has_a_docstring(cls):
    undocumented = [name for name, obj in public_members(cls) if callable(obj) or isinstance(obj, property)]
    undocumented = [name for name in undocumented if len(doc_of(getattr(cls, name, None) or cls.__dict__[name])) < 15]
    props = [n for n, o in public_members(cls) if isinstance(o, property) and len(o.__doc__ or "") < 15]
    assert not undocumented and not props, f"{cls.__name__}: no docstring for {undocumented + props}"


def test_update_documents_its_arguments_and_the_repeated_call():
    doc = doc_of(pagedqvg.PagedCausalKVCache.update_and_get_attention_kv)
    params = inspect.signature(pagedqvg.PagedCausalKVCache.update_and_get_attention_kv).parameters
    for name in params:
        if name != "self":
            assert re.search(rf"\b{name}\b", doc), name
    assert "repeated" in doc and "rewrites" in doc and "advance" in doc


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_no_undefined_symbols_and_references_exist(cls):
    text = pydoc.render_doc(cls, renderer=pydoc.plaintext)
    found = sorted({m.group(1) for m in SYMBOL.finditer(text)})
    assert not found, f"help({cls.__name__}) uses undefined symbols {found}"
    for ref in re.findall(r"[\w/]*SEMANTICS\.md", text):
        assert ref == "docs/SEMANTICS.md", ref
        assert (REPO / ref).is_file()


def test_the_symbol_check_can_fail():
    assert SYMBOL.search("slots `[0, E)` never roll") and SYMBOL.search("P = L - n") and SYMBOL.search("`W` in slots")
    assert not SYMBOL.search("CacheConfigError: a PoolExhaustedError, cache_size, E2E, [B, C]")
