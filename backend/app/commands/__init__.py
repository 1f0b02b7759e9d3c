"""The command line's commands that do not run the service: the engine, a model file and
this machine's devices (`cli_engine`: `engine status|path|build`, `inspect`,
`rpc-worker`), Hugging Face (`cli_hub`: `search`, `pull`, `hf-token`), named keys and
teammates' requests for one (`cli_keys`), and a running port's recent requests
(`cli_requests`).  The parser, `main` and `serve` are `backend.app.cli`'s; `connect`,
`self-test` and `install-desktop` live with their trades (the sharing room, the app)."""
