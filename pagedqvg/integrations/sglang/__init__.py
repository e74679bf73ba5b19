"""pagedqvg inside SGLang 0.5.23's multimodal_gen: the cache classes SGLang's causal stages allocate (caches.py), their
allocation (allocation.py), install()/uninstall() (integration.py), the entry-point plugin (plugin.py), attention mode
`pages` (attention.py), per-request sessions (sessions.py), the hooked SGLang functions per version (versions.py) and
the process's one integration object (`runtime.integration()`). SGLang is imported only when called.
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
