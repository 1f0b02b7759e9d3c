"""The keys applied to the requests that wait and run, and watched while they do.

A key edited, revoked or expired while its requests wait: revoked and expired ones are
refused at once (401), edited ones wait under their new weight, band and concurrency;
running requests of a key that is gone end with an error event (`KeyWatch.apply`).  The
watch (`KeyWatch.watch`) looks every `KEY_CHECK_INTERVAL` seconds, also at the enrolment
requests and the enrolment window, and at the parked prefixes' TTL every
`PARKED_EXPIRY_INTERVAL`.  Once the keys changed, the sessions, cache figures, remembered
requests and parked prefixes of keys revoked or deleted go with them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable

from backend.admission.admission_registry import AdmissionRegistry
from backend.admission.caller import ADDRESS_FLOW, Caller
from backend.admission.flow_control import FlowControl
from backend.app.pool.parking_steward import ParkingSteward
from backend.errors import KeyRevoked
from backend.keys.enrolments import Enrolments
from backend.keys.key_store import CHAT_NAME, OWNER_NAME, KeyStore

__all__ = ["KEY_CHECK_INTERVAL", "PARKED_EXPIRY_INTERVAL", "KeyWatch"]

log = logging.getLogger("gguf_studio.service")

#: How often waiting requests are checked against their keys (revoked, expired, edited).
KEY_CHECK_INTERVAL = 0.5
#: How often parked prefixes are checked against their TTL (also on every look and save).
PARKED_EXPIRY_INTERVAL = 600.0


class KeyWatch:
    """The key store applied to the registry's waiting requests and the flows' running
    ones; `publish_window` tells the window's listeners of an enrolment window that moved."""

    def __init__(self, keys: KeyStore, registry: AdmissionRegistry, flows: FlowControl,
                 enrolments: Enrolments, parking: ParkingSteward,
                 publish_window: Callable[[], None]) -> None:
        self.keys = keys
        self.registry = registry
        self.flows = flows
        self.enrolments = enrolments
        self.parking = parking
        self._publish_window = publish_window
        #: The keys' generation whose gone keys were forgotten (`_forget_gone_keys`).
        self._keys_applied = -1
        self._next_expiry = 0.0

    async def watch(self) -> None:
        """Keys edited, revoked or expired while their requests wait: revoked and expired
        ones are refused at once (401), edited ones wait under their new weight, band
        and concurrency."""
        failing = ""
        while True:
            await asyncio.sleep(KEY_CHECK_INTERVAL)
            try:
                self.keys.refresh()
                self.apply()
                self.enrolments.sync()
                self._publish_window()  # an accept window ends, keys become required
                if time.monotonic() >= self._next_expiry:
                    self._next_expiry = time.monotonic() + PARKED_EXPIRY_INTERVAL
                    self.parking.expire()
                failing = ""
            except Exception as exc:  # one bad file or bug must not end the watch for good
                if repr(exc) != failing:  # logged once, not twice a second
                    log.exception("Checking the keys and enrolment requests failed; trying "
                                  "again every %gs.", KEY_CHECK_INTERVAL)
                failing = repr(exc)

    def apply(self) -> None:
        """Apply the key store as it is now to every request that waits or runs (a
        revoked, expired or deleted key's running ones end with an error event)."""
        now = time.time()
        for flow in self.registry.waiting_flows() | self.flows.running_flows():
            if flow.startswith(ADDRESS_FLOW):
                continue
            record = self.keys.get(flow)
            refusal = (KeyRevoked(f"The API key {flow!r} no longer exists.") if record is None
                       else record.refusal(now))
            if refusal is not None:
                self.registry.refuse_flow(flow, refusal)
                self.flows.end_flow(flow, refusal)
            elif record is not None:
                self.registry.update_flow(self.flows.flow_of(Caller(flow, record)))
        self._forget_gone_keys()

    def _forget_gone_keys(self) -> None:
        """Once the keys changed: the sessions, cache figures, remembered requests and
        parked prefixes (prompts at rest) of keys revoked or deleted go with them.  Only
        where every request needs a key: then every live flow is a key's."""
        if self.keys.generation == self._keys_applied or not self.keys.requires_keys():
            return
        self._keys_applied = self.keys.generation
        live = {OWNER_NAME, CHAT_NAME} | {r.name for r in self.keys.records()
                                          if r.revoked_at is None}
        self.registry.sessions.keep_flows(live)
        self.parking.keep_flows(live)
