"""Every error GGUF Studio raises on purpose.

Messages are written for the person reading them: they never contain ports, stack
traces or internal ids.  Errors that reach an HTTP client carry their OpenAI-style
`code` and `type`; the gateway turns them into answers in one place
(`backend.port.http_errors.error_response`).
"""

from __future__ import annotations


class StudioError(Exception):
    """Base class: `str(error)` is a complete, user-readable sentence."""


# --- engine -----------------------------------------------------------------------


class EngineError(StudioError):
    """Finding or building llama-server went wrong."""


class EngineNotFound(EngineError):
    pass


class BuildToolMissing(EngineError):
    """No C/C++ compiler, CMake or Ninja."""


class EngineBuildFailed(EngineError):
    def __init__(self, message: str, log_tail: str = "") -> None:
        super().__init__(message)
        self.log_tail = log_tail


# --- models -----------------------------------------------------------------------


class ModelFileError(StudioError):
    """A file that is not a readable GGUF model (missing, truncated, a directory...)."""


# --- Hugging Face (search and downloads) ---------------------------------------------


class HubError(StudioError):
    """Searching, listing or downloading from Hugging Face went wrong."""


class HubUnreachable(HubError):
    """No answer from the hub: offline, DNS, a proxy, a timeout."""


class HubAccessDenied(HubError):
    """401/403: a gated or private repository, or a token that does not grant access."""


class HubNotFound(HubError):
    """404: no such repository, revision or file."""


class DownloadFailed(HubError):
    """A download stopped for a local reason (disk full, permission denied...)."""


class ChecksumMismatch(DownloadFailed):
    """The downloaded bytes do not match the SHA-256 the repository publishes."""


class WrongSize(DownloadFailed):
    """The hub sent more or fewer bytes than it announced for a file."""


class UnsafeHubAnswer(HubError):
    """A value from the hub (a commit id, checksum or file name) that could lead a path
    out of the cache, or a saved download naming one; refused before touching the disk."""


# --- supervision ------------------------------------------------------------------


class LoadError(StudioError):
    """A model load did not reach the ready state."""

    def __init__(self, message: str, log_tail: str = "") -> None:
        super().__init__(message)
        self.log_tail = log_tail


class EngineExitedDuringLoad(LoadError):
    pass


class GpuLoadFailed(EngineExitedDuringLoad):
    """The engine stopped while putting the model on the GPU; a CPU load may still work."""


class LoadTimedOut(LoadError):
    pass


class RpcWorkerFailed(LoadError):
    """A load's RPC worker cannot serve it: unreachable, busy with another engine, of
    another protocol version, or gone while the model loaded; or this engine lacks RPC."""


class RpcWorkerRefused(StudioError):
    """`gguf-studio rpc-worker` will not start as asked (a non-loopback address without
    the flag that accepts the risk, an address the RPC server cannot bind)."""


class LoadSuperseded(LoadError):
    """Another load or an unload replaced this one before it became ready."""


# --- settings ---------------------------------------------------------------------


class SettingsError(StudioError):
    """A setting, flag or environment variable has an unusable value."""


class KeyStoreError(SettingsError):
    """The named keys' file is unreadable, or a change to a key is unusable (a duplicate
    name, a date in the past, a weight of zero...)."""


# --- requests (answered over HTTP) ---------------------------------------------------


#: Retry-After, in seconds, for a refusal that a retry shortly will likely get past
#: (a load starting, replaced or restarting; the engine briefly unreachable).
RETRY_SOON = 5.0


class RequestError(StudioError):
    """An error that becomes an OpenAI-style answer to one HTTP request."""

    status: int = 500
    type: str = "server_error"
    code: str = "internal_error"
    retry_after: float | None = None

    def __init__(self, message: str, *, param: str | None = None,
                 retry_after: float | None = None) -> None:
        super().__init__(message)
        self.param = param
        if retry_after is not None:
            self.retry_after = retry_after

    def answer_headers(self) -> dict[str, str]:
        """Headers its HTTP answer carries beyond the body's and Retry-After."""
        return {}


