"""Text a JSON parser accepts but that is not Unicode (a lone UTF-16 surrogate) is a 400 naming it, on every path
prompt text takes; never a 500."""

from __future__ import annotations

import httpx
import pytest

from tests.server.conftest import MODEL, LiveServer

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
_LONE = '"hi \\ud800 there"'  # JSON text: a valid escape, a lone high surrogate once parsed

# (id, path, raw JSON body)
CASES: list[tuple[str, str, str]] = [
    ("chat-string", CHAT, f'{{"model": "{MODEL}", "max_tokens": 2, "messages": [{{"role": "user", "content": '
                          f'{_LONE}}}]}}'),
    ("text-part", CHAT, f'{{"model": "{MODEL}", "max_tokens": 2, "messages": [{{"role": "user", "content": '
                        f'[{{"type": "text", "text": {_LONE}}}]}}]}}'),
    ("system-message", CHAT, f'{{"model": "{MODEL}", "max_tokens": 2, "messages": [{{"role": "system", "content": '
                             f'{_LONE}}}, {{"role": "user", "content": "hello"}}]}}'),
    ("streamed", CHAT, f'{{"model": "{MODEL}", "max_tokens": 2, "stream": true, "messages": [{{"role": "user", '
                       f'"content": {_LONE}}}]}}'),
    ("low-surrogate", CHAT, f'{{"model": "{MODEL}", "max_tokens": 2, "messages": [{{"role": "user", '
                            '"content": "x \\udc00"}]}'),
    ("completion-prompt", COMPLETIONS, f'{{"model": "{MODEL}", "max_tokens": 2, "prompt": {_LONE}}}'),
    ("completion-prompt-list", COMPLETIONS, f'{{"model": "{MODEL}", "max_tokens": 2, "prompt": [{_LONE}]}}'),
    ("completion-streamed", COMPLETIONS, f'{{"model": "{MODEL}", "max_tokens": 2, "stream": true, '
                                         f'"prompt": {_LONE}}}'),
]


def _post_raw(live: LiveServer, path: str, body: str) -> httpx.Response:
    return httpx.post(live.base_url + path, content=body.encode("ascii"),
                      headers={"content-type": "application/json"}, timeout=30)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_lone_surrogate_is_a_400_naming_it(live: LiveServer, case: tuple[str, str, str]) -> None:
    _, path, body = case
    r = _post_raw(live, path, body)
    assert r.status_code == 400, (r.status_code, r.text[:300])
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert "lone UTF-16 surrogate (U+D" in err["message"] and err["code"] == "invalid_request", err


def test_the_message_names_where(live: LiveServer) -> None:
    where = {"chat-string": "messages[0].content holds", "text-part": "messages[0].content[0].text holds",
             "system-message": "messages[0].content holds", "completion-prompt": "prompt holds"}
    for name, path, body in CASES:
        if name in where:
            message = _post_raw(live, path, body).json()["error"]["message"]
            assert message.startswith(where[name]) and "at character 3" in message, (name, message)


def test_paired_surrogates_are_one_character_and_served(live: LiveServer) -> None:
    # \ud83d\ude00 is a valid JSON spelling of one emoji: it must be served, not refused.
    body = (f'{{"model": "{MODEL}", "max_tokens": 2, "messages": [{{"role": "user", '
            '"content": "smile \\ud83d\\ude00"}]}')
    r = _post_raw(live, CHAT, body)
    assert r.status_code == 200, r.text[:300]
    assert r.json()["usage"]["completion_tokens"] >= 1


def test_server_serves_after_surrogates(live: LiveServer) -> None:
    for _, path, body in CASES:
        assert _post_raw(live, path, body).status_code == 400
    r = httpx.post(live.v1 + "/chat/completions", timeout=30,
                   json={"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200
    stats = live.wait_idle()
    assert stats["num_free_blocks"] == stats["num_usable_blocks"]
