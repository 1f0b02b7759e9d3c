"""The OpenAI-compatible port: who may talk to an engine, and the bytes between them.

Routes, keys and browser checks (`gateway`, `access_guard`), serving the socket
(`server`), the engine's tokenizer over HTTP (`tokenizer_client`, given to admission's
request planner), the relay of one exchange (`relay`, `client_watch`; the checked request
it is given, `gated_request`; its forwarding to the engine, `forwarding`; its answer's
stream, `stream_relay`, `sse`; the engine's progress on a long prompt, `prefill`; the
requests under way as the inspector shows them, `in_flight`; what it needs of its port,
`exchange_host`; what of the shared cache a named key is told, `own_prefix`; a resend
joining the request its client left, `resends`, and whom an answer goes to meanwhile,
`audience`; a ticket's wait after its load refused the connection, `refusal_retry`), the
upstream HTTP client (`upstream_http`: the connection pool; `http1_response`: the
sans-I/O parser of its answers; `upstream_errors`: the failures of both), TCP_NODELAY on the connections of both sides (`tcp_nodelay`), request
bodies (`request_body`, `request_fields`), error answers (`http_errors`), what `/health`
says (`health`), what it tells clients of its models (`catalog`), the app's answer to
where a model's requests go (`route`), a request's books closed once when it ends
(`settlement`), Prometheus metrics (`metrics`), the access log (`access_log`), the request
inspector (`request_log`) and its optional OpenTelemetry export (`tracing`), and the
enrolment endpoint a teammate without a key asks for one at (`enrolment_endpoint`).  What
is decided about a request (admission, fair share, limits, placement) lives in
`backend.admission`.
"""
