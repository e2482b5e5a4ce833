"""The context at the server's door, on both engines, with the ``openai`` client: a request
that does not say ``max_tokens`` gets the server's default cut to what fits its prompt; one
that asks for more than fits is a 400 naming ``max_tokens``; a prompt past the model's
positions (mlxcache: its ``max_position_embeddings``) is a 400 naming the prompt."""

from __future__ import annotations

import httpx
import pytest
from server_harness import MODEL, hybrid_engine, mlx_engine, serving

from servecore.errors import InvalidRequest


def _words(n: int) -> str:
    return " ".join(f"w{7 + i % 50}" for i in range(n))


def _engine(kind: str):
    if kind == "hybridattn":
        return hybrid_engine()  # max_context_len=96
    engine = mlx_engine(num_slots=256)
    engine.model.args.max_position_embeddings = 96  # a model of 96 positions
    return engine


@pytest.fixture(scope="module", params=["hybridattn", pytest.param("mlxcache",
                                                                     marks=pytest.mark.mlx)])
def server(request):
    engine = _engine(request.param)
    with serving(engine) as srv:
        yield srv
    engine.close()


def test_the_default_max_tokens_is_what_fits(server):
    client = server.openai()
    out = client.completions.create(model=MODEL, prompt=_words(90), temperature=0)
    assert out.usage.prompt_tokens == 90 and out.usage.completion_tokens <= 96 - 90 + 1
    if out.usage.completion_tokens == 96 - 90 + 1:  # cut by the context: said so
        assert out.choices[0].finish_reason == "length"
    r = httpx.post(server.base + "/completions", json={
        "model": MODEL, "prompt": _words(90), "max_tokens": 8})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


def test_a_prompt_past_the_models_positions_is_refused_naming_it(server):
    r = httpx.post(server.base + "/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": _words(120)}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    assert server.openai().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "w7"}], max_tokens=2).choices


@pytest.mark.mlx
def test_an_mlx_engine_refuses_what_passes_max_position_embeddings():
    engine = _engine("mlxcache")
    with pytest.raises(InvalidRequest) as e:
        engine.add_request([7] * 90, 8)
    assert (e.value.field, e.value.value) == ("max_tokens", 8)
    with pytest.raises(InvalidRequest) as e:
        engine.add_request([7] * 100, 1)
    assert (e.value.field, e.value.value) == ("prompt", 100)
    assert engine.room_for(90) == 7 and not engine.has_unfinished()
    engine.close()


def test_an_answer_cut_to_the_context_finishes_by_length():
    """The default max_tokens cut to what fits: an answer that reaches it says ``length``
    (it did not end by itself), on both APIs' streams and whole answers."""
    from servecore.testing import FakeEngine, word_tokenizer

    class Small(FakeEngine):
        def room_for(self, prompt_len):
            return 2

    with serving(Small(vocab_size=32, tokenizer=word_tokenizer(32))) as srv:
        client = srv.openai()
        out = client.completions.create(model=MODEL, prompt="w17")
        assert out.usage.completion_tokens == 2 and out.choices[0].finish_reason == "length"
        chunks = list(client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "w17"}], stream=True))
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
