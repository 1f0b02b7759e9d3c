"""The OpenAI-compatible port: who may talk to an engine now, and the bytes between them.

Routes, keys and browser checks (`gateway`, `access_guard`), serving the socket
(`server`), admission by slots and KV tokens (`admission`, `admission_registry`,
`admission_ticket`; where a ticket sits: `placement`), what a request needs
(`need_planner`; the counting rules `prompt_tokens`, and `tokenizer_client`, the
engine's tokenizer they are given), the relay of one exchange (`relay`, `client_watch`,
`sse`), the upstream HTTP client (`upstream_http`: the connection pool;
`http1_response`: the sans-I/O parser of its answers; `upstream_errors`: the failures of
both), TCP_NODELAY on the connections of both sides (`tcp_nodelay`), request bodies
(`request_body`), error answers (`http_errors`), metrics and the access log, and the
enrolment endpoint a teammate without a key asks for one at (`enrolment_endpoint`).
"""
