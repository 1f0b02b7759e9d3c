"""The engine: llama.cpp's `llama-server`, built from pinned sources and run here or watched
elsewhere.

Finds or builds the binary (`engine`, `accelerators`, `vulkan_headers`; the compilers and
build tools it runs, `build_tools`; its pinned
sources, checked before any use, `sources`, and our patches to them, `patches`; the
environment its processes get,
`environment`; its children started and ended so that no cancel leaves one running,
`child_process`), runs and supervises one load (`supervisor`; one started process of it and
its key, `engine_process`) or watches a remote one (`remote_engine`, asking it what it
keeps of a prompt: `prefix_probe`), lends this machine's
devices to an engine elsewhere and greets a load's workers (`rpc_worker`), measures how
fast an engine computes prompts and steps after each load (`engine_speed`), talks to its
own API (`api`), reads what it reported (`report`, `log`), knows its KV cache rules
(`kv_capacity`) and the chat template it renders chats with (`chat_template`), and keeps
slots saved to disk (`slot_parking`; the engine's slot actions it asks for, `slot_actions`).  `load` is the contract everything above uses: what
a load is asked for, the state it is in, and the `Serving` value that exists while it
serves.
"""
