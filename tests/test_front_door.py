"""The front door: both engines present one set of calls (``servecore.client.EngineClient``)
with one signature each, refuse a request with a typed error that names its field, and the
docs' examples of those calls run on both; the server touches the engine through the front
door alone."""

from __future__ import annotations

import ast
import inspect
import pathlib
import re

import pytest

import hybridattn
from servecore.client import EngineClient
from servecore.errors import InvalidRequest
from servecore.testing import word_tokenizer

ROOT = pathlib.Path(__file__).resolve().parents[1]
CALLS = ("generate", "stream", "add_request", "step", "step_events", "abort", "has_unfinished",
         "close", "__enter__", "__exit__", "room_for", "start_thread")
VIEWS = ("tokenizer", "vocab_size", "eos_ids", "stats", "memory", "closed")


def _engines():
    out = [hybridattn.Engine]
    try:
        import mlxcache

        out.append(mlxcache.Engine)
    except ImportError:  # mlx not installed: the hybridattn half alone
        pass
    return out


def test_both_engines_are_the_front_door():
    for engine in _engines():
        assert issubclass(engine, EngineClient), engine


@pytest.mark.parametrize("call", CALLS)
def test_every_front_door_call_has_one_signature(call):
    want = inspect.signature(getattr(EngineClient, call))
    for engine in _engines():
        assert inspect.signature(getattr(engine, call)) == want, (engine, call)


def test_sampling_is_keyword_only_with_the_same_defaults():
    for call in ("generate", "stream", "add_request"):
        params = inspect.signature(getattr(EngineClient, call)).parameters
        assert list(params)[1:3] == ["prompts" if call != "add_request" else "prompt",
                                     "max_tokens"]
        for name in ("temperature", "top_p", "top_k", "seed", "stop_token_ids"):
            assert params[name].kind is inspect.Parameter.KEYWORD_ONLY, (call, name)
        assert params["max_tokens"].default == 256
        assert (params["temperature"].default, params["top_p"].default,
                params["top_k"].default, params["seed"].default) == (0.0, 1.0, 0, None)


def _hybrid():
    from server_harness import hybrid_engine

    return hybrid_engine()  # the harness's geometry (its steps are compiled once): 96 positions


def _mlx():
    mlxcache = pytest.importorskip("mlxcache")
    from mlxcache.zoo import make_model

    return mlxcache.Engine(make_model(), word_tokenizer(1000), num_slots=100)


@pytest.fixture(scope="module", params=["hybridattn", "mlxcache"])
def engine(request):
    eng = _hybrid() if request.param == "hybridattn" else _mlx()
    yield eng
    eng.close()


def test_the_views_are_there(engine):
    for name in VIEWS:
        getattr(engine, name)
    assert engine.vocab_size in (256, 1000) and engine.eos_ids == frozenset({1})
    assert engine.stats.requests >= 0 and engine.memory is not None


@pytest.mark.parametrize(("kwargs", "field"), [
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens=4, temperature=-1.0), "temperature"),
    (dict(max_tokens=4, top_p=0.0), "top_p"),
    (dict(max_tokens=4, top_k=1.5), "top_k"),
    (dict(max_tokens=4, seed=-3), "seed"),
    (dict(max_tokens=4, stop_token_ids=[10**6]), "stop_token_ids"),
    (dict(max_tokens=4, logprobs=21), "logprobs"),
])
def test_a_refused_request_names_its_field(engine, kwargs, field):
    with pytest.raises(InvalidRequest) as e:
        engine.add_request([7, 8, 9], **kwargs)
    assert e.value.field == field
    assert e.value.value == kwargs[field] and str(e.value) == e.value.reason
    assert not engine.has_unfinished()


def test_an_answer_past_the_context_names_max_tokens(engine):
    limit = engine.room_for(3)
    if limit is None:
        pytest.skip("this model sets no limit of its own")
    with pytest.raises(InvalidRequest) as e:
        engine.add_request([7, 8, 9], limit + 1)  # the prompt fits, its answer does not
    assert (e.value.field, e.value.value) == ("max_tokens", limit + 1)
    assert engine.add_request([7, 8, 9], limit) >= 0  # what fits is taken
    while engine.has_unfinished():
        engine.step()


def test_a_prompt_that_cannot_fit_names_the_prompt(engine):
    with pytest.raises(InvalidRequest) as e:
        engine.add_request([7] * 5000, 1)
    assert (e.value.field, e.value.value) == ("prompt", 5000)
    with pytest.raises(InvalidRequest) as e:  # a list of prompts: the one at fault
        engine.generate([[7], [engine.vocab_size]], 2)
    assert e.value.field == "prompt" and str(e.value).startswith("prompt 1")


def _inline_examples() -> list[tuple[str, str]]:
    """Every inline ``engine.<call>(...)`` of a front-door call on the docs pages and the
    README, with where it stands."""
    out = []
    calls = "|".join(c for c in CALLS if not c.startswith("_"))
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for m in re.finditer(rf"`(engine\.(?:{calls})\([^`]*\))`", path.read_text()):
            out.append((path.name, m.group(1)))
    return out


EXAMPLES = _inline_examples()


def test_the_docs_show_the_front_door():
    assert any("add_request" in code for _, code in EXAMPLES)


@pytest.mark.parametrize(("page", "code"), EXAMPLES)
def test_a_docs_example_runs_on_both_engines(engine, page, code):
    if code == "engine.close()":
        return  # the fixture closes it; closing is tested on its own
    namespace = {"engine": engine, "prompt": [7, 8], "prompts": [[7, 8], [9]], "rid": 0}
    eval(code, namespace)  # noqa: S307 - the docs' own code
    while engine.has_unfinished():
        engine.step()


SERVER = sorted((ROOT / "servecore" / "server").glob("*.py"))


@pytest.mark.parametrize("path", SERVER, ids=lambda p: p.name)
def test_the_server_touches_the_engine_through_the_front_door_only(path):
    """No import of either engine, and no private attribute read off anything but the
    module's own objects (``self``, ``cls``)."""
    tree = ast.parse(path.read_text())
    bad = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""]
            bad += [f"{node.lineno}: imports {n}" for n in names
                    if n.split(".")[0] in ("hybridattn", "mlxcache")]
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") \
                and not node.attr.startswith("__"):
            owner = node.value
            if not (isinstance(owner, ast.Name) and owner.id in ("self", "cls")):
                bad.append(f"{node.lineno}: reads {ast.unparse(node)}")
    assert not bad, f"{path.name}: " + "; ".join(bad)


def _serve_block() -> str:
    text = (ROOT / "docs" / "getting-started.md").read_text()
    (block,) = [b for b in re.findall(r"```python\n(.*?)```", text, re.S)
                if "def serve(engine)" in b]
    return block


def test_the_getting_started_function_runs_on_both_engines(engine):
    namespace: dict = {"__name__": "docs_serve"}
    exec(compile(_serve_block(), "docs/getting-started.md:serve", "exec"), namespace)
    ids, text, streamed, events, refused = namespace["serve"](engine)
    assert streamed == ids[0] and [ev.token for ev in events] == ids[0]
    assert all(len(ev.logprobs.top) == 2 for ev in events)
    assert isinstance(text[0], str) and refused == ("top_p", 0.0)