class InvalidRequest(RequestError):
    status, type, code = 400, "invalid_request_error", "invalid_request"


class BodyTooLarge(RequestError):
    status, type, code = 413, "invalid_request_error", "request_too_large"


class RequestTimeout(RequestError):
    """A request's body came too slowly: its answer closes the connection, whose body
    is left unread (a client trickling it must not keep the socket)."""

    status, type, code = 408, "invalid_request_error", "request_timeout"

    def answer_headers(self) -> dict[str, str]:
        return {"Connection": "close"}


class Unauthorized(RequestError):
    status, type, code = 401, "invalid_request_error", "invalid_api_key"


class KeyRevoked(Unauthorized):
    """A named key its owner revoked: refused at once, also while it waits in line."""


class KeyExpired(Unauthorized):
    """A named key past its expiry date."""


class ModelNotAllowed(RequestError):
    """A named key asked for a model outside the models it may use."""

    status, type, code = 403, "invalid_request_error", "model_not_allowed"


class RateLimitExceeded(RequestError):
    """A named key is over its tokens per minute (`reason` "tokens_per_minute") or its
    tokens per day ("tokens_per_day"); see backend.admission.rate_limits.  `headers` are the
    answer's extra headers (`retry-after-ms`, OpenAI's `x-ratelimit-*`); `retry_after`
    is None when the request can never fit the limit (it is larger than the limit)."""

    # OpenAI's own 429 for a token limit has type "tokens", code "rate_limit_exceeded".
    status, type, code = 429, "tokens", "rate_limit_exceeded"

    def __init__(self, message: str, *, reason: str, retry_after: float | None,
                 headers: dict[str, str]) -> None:
        super().__init__(message, retry_after=retry_after)
        self.reason = reason
        self.headers = headers

    def answer_headers(self) -> dict[str, str]:
        return self.headers


class ForbiddenOrigin(RequestError):
    """A web page of an origin the user did not allow (see backend.port.access_guard)."""

    status, type, code = 403, "invalid_request_error", "origin_not_allowed"


class ForbiddenHost(RequestError):
    """A Host name that is not this machine's: what a DNS-rebinding page sends."""

    status, type, code = 403, "invalid_request_error", "host_not_allowed"


class UnsupportedContentType(RequestError):
    """A keyless POST whose body is not declared JSON (a page can send it unasked)."""

    status, type, code = 415, "invalid_request_error", "unsupported_content_type"


class TooManyKeyFailures(RequestError):
    """Repeated wrong or missing keys from one address: wait before trying again."""

    status, type, code = 429, "invalid_request_error", "too_many_failed_keys"


class NotFound(RequestError):
    status, type, code = 404, "invalid_request_error", "not_found"


class MethodNotAllowed(RequestError):
    status, type, code = 405, "invalid_request_error", "method_not_allowed"


class UpgradeRequired(RequestError):
    status, type, code = 426, "invalid_request_error", "websocket_not_supported"


class ContextLengthExceeded(RequestError):
    """A request's prompt plus output budget can never fit one request's share of
    the engine's context, so it is refused before the engine computes anything."""

    status, type, code = 400, "invalid_request_error", "context_length_exceeded"

    def __init__(self, *, prompt_tokens: int, output_tokens: int, limit: int) -> None:
        output = (f" plus {output_tokens:,} tokens of output budget" if output_tokens
                  else "")
        super().__init__(
            f"This model's context allows at most {limit:,} tokens per request, but "
            f"this request needs {prompt_tokens + output_tokens:,}: {prompt_tokens:,} "
            f"prompt tokens{output}. Shorten the messages or lower the output limit.")
        self.prompt_tokens = prompt_tokens
        self.output_tokens = output_tokens
        self.limit = limit


