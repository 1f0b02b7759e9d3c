"""The pool: the models this port serves and the engines that serve them (`pool`): its
models here, loaded, evicted and unloaded (`local_models`), its engines elsewhere
(`pool_upstreams`), what it says of them (`pool_status`), its settings (`pool_config`),
read from and written to the models file (`models_file`), the window's picture of it
(`pool_state`), and the steward that saves live sessions' prefixes before an engine goes
and restores them before their next turn (`parking_steward`; the slot files themselves
are `backend.llama.slot_parking`'s)."""
