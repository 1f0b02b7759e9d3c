"""The enrolment code: both ends of one connection work out the same code; any other end
(another requester, another address or port reached, another name) gives another."""

from __future__ import annotations

import re

from backend.keys.enrolment_code import enrolment_code, normal_address


def test_the_same_connection_and_name_give_the_same_code_on_both_screens():
    owner = enrolment_code("10.0.0.5", "10.0.0.7", 8899, "bob")
    teammate = enrolment_code("::ffff:10.0.0.5", "10.0.0.7", 8899, " bob ")

    assert owner == teammate
    assert re.fullmatch(r"[A-HJKMNP-Z2-9]{3}-[A-HJKMNP-Z2-9]{3}", owner)


def test_a_relay_between_them_changes_the_code():
    honest = enrolment_code("10.0.0.5", "10.0.0.7", 8899, "bob")
    others = {enrolment_code("10.0.0.66", "10.0.0.7", 8899, "bob"),  # the port sees the relay
              enrolment_code("10.0.0.5", "10.0.0.66", 8899, "bob"),  # the teammate reached it
              enrolment_code("10.0.0.5", "10.0.0.7", 8900, "bob"),
              enrolment_code("10.0.0.5", "10.0.0.7", 8899, "bob2")}

    assert honest not in others and len(others) == 4


def test_an_address_has_one_spelling_at_both_ends():
    assert normal_address("::ffff:10.0.0.5") == "10.0.0.5"
    assert normal_address("[FE80::1%eth0]") == "fe80::1"
    assert normal_address(" 10.0.0.5 ") == "10.0.0.5"
