"""llama-server's slot actions: a recall is the request as answered before, made to
compute its prompt and one token in its slot."""

from __future__ import annotations

import json

from backend.llama.slot_actions import recall_body


def test_a_recalled_request_computes_its_prompt_and_one_token_in_its_slot():
    body = recall_body(b'{"model": "m", "messages": [], "stream": true, "max_tokens": 900,'
                       b' "stream_options": {"include_usage": true}}', 3)
    assert json.loads(body) == {"model": "m", "messages": [], "stream": False,
                                "max_tokens": 900, "id_slot": 3, "n_predict": 1,
                                "cache_prompt": True}
    # An Anthropic request keeps only its own fields: its one token is its max_tokens.
    anthropic = recall_body(b'{"model": "m", "system": "s", "messages": [], "stream": true,'
                            b' "max_tokens": 900}', 3, anthropic=True)
    assert json.loads(anthropic)["max_tokens"] == 1
    assert json.loads(anthropic)["stream"] is False
