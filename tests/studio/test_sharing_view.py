"""The Sharing tab's advanced limits: edited in the window, they change what the running
port does at once and are remembered for the next start."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import httpx
from PySide6.QtCore import Qt

from backend.settings import Settings

WAIT = 15_000
PAGE = "https://app.example.com"
MiB = 1024 * 1024


def preflight(port: int) -> httpx.Response:
    """A browser's CORS preflight from PAGE for a chat completion (no model needed)."""
    return httpx.options(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=10,
                         headers={"Origin": PAGE, "Access-Control-Request-Method": "POST"})


def test_an_origin_allowed_in_the_window_gets_cors_answers_from_the_running_port(open_window, qtbot):
    window = open_window()
    window.show_sharing(keys=True)
    sharing = window.sharing
    qtbot.waitUntil(lambda: bool(sharing.urls), timeout=WAIT)
    port = window.bridge.gateway_port
    assert port is not None
    assert preflight(port).status_code == 403  # a page of another site: refused
    assert "default" in sharing.allow_origins.toolTip().lower()

    sharing.allow_origins.setText(f"{PAGE}, http://*.local:3000")
    sharing.allow_origins.editingFinished.emit()
    qtbot.waitUntil(lambda: window.bridge.service.settings.allow_origins
                    == [PAGE, "http://*.local:3000"], timeout=WAIT)

    answer = preflight(port)
    assert answer.status_code in (200, 204)
    assert answer.headers["access-control-allow-origin"] == PAGE
    assert window.bridge.gateway_port == port  # applied live, not by reopening the port
    assert Settings.load().allow_origins == [PAGE, "http://*.local:3000"]


def test_limits_edited_in_the_window_bind_the_running_port_and_are_saved(open_window, qtbot):
    window = open_window()
    window.show_sharing(keys=True)
    sharing = window.sharing
    defaults = Settings()
    assert sharing.max_connections.value() == defaults.max_connections
    assert sharing.waiting_bodies.value() == defaults.max_waiting_body_bytes // MiB
    for box, default in ((sharing.max_connections, "512"), (sharing.header_timeout, "30 s"),
                         (sharing.client_stall, "120 s"), (sharing.waiting_bodies, "256 MiB"),
                         (sharing.incoming_bodies, "64 MiB")):
        assert f"Default {default}" in box.toolTip()
    assert sharing.prompt_counts.value() == 0 and "twice the slots" in sharing.prompt_counts.toolTip()

    qtbot.waitUntil(lambda: bool(sharing.urls), timeout=WAIT)
    port = window.bridge.gateway_port
    assert port is not None
    models = f"http://127.0.0.1:{port}/v1/models"
    assert httpx.get(models, headers={"Host": "studio.lan"}, timeout=10).status_code == 403

    sharing.max_connections.setValue(64)
    sharing.header_timeout.setValue(1)
    sharing.client_stall.setValue(0)
    sharing.waiting_bodies.setValue(16)
    sharing.incoming_bodies.setValue(8)
    sharing.prompt_counts.setValue(3)
    sharing.max_body.setValue(1)
    sharing.allow_hosts.setText("studio.lan")
    sharing.allow_hosts.editingFinished.emit()

    def live() -> Settings:
        return window.bridge.service.settings

    qtbot.waitUntil(lambda: live().allow_hosts == ["studio.lan"], timeout=WAIT)
    assert (live().max_connections, live().header_timeout, live().client_stall_timeout,
            live().max_waiting_body_bytes, live().max_body_bytes) == (64, 1.0, 0.0, 16 * MiB, MiB)
    assert (live().max_incoming_body_bytes, live().max_prompt_counts) == (8 * MiB, 3)
    saved = Settings.load()
    assert (saved.max_connections, saved.header_timeout, saved.client_stall_timeout,
            saved.max_waiting_body_bytes, saved.allow_hosts) == (64, 1.0, 0.0, 16 * MiB, ["studio.lan"])
    assert (saved.max_incoming_body_bytes, saved.max_prompt_counts) == (8 * MiB, 3)

    # The running port follows: a client that sends half a head is cut off after 1 s
    # (the default would wait 30 s), and the allowed name is answered.
    assert window.bridge.gateway_port == port
    with socket.create_connection(("127.0.0.1", port), timeout=10) as slow:
        slow.sendall(b"GET /v1/models HTTP/1.1\r\n")
        started = time.monotonic()
        try:
            assert slow.recv(1024) == b""
        except ConnectionResetError:
            pass  # aborted: the same cut
        assert time.monotonic() - started < 5
    assert httpx.get(models, headers={"Host": "studio.lan"}, timeout=10).status_code != 403
    # A 2 MiB body is now too large (the default takes 32 MiB).
    big = {"model": "tiny", "messages": [{"role": "user", "content": "x" * (2 * MiB)}]}
    too_large = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=big, timeout=10)
    assert too_large.status_code == 413


