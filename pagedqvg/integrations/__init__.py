"""Integrations of pagedqvg into serving frameworks. Each submodule imports its framework only when called.

- `pagedqvg.integrations.sglang`: SGLang 0.5.23's multimodal_gen causal KV caches (`install()` / `uninstall()`).
- `pagedqvg.integrations.sglang.plugin`: the entry-point plugin (environment variables, SGLang's hooks).
- `pagedqvg.integrations.sglang.sessions`: each allocation's caches one `SessionManager` session, closed at request end.
"""
