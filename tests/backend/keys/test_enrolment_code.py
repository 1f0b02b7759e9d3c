"""The enrolment code: both ends of one connection work out the same code; any other end
(another requester, another address or port reached, another name) gives another; and
it is read as people type it."""

from __future__ import annotations

import re

from backend.keys.enrolment_code import as_code, enrolment_code, normal_address


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


def test_codes_are_read_as_people_type_them():
    assert as_code("abc def") == as_code("ABCDEF") == as_code(" abc-def ") == "ABC-DEF"
    assert as_code("carol") is None and as_code("bob-ann") is None  # O is no code letter
    assert as_code("ABC-DEF-G") is None
