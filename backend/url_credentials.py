"""Credentials written into URLs (`http://user:password@host`), kept out of logs.

An upstream may be given as `http://user:password@host:8080`; the URL then travels with
the engine (its base URL is its key and its address), and every log line that names it,
ours or httpx's, would carry the password.  `hide_url_credentials` is the one scrub:
`hide_url_credentials_in_logs` puts it on every handler of the root logger, where the
command line and the window write their logs, and the terminal's status lines use it.
"""

from __future__ import annotations

import logging
import re

__all__ = ["UrlCredentialsFilter", "hide_url_credentials", "hide_url_credentials_in_logs"]

HIDDEN = "***"


def hide_url_credentials(text: str) -> str:
    """`text` with the userinfo of every URL in it replaced: http://***@host."""
    if "@" not in text or "://" not in text:
        return text  # the common case, cheaply
    return _USERINFO.sub(rf"\1{HIDDEN}@", text)


class UrlCredentialsFilter(logging.Filter):
    """Rewrites a record whose message carries a URL's userinfo (never drops one)."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        hidden = hide_url_credentials(message)
        if hidden != message:
            record.msg, record.args = hidden, None
        return True


def hide_url_credentials_in_logs() -> None:
    """Every handler of the root logger (call after configuring it) hides them."""
    for handler in logging.getLogger().handlers:
        if not any(isinstance(f, UrlCredentialsFilter) for f in handler.filters):
            handler.addFilter(UrlCredentialsFilter())


# --- helpers ----------------------------------------------------------------------------

# scheme:// then userinfo (anything up to an @ before the host's end); the host stays.
_USERINFO = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)[^/?#\s@]+@")