def wheel_over(box, steps: int = 1) -> None:
    """One notch of the mouse wheel (up) over `box`, as Qt delivers it to the box."""
    from PySide6.QtCore import QPoint, QPointF, Qt
    from PySide6.QtGui import QWheelEvent
    from PySide6.QtWidgets import QApplication
    centre = QPointF(box.rect().center())
    event = QWheelEvent(centre, QPointF(box.mapToGlobal(centre)), QPoint(0, 0), QPoint(0, 120 * steps),
                        Qt.MouseButton.NoButton, Qt.KeyboardModifier.NoModifier,
                        Qt.ScrollPhase.NoScrollPhase, False)
    QApplication.sendEvent(box, event)


def test_scrolling_past_max_wait_leaves_it_and_the_running_port_alone(open_window, qtbot):
    """The wheel over a spin box the user did not click scrolls the page; it changed the
    running port's "Max wait" (600 s into 576 s) before."""
    window = open_window()
    window.show_sharing(keys=True)
    window.show()
    qtbot.waitExposed(window)
    sharing = window.sharing
    window.tabs.setCurrentIndex(next(i for i in range(window.tabs.count())
                                     if window.tabs.tabText(i) == "&Sharing"))
    sharing.limits_button.click()  # the limits are folded away at first
    box = sharing.queue_timeout
    running = window.bridge.service.settings.queue_timeout
    assert box.value() == running

    wheel_over(box, steps=3)
    box.editingFinished.emit()  # as leaving the page would
    assert box.value() == running and not box.hasFocus()
    assert window.bridge.service.settings.queue_timeout == running

    window.activateWindow()
    box.setFocus()
    qtbot.waitUntil(box.hasFocus, timeout=WAIT)
    wheel_over(box, steps=3)
    assert box.value() == running + 3  # clicked into, it takes the wheel
    box.editingFinished.emit()
    qtbot.waitUntil(lambda: window.bridge.service.settings.queue_timeout == running + 3, timeout=WAIT)


def test_every_spin_and_combo_box_of_the_window_waits_for_focus_before_the_wheel(open_window):
    from PySide6.QtWidgets import QAbstractSpinBox, QComboBox
    window = open_window()
    window.show_sharing(keys=True)
    window.show()
    boxes = window.findChildren(QAbstractSpinBox) + window.findChildren(QComboBox)
    assert len(boxes) > 10
    for box in boxes:
        assert box.focusPolicy() == Qt.FocusPolicy.StrongFocus  # a click or Tab, not the wheel
        before = box.value() if isinstance(box, QAbstractSpinBox) and hasattr(box, "value") \
            else box.currentIndex()
        wheel_over(box)
        after = box.value() if isinstance(box, QAbstractSpinBox) and hasattr(box, "value") \
            else box.currentIndex()
        name = box.accessibleName() or box.toolTip()[:40] or type(box).__name__
        assert (name, after) == (name, before)


