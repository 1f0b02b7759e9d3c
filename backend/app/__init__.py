"""The application: the service the window and the command line drive (`service`; the
thread it runs on under a GUI, `backend_thread`), the pool of models and engines (`pool`:
its models, engines, settings and their file, and the steward of parked prefixes), the
Sessions view's rows (`session_rows`), the command line (`cli`: `main`, the parser
and `serve`; its other commands in `commands`), the end-to-end self-test, activity over time, the
desktop entry, sharing the port with a teammate on the LAN (`sharing`: mDNS, the client snippets,
`gguf-studio connect` and the client configuration it writes, the keys as people edit
and see them), the writer of the
window's files off its thread (`saver`), and the chat playground's conversation, sent
through the port like any client's (`chat_session`)."""
