"""Who may call the server (docs/server.md's security model), as a browser and the real
clients call it: a web page's cross-site POST (a form or ``text/plain`` body, which needs no
CORS preflight) generates nothing; an origin the server allows gets CORS; with an API key,
the ``openai`` and ``anthropic`` clients pass with the key and fail without it."""

from __future__ import annotations

import json

import httpx
import pytest
from server_harness import MODEL, serving

from servecore.testing import FakeEngine, word_tokenizer

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "w7"}], "max_tokens": 2}


def _engine() -> FakeEngine:
    return FakeEngine(vocab_size=32, tokenizer=word_tokenizer(32))


@pytest.mark.parametrize("content_type", ["text/plain;charset=UTF-8",
                                          "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x"])
def test_a_body_that_is_not_json_is_refused_unread(content_type):
    engine = _engine()
    with serving(engine) as srv:
        r = httpx.post(srv.base + "/chat/completions", content=json.dumps(CHAT),
                       headers={"content-type": content_type})
        assert r.status_code == 415 and r.json()["error"]["param"] == "content-type"
        assert engine.core.requests == {}  # nothing reached the engine


def test_a_web_page_of_another_origin_is_refused():
    """What a page on another site sends with ``fetch(url, {method: "POST", body})``: a
    simple request with its Origin, which the browser sends without asking first."""
    engine = _engine()
    with serving(engine) as srv:
        for headers in ({"origin": "https://evil.example", "content-type": "text/plain"},
                        {"origin": "https://evil.example", "content-type": "application/json"},
                        {"origin": "null"}):  # a sandboxed frame or a file:// page
            r = httpx.post(srv.base + "/chat/completions", content=json.dumps(CHAT),
                           headers=headers)
            assert r.status_code == 403, headers
            assert "--allowed-origins" in r.json()["error"]["message"]
        assert engine.core.requests == {}
        assert httpx.post(srv.base + "/chat/completions", json=CHAT).status_code == 200


def test_an_allowed_origin_gets_cors_and_its_preflight_answered():
    page = "http://localhost:3000"
    with serving(_engine(), allowed_origins=[page]) as srv:
        pre = httpx.options(srv.base + "/chat/completions", headers={
            "origin": page, "access-control-request-method": "POST",
            "access-control-request-headers": "content-type"})
        assert pre.status_code == 204
        assert pre.headers["access-control-allow-origin"] == page
        assert "content-type" in pre.headers["access-control-allow-headers"]
        r = httpx.post(srv.base + "/chat/completions", json=CHAT, headers={"origin": page})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == page
        other = httpx.post(srv.base + "/chat/completions", json=CHAT,
                           headers={"origin": "http://localhost:3001"})
        assert other.status_code == 403


def test_an_api_key_is_needed_by_every_v1_route_and_both_clients_send_it():
    openai = pytest.importorskip("openai")
    anthropic = pytest.importorskip("anthropic")
    with serving(_engine(), api_key="s3cret") as srv:
        good = openai.OpenAI(base_url=srv.base, api_key="s3cret", max_retries=0)
        bad = openai.OpenAI(base_url=srv.base, api_key="wrong", max_retries=0)
        assert good.chat.completions.create(**CHAT).choices[0].message.content
        with pytest.raises(openai.AuthenticationError):
            bad.chat.completions.create(**CHAT)
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
        msg = dict(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "w7"}])
        claude = anthropic.Anthropic(base_url=srv.url, api_key="s3cret", max_retries=0)
        assert claude.messages.create(**msg).content[0].text
        with pytest.raises(anthropic.AuthenticationError):
            anthropic.Anthropic(base_url=srv.url, api_key="no", max_retries=0).messages.create(
                **msg)
        assert httpx.get(srv.url + "/health").status_code == 200  # open: a probe's route
        r = httpx.post(srv.base + "/completions", json={"model": MODEL, "prompt": "w5"})
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"


@pytest.mark.parametrize("raw", [
    '{"model": "%s", "messages": [{"role": "user", "content": "w7"}], "\\ud800x": 1}',
    '{"model": "%s", "messages": [{"role": "user", "content": "w7 \\udfff"}]}',
    '{"model": "%s", "prompt": ["w7", "\\ud800"]}',
])
def test_a_lone_surrogate_anywhere_is_a_400_naming_where(raw):
    """JSON may escape half of a UTF-16 pair, which is no text: a field's name or value that
    holds one is refused at the door (before: a 500 with a traceback in the log)."""
    engine = _engine()
    with serving(engine) as srv:
        route = "/completions" if "prompt" in raw else "/chat/completions"
        r = httpx.post(srv.base + route, content=raw % MODEL,
                       headers={"content-type": "application/json"})
        assert r.status_code == 400, r.text
        assert "lone UTF-16 surrogate" in r.json()["error"]["message"]
        raw_bytes = (raw % MODEL).replace("\\ud800", "\ud800").replace("\\udfff", "\udfff")
        r = httpx.post(srv.base + route, content=raw_bytes.encode("utf-8", "surrogatepass"),
                       headers={"content-type": "application/json"})  # encoded, not escaped
        assert r.status_code == 400 and "lone UTF-16 surrogate" in r.json()["error"]["message"]
        ok = httpx.post(srv.base + "/chat/completions", json={**CHAT, "messages": [
            {"role": "user", "content": "w7 \U0001F600"}]})  # a pair is text: served
        assert ok.status_code == 200
