"""Admission: who is served next, where, and with how much of an engine.

No sockets: the port and the app do the I/O and ask this room to decide.  The queue of one
engine (`engine_queue`) and the line of one model (`line`; an engine as it reads one,
`line_engine`; the requests waiting for its model's first engine, `load_wait`), the
registry of lines keyed by the engines' base URLs (`admission_registry`), a waiting
request's ticket (`admission_ticket`), where a ticket sits (`placement`: an engine, by a
policy with its lifecycle; the second policy, `hash_ring`; `seat`: the slot it takes on
that engine), fair share between keys (`fair_queue` and its books, `lanes`; who a share
is owed to, `flow`), keys' token limits (`rate_limits`) and the flow of a caller (`caller`, `flow_control`), a request's
admission asked once (`request_planner`: its hint, blocks and plan), what a request needs
(`need_planner`; the counting rules `prompt_tokens`, reading the body's size in
`prompt_bytes`, and the output limit `output_limits`; the engine's tokenizer is given to
them; a session's next turn counted by what it adds to its last, `continued_turn`), how
many long cold prompts an engine computes at once beside its streams (`prefill_budget`),
what a request says of its session (`hint`, where a client's session name is bounded), the
session book, every session's state in one place (`session_book`), a prompt as the port
reads it once (`prompt`), why a prompt was recomputed (`cache_misses`), and each key's
share of what is kept per session (`flow_shares`).
"""
