"""The port announced on the LAN (mDNS on this machine's loopback): found by `browse`
with a record that holds no secret, and only when asked, beyond loopback, with a key;
renamed, and the owner warned, when another device already answers to its name."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from backend.app.sharing.discovery import ENV_INTERFACES, browse
from tests.backend.lan_harness import Impostor

OWNER_KEY = "owner-key-for-the-discovery-tests-0123"


@pytest.fixture(autouse=True)
def loopback_mdns(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_INTERFACES, "127.0.0.1")


async def test_an_announced_port_is_found_with_its_record_and_no_secret(running_service):
    service = await running_service(host="0.0.0.0", api_key=OWNER_KEY, advertise=True,
                                    advertise_name="Office box")
    await service.announced()
    assert service.advertiser.running, service.advertise_problem

    found = [port for port in await browse(2.0) if port.name == "Office box"]

    assert len(found) == 1, found
    (port,) = found
    assert port.port == service.gateway_port
    assert port.properties == {"v": "1", "version": port.properties["version"],
                               "enrol": "/v1/enrolments", "keys": "required"}
    assert OWNER_KEY not in repr(port)
    await service.stop_gateway()
    assert not service.advertiser.running


@pytest.mark.parametrize("settings, why", [
    ({"host": "127.0.0.1", "api_key": OWNER_KEY}, "listens on this computer only"),
    ({"host": "0.0.0.0", "allow_no_key": True}, "requires no key"),
])
async def test_a_port_on_loopback_or_without_a_key_is_not_announced(running_service, settings, why):
    service = await running_service(advertise=True, advertise_name="Hidden", **settings)
    await service.announced()

    assert not service.advertiser.running
    assert why in service.advertise_problem


async def test_a_port_not_asked_to_is_not_announced(running_service):
    service = await running_service(host="0.0.0.0", api_key=OWNER_KEY, advertise_name="Quiet")
    await service.announced()

    assert not service.advertiser.running and service.advertise_problem == ""


@pytest.fixture
async def impostor() -> AsyncIterator[Impostor]:
    device = Impostor()
    yield device
    await device.leave()


async def test_a_name_another_device_holds_is_announced_renamed_and_the_owner_is_warned(
        running_service, impostor):
    await impostor.announce("office", 9)
    service = await running_service(host="0.0.0.0", api_key=OWNER_KEY, advertise=True,
                                    advertise_name="office")
    await service.announced()

    assert service.advertiser.running, service.advertise_problem
    assert (service.advertiser.asked, service.advertiser.name) == ("office", "office-2")
    assert service.advertiser.renamed
    said = service.announcement()
    assert "'office-2', not 'office'" in said and "posing as this port" in said
    # Both answer, however late the impostor is.
    names = {port.name: port.port for port in await browse(3.0)}
    assert names == {"office": 9, "office-2": service.gateway_port}