ENROL_KEY = "owner-key-for-the-window-enrolment-0123"


def test_a_teammates_request_shows_its_code_and_approving_it_hands_the_key_over(
        open_window, qtbot):
    """`gguf-studio connect` asks the window's port for a key: the Sharing tab shows the
    name, address and code; Approve mints the key, which the waiting requester receives."""
    import concurrent.futures

    from PySide6.QtWidgets import QLabel, QPushButton

    from backend.keys.key_store import KeyStore

    Settings.load().replace(api_key=ENROL_KEY, accept_enrolments_until=time.time() + 600).save()
    window = open_window()
    window.show_sharing(keys=True)
    sharing = window.sharing
    qtbot.waitUntil(lambda: bool(sharing.urls), timeout=WAIT)
    root = f"http://127.0.0.1:{window.bridge.gateway_port}"
    asked = httpx.post(f"{root}/v1/enrolments", json={"name": "bob"}, timeout=10).json()

    qtbot.waitUntil(lambda: len(sharing.enrolment_rows) == 1, timeout=WAIT)
    (row,) = sharing.enrolment_rows
    (label,) = row.findChildren(QLabel)
    assert "bob" in label.text() and "127.0.0.1" in label.text() and asked["code"] in label.text()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        poll = pool.submit(httpx.get, root + asked["poll"], params={"wait": 20}, timeout=30)
        approve = next(b for b in row.findChildren(QPushButton) if b.text() == "Approve")
        qtbot.mouseClick(approve, Qt.MouseButton.LeftButton)
        dialog = sharing.approval  # the key's limits, as for a new key
        assert dialog is not None and dialog.name.text() == "bob" and dialog.name.isReadOnly()
        dialog.tokens_per_minute.setValue(20_000)
        qtbot.mouseClick(dialog.ok_button, Qt.MouseButton.LeftButton)
        answer = poll.result(30)

    assert answer.status_code == 200, answer.text
    assert answer.json()["api_key"].startswith("gs-")
    minted = KeyStore().get("bob")
    assert minted is not None and minted.tokens_per_minute == 20_000
    qtbot.waitUntil(lambda: not sharing.enrolment_rows, timeout=WAIT)
    assert not sharing.enrolments_box.isVisible()


def test_refuse_refuses_that_request_and_frees_its_row(open_window, qtbot):
    from PySide6.QtWidgets import QPushButton

    from backend.keys.key_store import KeyStore

    Settings.load().replace(api_key=ENROL_KEY, accept_enrolments_until=time.time() + 600).save()
    window = open_window()
    window.show_sharing(keys=True)
    sharing = window.sharing
    qtbot.waitUntil(lambda: bool(sharing.urls), timeout=WAIT)
    root = f"http://127.0.0.1:{window.bridge.gateway_port}"
    asked = httpx.post(f"{root}/v1/enrolments", json={"name": "mallory"}, timeout=10).json()
    qtbot.waitUntil(lambda: len(sharing.enrolment_rows) == 1, timeout=WAIT)

    refuse = next(b for b in sharing.enrolment_rows[0].findChildren(QPushButton)
                  if b.text() == "Refuse")
    qtbot.mouseClick(refuse, Qt.MouseButton.LeftButton)

    qtbot.waitUntil(lambda: not sharing.enrolment_rows, timeout=WAIT)
    answer = httpx.get(root + asked["poll"], timeout=10)
    assert answer.status_code == 403 and answer.json()["error"]["code"] == "enrolment_refused"
    assert KeyStore().records() == []


