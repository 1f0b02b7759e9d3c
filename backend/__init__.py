"""GGUF Studio's core: engine, supervision, admission and the OpenAI-compatible port.

Never imports Qt: the headless `gguf-studio serve` runs exactly this.
"""
