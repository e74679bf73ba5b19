"""pagedqvg inside SGLang 0.5.23's multimodal_gen: the cache classes SGLang's causal stages allocate, the
entry-point plugin, attention mode `pages` and per-request sessions. SGLang is imported only when called.
"""

from pagedqvg.integrations.sglang.integration import (
    PagedCausalSelfAttentionKVCache,
    PagedQVGPackedCausalKVCache,
    install,
    installed,
    quant_config_from_sglang,
    shared_pool,
    uninstall,
)

__all__ = [
    "PagedCausalSelfAttentionKVCache",
    "PagedQVGPackedCausalKVCache",
    "install",
    "installed",
    "quant_config_from_sglang",
    "shared_pool",
    "uninstall",
]
