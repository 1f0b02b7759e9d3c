"""The application: what the window and the command line drive.

Its own modules: the service (`service`; the thread it runs on under a GUI,
`backend_thread`; the writer of the window's files off that thread, `saver`), the command
line's entry (`cli`: `main`, the parser and `serve`), the end-to-end self-test
(`self_test`), what the port is doing over the last minutes (`activity`), the Sessions
view's rows (`session_rows`), one model's account under its own heading in the window
(`model_account`), what loading or unloading a model means for the port's users, asked
before it happens (`model_swap`), the request inspector's records kept across restarts
(`request_history`), the keys applied to the requests that wait and run, and watched while
they do (`key_watch`), the Chat tab's conversation, sent through the port like
any client's (`chat_session`), the desktop's menu entry (`desktop_entry`) and the system
libraries Qt's X11 plugin needs, checked before Qt is (`desktop_libraries`).

Its sub-rooms, below those modules (the service and `serve` drive them):

- `pool`: the models this port serves and the engines that serve them, their settings and
  their file, and the steward of parked prefixes;
- `sharing`: sharing the port with a teammate on the LAN: mDNS, the client snippets,
  `gguf-studio connect` and the client configuration it writes, the named keys as people
  edit and see them;
- `commands`: the command line's commands that do not run the service (engine, hub, keys,
  requests).
"""
