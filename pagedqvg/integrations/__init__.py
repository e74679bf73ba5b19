"""Integrations of pagedqvg into serving frameworks. Each submodule imports its framework only when called.

- `pagedqvg.integrations.sglang`: SGLang 0.5.23's multimodal_gen causal KV caches (`install()` / `uninstall()`).
"""
