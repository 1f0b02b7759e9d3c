"""GGUF Studio's Qt window: renders backend state and sends intent to the backend."""