class NoChatTemplate(RequestError):
    """A chat route for a model that has no chat template (its file carries none and its
    owner picked none, or the owner turned it off): llama-server would render the chat
    with its fallback and the model answer junk.  `/v1/completions` takes plain prompts."""

    status, type, code = 400, "invalid_request_error", "model_has_no_chat_template"

    def __init__(self, model: str, *, turned_off: bool = False) -> None:
        why = ("is served without a chat template" if turned_off else "has no chat template")
        super().__init__(
            f"The model {model} {why}, so it cannot take chat requests: send a plain prompt "
            "to /v1/completions, or ask its owner to pick a chat template for it.",
            param="model")


class QueueFull(RequestError):
    status, type, code = 429, "server_error", "server_is_overloaded"


class BodiesInFlightFull(RequestError):
    """The request bodies being read, parsed and counted fill the port's budget."""

    status, type, code = 429, "server_error", "bodies_in_flight_full"


class CountingFull(RequestError):
    """The engine counts as many prompts at once as the port lets it."""

    status, type, code = 429, "server_error", "prompt_counts_full"


class ModelNotReady(RequestError):
    status, type, code = 503, "server_error", "model_not_ready"


class ModelNotFound(RequestError):
    """The request names a model this port does not serve; the message lists those it does."""

    status, type, code = 404, "invalid_request_error", "model_not_found"


class QueueTimeout(RequestError):
    status, type, code = 503, "server_error", "queue_timeout"


class UpstreamUnavailable(RequestError):
    """The engine could not be reached before anything was sent to the client."""

    status, type, code = 502, "server_error", "upstream_unavailable"


class UpstreamFailed(RequestError):
    """The engine died or broke off while a response was under way."""

    status, type, code = 502, "server_error", "upstream_failed"


class LoadReplaced(RequestError):
    """The model was unloaded or replaced while this request still ran on it."""

    status, type, code = 503, "server_error", "model_reloaded"


# --- enrolment (a teammate asks for a key; backend.keys.enrolments) --------------------------


class EnrolmentClosed(RequestError):
    """This port takes no enrolment requests (it requires no key, or the owner closed it)."""

    status, type, code = 404, "invalid_request_error", "enrolment_closed"


class EnrolmentNotFound(RequestError):
    """No enrolment request by that id: it expired, was delivered, or never was."""

    status, type, code = 404, "invalid_request_error", "enrolment_not_found"


class EnrolmentRefused(RequestError):
    status, type, code = 403, "invalid_request_error", "enrolment_refused"


class EnrolmentNameTaken(RequestError):
    """The name is a key's or a waiting request's (the answer does not say which)."""

    status, type, code = 409, "invalid_request_error", "name_taken"


class EnrolmentNotMade(RequestError):
    """The owner approved the request, but its key could not be made when collected (a
    key of that name was made meanwhile, or the approved expiry passed)."""

    status, type, code = 409, "invalid_request_error", "enrolment_not_made"


class EnrolmentsFull(RequestError):
    """As many enrolment requests wait for the owner as the port keeps."""

    status, type, code = 429, "server_error", "enrolments_full"


class TooManyEnrolments(RequestError):
    """Enrolment requests come faster than the port takes them (from one address, or all)."""

    status, type, code = 429, "invalid_request_error", "too_many_enrolments"


class TooManyPolls(RequestError):
    """An enrolment request is polled by more connections at once than one requester
    needs, or the port holds as many polls as it keeps open."""

    status, type, code = 429, "invalid_request_error", "too_many_polls"


class KeylessRequestsFull(RequestError):
    """The port holds as many requests without a key (enrolment) as it keeps open at
    once: the connection is closed with the answer, its body left unread."""

    status, type, code = 429, "server_error", "keyless_requests_full"

    def answer_headers(self) -> dict[str, str]:
        return {"Connection": "close"}


class ConnectCommandFailed(StudioError):
    """`gguf-studio connect` could not find, reach or enrol with a port."""