def test_approve_acts_on_the_request_the_dialog_showed_not_on_a_later_one_of_its_name(
        open_window, qtbot):
    """The name race: while the owner fills in the limits of carol's request (code
    shown), it expires and a stranger, who kept asking for that name, takes it with
    another code.  Approve then fails and says why; the stranger gets no key."""
    from PySide6.QtWidgets import QLabel, QPushButton

    from backend.keys.enrolments import PER_ADDRESS_BURST
    from backend.keys.key_store import KeyStore

    def lan_host(address: str) -> httpx.Client:
        return httpx.Client(base_url=f"http://127.0.0.1:{window.bridge.gateway_port}",
                            transport=httpx.HTTPTransport(local_address=address), timeout=30)

    Settings.load().replace(api_key=ENROL_KEY, enrolment_ttl=6.0,
                            accept_enrolments_until=time.time() + 600).save()
    window = open_window()
    window.show_sharing(keys=True)
    sharing = window.sharing
    qtbot.waitUntil(lambda: bool(sharing.urls), timeout=WAIT)
    with lan_host("127.0.0.2") as teammate, lan_host("127.0.0.3") as stranger, \
            lan_host("127.0.0.4") as stranger_elsewhere:
        asked = teammate.post("/v1/enrolments", json={"name": "carol"}).json()
        qtbot.waitUntil(lambda: len(sharing.enrolment_rows) == 1, timeout=WAIT)
        approve = next(b for b in sharing.enrolment_rows[0].findChildren(QPushButton)
                       if b.text() == "Approve")
        qtbot.mouseClick(approve, Qt.MouseButton.LeftButton)
        dialog = sharing.approval
        assert dialog is not None
        assert any(asked["code"] in label.text() for label in dialog.findChildren(QLabel))
        retries = [stranger.post("/v1/enrolments", json={"name": "carol"})
                   for _ in range(PER_ADDRESS_BURST + 2)]
        # Held until carol's request expires.
        assert teammate.get(asked["poll"], params={"wait": 20}).status_code == 404
        taken = stranger_elsewhere.post("/v1/enrolments", json={"name": "carol"}).json()
        assert taken["code"] != asked["code"] or taken["name"] != asked["name"]

        qtbot.mouseClick(dialog.ok_button, Qt.MouseButton.LeftButton)
        answer = stranger_elsewhere.get(taken["poll"], params={"wait": 2})

    assert answer.status_code == 200 and "api_key" not in answer.json(), answer.text
    assert KeyStore().get("carol") is None
    qtbot.waitUntil(lambda: f"not the one with code {asked['code']}"
                    in window.statusBar().currentMessage(), timeout=WAIT)
    assert [r.status_code for r in retries] == [409] * PER_ADDRESS_BURST + [429, 429]


def test_the_accept_requests_switch_opens_enrolment_for_its_minutes_and_says_until_when(
        open_window, qtbot):
    """A port with a key takes no enrolment request until the owner accepts them: the
    switch opens it for the minutes beside it on the running port (and is remembered),
    the tab says until when, and switching it off closes it again."""
    Settings.load().replace(api_key=ENROL_KEY).save()
    window = open_window()
    window.show_sharing(keys=True)
    sharing = window.sharing
    qtbot.waitUntil(lambda: bool(sharing.urls), timeout=WAIT)
    root = f"http://127.0.0.1:{window.bridge.gateway_port}"

    def ask(name: str) -> httpx.Response:
        return httpx.post(f"{root}/v1/enrolments", json={"name": name}, timeout=10)

    qtbot.waitUntil(lambda: "cannot ask for a key now" in sharing.enrolment_state.text(),
                    timeout=WAIT)
    assert not sharing.accept.isChecked()
    assert ask("bob").json()["error"]["code"] == "enrolment_closed"

    sharing.accept_minutes.setValue(5)
    started = time.time()
    qtbot.mouseClick(sharing.accept, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: "may ask for a key until" in sharing.enrolment_state.text(),
                    timeout=WAIT)
    closes = window.bridge.service.settings.accept_enrolments_until
    assert started + 300 <= closes <= time.time() + 300
    assert time.strftime("%H:%M", time.localtime(closes)) in sharing.enrolment_state.text()
    assert sharing.accept.isChecked()
    assert ask("bob").status_code == 202
    assert Settings.load().accept_enrolments_until == closes

    qtbot.mouseClick(sharing.accept, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: "cannot ask for a key now" in sharing.enrolment_state.text(),
                    timeout=WAIT)
    assert not sharing.accept.isChecked()
    assert ask("carol").json()["error"]["code"] == "enrolment_closed"


