"""The verdict on an answer's prompt cache, without I/O: each miss reason, and the likely
causes of a changed prefix (the known breakers agents hit)."""

from __future__ import annotations

from typing import Any

from backend.admission.cache_misses import TurnRecord, Verdict, judge
from backend.admission.prompt import BLOCK_CHARS, prompt_blocks
from tests.backend.admission.chat_bodies import (AGENT, FIRST, HEAD, SECOND, TITLE, TOOLS, chat,
                                                 user)


def turn(body: dict[str, Any], tokens: int, engine: str | None = "e1",
         slot: int | None = None) -> TurnRecord:
    return TurnRecord(prompt_blocks(body), tokens, engine, slot)


def test_a_sessions_first_turn_is_its_own_reason():
    verdict = judge(None, prompt_blocks(FIRST), cached=0, computed=900, engine="e1")
    assert verdict == Verdict(0, 900, "first_turn")
    assert verdict.describe() == "first turn"


def test_a_turn_that_found_its_whole_previous_prompt_is_no_miss():
    verdict = judge(turn(FIRST, 900), prompt_blocks(SECOND), cached=899, computed=420,
                    engine="e1")
    assert not verdict.missed
    assert verdict.describe() == "cache hit"


def test_a_lost_prefix_on_the_same_engine_was_taken_by_another_session():
    verdict = judge(turn(FIRST, 900, slot=0), prompt_blocks(SECOND), cached=0, computed=1320,
                    engine="e1", slot=0)
    assert verdict.reason == "slot_taken"
    assert verdict.describe() == "slot given to another session"


def test_a_turn_on_another_engine_says_the_engine_changed():
    verdict = judge(turn(FIRST, 900, "e1"), prompt_blocks(SECOND), cached=300, computed=1020,
                    engine="e2")
    assert verdict.reason == "engine_changed"


def test_an_engine_gone_since_the_last_turn_says_unloaded():
    verdict = judge(turn(FIRST, 900, "e1"), prompt_blocks(SECOND), cached=0, computed=1320,
                    engine="e3", engine_alive=False)
    assert verdict.reason == "unloaded"
    # And a session whose prefix was known to live nowhere.
    assert judge(turn(FIRST, 900, None), prompt_blocks(SECOND), cached=0, computed=1320,
                 engine="e1").reason == "unloaded"


def test_a_restore_that_did_not_take_says_restored():
    verdict = judge(turn(FIRST, 900, "e1"), prompt_blocks(SECOND), cached=0, computed=1320,
                    engine="e2", engine_alive=False, restored=True)
    assert verdict.reason == "restored"
    # A restore that took is a hit like any other.
    assert not judge(turn(FIRST, 900, "e1"), prompt_blocks(SECOND), cached=899, computed=421,
                     engine="e2", engine_alive=False, restored=True).missed


def test_a_changing_line_near_the_start_is_named_with_the_token_where_the_prompt_changed():
    before = chat(user("list the files"), system="Date: 2026-12-01 18:40:01\n" + HEAD)
    after = chat(user("list the files"), {"role": "assistant", "content": "Here they are."},
                 user("open main.py"), system="Date: 2026-12-01 18:41:17\n" + HEAD)
    verdict = judge(turn(before, 900), prompt_blocks(after), cached=14, computed=1306,
                    engine="e1")
    assert (verdict.reason, verdict.at_token, verdict.cause) == (
        "prefix_changed", 14, "changing_line")
    assert verdict.describe() == "prefix changed at token 14 (a changing line near the start)"


def test_where_the_turn_ran_elsewhere_the_token_is_estimated_from_the_text():
    head = HEAD + "x" * (2 * BLOCK_CHARS - len(HEAD) % BLOCK_CHARS)  # whole blocks
    before = chat(user("list the files"), system=head + "Today: Monday.")
    after = chat(user("list the files"), system=head + "Today: Friday.")
    verdict = judge(turn(before, 1000), prompt_blocks(after), cached=0, computed=1000,
                    engine="e2")
    chars = prompt_blocks(before).chars
    assert verdict.reason == "prefix_changed"
    assert verdict.at_token == 1000 * (len(head) // BLOCK_CHARS * BLOCK_CHARS) // chars


def test_tools_rendered_differently_are_named():
    reordered = [{"function": t["function"], "type": t["type"]} for t in TOOLS]
    before = chat(user("list the files"), tools=TOOLS)
    after = chat(user("list the files"), {"role": "assistant", "content": "Here they are."},
                 user("open main.py"), tools=reordered)
    verdict = judge(turn(before, 1100), prompt_blocks(after), cached=700, computed=900,
                    engine="e1")
    assert (verdict.reason, verdict.cause) == ("prefix_changed", "tools_rerendered")


def test_an_earlier_answers_reasoning_dropped_from_the_history_is_named():
    answer = {"role": "assistant", "content": "Here they are.",
              "reasoning_content": "The user wants the files; I list them. " * 10}
    before = chat(user("list the files"), answer, user("open main.py"))
    after = chat(user("list the files"), {"role": "assistant", "content": "Here they are."},
                 user("open main.py"), {"role": "assistant", "content": "Opened."},
                 user("now run the tests"))
    verdict = judge(turn(before, 1500), prompt_blocks(after), cached=1200, computed=700,
                    engine="e1")
    assert (verdict.reason, verdict.cause) == ("prefix_changed", "reasoning_dropped")
    # The same with a <think> block at the start of the answer's text.
    thought = {"role": "assistant", "content": "<think>I list them.</think>Here they are."}
    before = chat(user("list the files"), thought, user("open main.py"))
    assert judge(turn(before, 1500), prompt_blocks(after), cached=1200, computed=700,
                 engine="e1").cause == "reasoning_dropped"


def test_a_rewritten_history_without_a_known_cause_names_none():
    before = chat(user("list the files"), {"role": "assistant", "content": "Here they are."},
                  user("open main.py"))
    after = chat(user("list the files"), {"role": "assistant", "content": "Files: a, b."},
                 user("open main.py"))
    verdict = judge(turn(before, 1500), prompt_blocks(after), cached=1100, computed=400,
                    engine="e1")
    assert (verdict.reason, verdict.cause) == ("prefix_changed", None)
    assert verdict.describe() == "prefix changed at token 1100"


def test_another_conversation_under_the_sessions_name_is_its_first_turn_not_a_miss():
    """OpenCode's agent turn after its title request shares nothing with it: not "prefix
    changed (tools re-rendered)", which the Sessions tab showed for every OpenCode session."""
    verdict = judge(turn(TITLE, 660), prompt_blocks(AGENT), cached=12, computed=2340,
                    engine="e1")
    assert verdict == Verdict(12, 2340, "first_turn")
    # The same conversation with its tools sent anew before its system prompt: a miss.
    with_tools = chat(user("list the files"), tools=TOOLS)
    verdict = judge(turn(FIRST, 900), prompt_blocks(with_tools), cached=12, computed=1100,
                    engine="e1")
    assert (verdict.reason, verdict.cause) == ("prefix_changed", "tools_rerendered")
