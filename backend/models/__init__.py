"""Models: the GGUF files on this machine (`library`, `gguf_info`, and what each layer keeps
in memory `memory_layout`), the Hugging Face hub and its cache (`hub`, `download` and the
window's `download_queue`, `hf_cache`; a transfer's speed and time left,
`transfer_meter`), and whether a model fits this machine (`fit`); the names a model
answers to, and the one rule that keeps them apart (`model_names`)."""