def test_announcing_on_the_network_is_a_setting_of_the_sharing_tab(open_window, qtbot):
    window = open_window()
    window.show_sharing(keys=True)
    sharing = window.sharing
    assert not sharing.advertise.isChecked()

    sharing.advertise_name.setText("Office box")
    sharing.advertise.setChecked(True)

    qtbot.waitUntil(lambda: window.bridge.service.settings.advertise, timeout=WAIT)
    assert window.bridge.service.settings.advertise_name == "Office box"
    # Shared on this computer only: not announced, and the tab says why.
    qtbot.waitUntil(lambda: "listens on this computer only" in sharing.announcement.text(),
                    timeout=WAIT)
    assert Settings.load().advertise and Settings.load().advertise_name == "Office box"


def test_a_base_url_shows_as_a_qr_code(open_window, qtbot):
    from PySide6.QtWidgets import QPushButton

    window = open_window()
    window.show_sharing(keys=True)
    sharing = window.sharing
    qtbot.waitUntil(lambda: bool(sharing.urls), timeout=WAIT)
    holder = sharing.url_rows[0].parentWidget()
    assert holder is not None
    button = next(b for b in holder.findChildren(QPushButton) if b.text() == "QR")

    qtbot.mouseClick(button, Qt.MouseButton.LeftButton)

    dialog = sharing.qr_dialog
    assert dialog is not None and dialog.isVisible()
    from PySide6.QtWidgets import QLabel
    image = next(label for label in dialog.findChildren(QLabel) if label.pixmap() is not None
                 and not label.pixmap().isNull())
    assert image.accessibleName() == f"QR code of {sharing.urls[0]}"
    assert image.pixmap().width() >= 21 * 6  # a version-1 code at least, 6 px a module
    dialog.close()


def test_the_tab_warns_when_another_device_answers_to_the_announced_name(
        open_window, qtbot, monkeypatch, with_engine: Path, tiny_model: Path):
    from zeroconf import IPVersion, ServiceInfo, Zeroconf

    from backend.app.sharing.discovery import ENV_INTERFACES, SERVICE_TYPE

    monkeypatch.setenv(ENV_INTERFACES, "127.0.0.1")
    # A device on the network announced "office" before the owner's port (a real mDNS
    # responder on this machine's loopback, as a device on the LAN would be).
    device = Zeroconf(interfaces=["127.0.0.1"], ip_version=IPVersion.V4Only)
    device.register_service(ServiceInfo(
        SERVICE_TYPE, f"office.{SERVICE_TYPE}", port=9, addresses=[socket.inet_aton("127.0.0.1")],
        server="impostor.local."))
    try:
        Settings(host="0.0.0.0", api_key="owner-key-of-the-sharing-tests-0123456",
                 advertise=True, advertise_name="office").save()
        window = open_window()
        # Relaunched shared on the LAN: announced once a model is ready.
        window.open_files([str(tiny_model)])
        qtbot.waitUntil(lambda: window.model_view.info is not None, timeout=WAIT)
        window.load_selected()
        window.show_sharing(keys=True)
        label = window.sharing.announcement

        qtbot.waitUntil(lambda: "office-2" in label.text(), timeout=WAIT)
        assert label.isVisible()
        assert "not 'office'" in label.text() and "posing as this port" in label.text()
        assert label.foregroundRole() == label.palette().ColorRole.WindowText  # not grey
    finally:
        device.unregister_all_services()
        device.close()
