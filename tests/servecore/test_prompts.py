"""Text and chat prompts at both engines' doors, through a real tokenizer.

The tokenizer is ``servecore.testing``'s word tokenizer: the ``tokenizers`` package's
``WordLevel`` model with a whitespace pre-tokenizer, wrapped as transformers'
``PreTrainedTokenizerFast``, saved (``tokenizer.json``, ``tokenizer_config.json``) next to a
checkpoint the test writes and read back the way a user reads it (``kimi_linear.load_tokenizer``,
``mlx_lm.load``). Its vocabulary is numbered so that the expected ids are written by hand: the
word ``wN`` is token ``N``, and the chat template renders ``<|system|>``, ``<|user|>`` and
``<|assistant|>`` as tokens 3, 4 and 5. The oracle of every text or chat prompt is the same
engine served those hand-written ids; the oracle of every EOS is greedy generation without
stop ids, cut after its first EOS.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
from harness import CFG, ENGINE, PARAMS

from hybridattn.engine import Engine
from hybridattn.models import kimi_linear as M
from servecore.prompts import decode, encode_prompt, encode_prompts, load_tokenizer
from servecore.testing import FIRST_WORD, save_word_tokenizer, word_tokenizer

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

V = CFG.vocab_size
TEXT = ["w7 w8 w9", "w30 w31"]
IDS = [[7, 8, 9], [30, 31]]
CHAT = [{"role": "system", "content": "w10"}, {"role": "user", "content": "w7 w8"}]
CHAT_IDS = [3, 10, 4, 7, 8, 5]  # <|system|> w10 <|user|> w7 w8 <|assistant|>
NEW = 6


def first_new_word(tokens: list[int]) -> int:
    """The index of the first generated token that is a word not generated before it (the
    EOS the tests give the tokenizer: a word, so that the prompts' text is not affected)."""
    seen: set[int] = set()
    for i, t in enumerate(tokens):
        if i and t >= FIRST_WORD and t not in seen:
            return i
        seen.add(t)
    raise AssertionError(f"no new word in {tokens}: pick another prompt")


def unused(tokens, n=1) -> list[int]:
    """``n`` word ids that ``tokens`` does not contain (EOS ids that never come)."""
    return [t for t in range(FIRST_WORD, V) if t not in tokens][:n]


# ------------------------------------------------------------------------- hybridattn ----


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A checkpoint directory with the word tokenizer (and its chat template) beside it."""
    path = tmp_path_factory.mktemp("kimi") / "with-tokenizer"
    M.save_pretrained(PARAMS, CFG, path)
    save_word_tokenizer(path, V)
    return path


@pytest.fixture(scope="module")
def served(checkpoint):
    """``(engine, tokenizer)``: the checkpoint loaded as a user loads it."""
    config, params = M.load(checkpoint)
    tokenizer = M.load_tokenizer(checkpoint)
    return Engine(config, params, tokenizer=tokenizer, **ENGINE), tokenizer


@pytest.fixture(scope="module")
def greedy():
    """Greedy generation of ids without a tokenizer (so without stop ids) by CFG's engine."""
    return Engine(CFG, PARAMS, **ENGINE).generate(IDS, NEW)


def test_the_tokenizer_encodes_the_words_as_their_numbers(served):
    _, tok = served
    assert [tok.encode(t) for t in TEXT] == IDS
    assert encode_prompts([*TEXT, CHAT, (7, 8)], tok, V) == [*IDS, CHAT_IDS, [7, 8]]


def test_string_prompts_give_the_tokens_of_their_ids(served):
    engine, _ = served
    want = engine.generate(IDS, NEW)
    assert engine.generate(TEXT, NEW) == want
    assert engine.generate([TEXT[0], IDS[1]], NEW) == want  # text and ids in one batch
    assert [list(engine.stream(TEXT[1:], NEW))] == [[(0, t) for t in want[1]]]
    rid = engine.add_request(TEXT[0], NEW)
    got = []
    while engine.has_unfinished():
        got += [tok for r, tok, _ in engine.step() if r == rid]
    assert got == want[0]


def test_chat_messages_go_through_the_template(served):
    engine, tok = served
    assert engine.generate([CHAT], NEW) == engine.generate([CHAT_IDS], NEW)
    assert tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True) == (
        "<|system|> w10 <|user|> w7 w8 <|assistant|>")
    # the messages of one chat are not prompts (TypeError where the suite's jaxtyping hook
    # checks the annotations first)
    with pytest.raises((ValueError, TypeError)):
        engine.generate(CHAT, NEW)
    with pytest.raises(ValueError, match=r"got a list of chat messages .* wrap one chat"):
        encode_prompts(CHAT, tok, V)
    with pytest.raises(ValueError, match="prompt 1: message 1 is 'w7', not a dict"):
        encode_prompts([IDS[0], [CHAT[0], "w7"]], tok, V)
    assert not engine.has_unfinished()


def test_a_chat_needs_a_chat_template(tmp_path):
    M.save_pretrained(PARAMS, CFG, tmp_path)
    save_word_tokenizer(tmp_path, V, chat=False)
    tok = M.load_tokenizer(tmp_path)
    engine = Engine(CFG, PARAMS, tokenizer=tok, **ENGINE)
    with pytest.raises(ValueError, match=r"prompt 0 is a chat, but the tokenizer has no chat "
                                         r"template \(tokenizer.chat_template is None\)"):
        engine.generate([CHAT], NEW)
    assert engine.generate(TEXT[:1], 2) == engine.generate(IDS[:1], 2)  # text still works


def test_eos_given_as_an_int_stops_generation_and_leaves_the_text(tmp_path, greedy):
    ref = greedy[0]
    k = first_new_word(ref)
    M.save_pretrained(PARAMS, CFG, tmp_path)
    save_word_tokenizer(tmp_path, V, eos=ref[k])  # the word ref[k] is the EOS
    tok = M.load_tokenizer(tmp_path)
    assert tok.eos_token_id == ref[k] and 1 not in ref[:k]
    config, params = M.load(tmp_path)
    engine = Engine(config, params, tokenizer=tok, **ENGINE)
    assert engine.generate([TEXT[0]], NEW) == [ref[: k + 1]]
    assert engine.generate([TEXT[0]], NEW, text=True) == [tok.decode(ref[:k])]  # EOS left out
    assert engine.generate([TEXT[0]], NEW, stop_token_ids=[]) == [ref]  # explicit: none


def test_eos_given_as_a_list_in_config_json_stops_generation(tmp_path, greedy):
    ref = greedy[0]
    k = first_new_word(ref)
    eos = (*unused(ref), ref[k])  # config.json: "eos_token_id": [never generated, ref[k]]
    M.save_pretrained(PARAMS, dataclasses.replace(CFG, eos_token_id=eos), tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["eos_token_id"] == list(eos)
    save_word_tokenizer(tmp_path, V)  # its own EOS is </s> (1)
    config, params = M.load(tmp_path)
    assert config.eos_token_id == eos and 1 not in ref[:k]
    engine = Engine(config, params, tokenizer=M.load_tokenizer(tmp_path), **ENGINE)
    assert engine.generate([TEXT[0]], NEW) == [ref[: k + 1]]
    # ids in, ids out: without a tokenizer no EOS applies unless stop_token_ids says so
    assert Engine(config, params, **ENGINE).generate([IDS[0]], NEW) == [ref]


def test_a_directory_without_a_tokenizer_loads_for_ids_only(tmp_path, greedy):
    M.save_pretrained(PARAMS, CFG, tmp_path)
    assert M.load_tokenizer(tmp_path) is None
    config, params = M.load(tmp_path)
    engine = Engine(config, params, tokenizer=M.load_tokenizer(tmp_path), **ENGINE)
    assert engine.generate(IDS, NEW) == greedy
    with pytest.raises(ValueError, match="prompt 0 is text but the engine has no tokenizer"):
        engine.generate(TEXT, NEW)
    with pytest.raises(ValueError, match=r"text=True needs a tokenizer"):
        engine.generate(IDS, NEW, text=True)


def test_an_eos_outside_the_vocabulary_is_refused():
    with pytest.raises(ValueError, match=r"EOS ids \[1, 300\] of the tokenizer and config "
                                         r".* vocabulary \[0, 256\)"):
        Engine(dataclasses.replace(CFG, eos_token_id=300), PARAMS, tokenizer=word_tokenizer(V),
               **ENGINE)


def test_the_demo_prints_the_decoded_continuation(checkpoint, served, capsys, monkeypatch):
    from hybridattn import demo

    monkeypatch.setenv("HYBRIDATTN_JAX_CACHE", "0")  # keep the suite's compilation cache
    engine, tok = served
    rc = demo.main(["--model", str(checkpoint), "--prompt", "w7 w8", "--max-tokens", "4",
                    "--chunked-prefill", "16"])
    out = capsys.readouterr().out
    want = engine.generate([[{"role": "user", "content": "w7 w8"}]], 4, text=True)[0]
    assert rc == 0 and out == want + "\n"
    with pytest.raises(SystemExit):
        demo.main(["--prompt", "w7"])
    assert "--prompt needs --model" in capsys.readouterr().err


# ---------------------------------------------------------------------- the rule itself ----


def test_text_that_starts_with_the_bos_token_gets_no_second_one():
    tok = word_tokenizer(16, bos=True)
    assert encode_prompt("p", "w7", tok, 16) == [2, 7]
    assert encode_prompt("p", "<s> w7", tok, 16) == [2, 7]


def test_a_chat_template_that_refuses_a_chat_is_named():
    tok = word_tokenizer(16)
    tok.chat_template = "{{ raise_exception('roles must alternate') }}"
    with pytest.raises(ValueError, match="prompt 3: the tokenizer's chat template refused it: "
                                         ".*roles must alternate"):
        encode_prompt("prompt 3", [{"role": "user", "content": "w7"}], tok, 16)


def test_decode_leaves_out_only_the_stop_token_that_ended_the_answer():
    tok = word_tokenizer(16)
    assert decode(tok, [7, 1, 8, 1], stop={1}) == tok.decode([7, 1, 8])
    assert decode(tok, [7, 8], stop={1}) == "w7 w8"


def test_remote_tokenizer_code_runs_only_when_trusted_and_missing_packages_are_named(tmp_path):
    # the released Kimi-Linear's layout: tiktoken.model, tokenization_kimi.py, an auto_map
    (tmp_path / "tiktoken.model").write_text("")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "TikTokenTokenizer",
        "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]}}))
    (tmp_path / "tokenization_kimi.py").write_text(
        "import hybridattn_missing_package\n"
        "from transformers import PreTrainedTokenizer\n"
        "class TikTokenTokenizer(PreTrainedTokenizer):\n    pass\n")
    with pytest.raises(ValueError, match="is code that ships with the checkpoint .* pass "
                                         "trust_remote_code=True"):
        load_tokenizer(tmp_path)
    with pytest.raises(ImportError, match="needs hybridattn_missing_package, which is not "
                                          "installed: pip install hybridattn_missing_package"):
        load_tokenizer(tmp_path, trust_remote_code=True)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_tokenizer(tmp_path / "nowhere")


# --------------------------------------------------------------------------- mlxcache ----

LLAMA = dict(model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
             num_attention_heads=4, num_key_value_heads=4, rms_norm_eps=1e-5, vocab_size=128)


@pytest.fixture(scope="module")
def mlx_checkpoint(tmp_path_factory):
    """``(directory, model)``: a tiny llama saved as mlx-lm saves one, with the word
    tokenizer beside it."""
    mx = pytest.importorskip("mlx.core")
    pytest.importorskip("mlx_lm")
    from mlx.utils import tree_flatten
    from mlx_lm.models import llama

    mx.random.seed(0)
    model = llama.Model(llama.ModelArgs(**LLAMA))
    mx.eval(model.parameters())
    path = tmp_path_factory.mktemp("llama")
    mx.save_safetensors(str(path / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (path / "config.json").write_text(json.dumps(LLAMA))
    save_word_tokenizer(path, LLAMA["vocab_size"])
    return path, model


@pytest.mark.mlx
def test_mlx_string_and_chat_prompts_give_the_tokens_of_their_ids(mlx_checkpoint):
    from mlx_lm import load

    from mlxcache.engine import Engine as MLXEngine

    path, _ = mlx_checkpoint
    model, wrapper = load(str(path))  # mlx-lm's TokenizerWrapper around the HF tokenizer
    for tok in (wrapper, M.load_tokenizer(path)):
        engine = MLXEngine(model, tok, num_slots=128)
        want = engine.generate(IDS, max_tokens=NEW)
        assert engine.generate(TEXT, max_tokens=NEW) == want
        assert engine.generate([CHAT], max_tokens=NEW) == engine.generate([CHAT_IDS],
                                                                           max_tokens=NEW)
        assert [t for _, t in engine.stream([CHAT], max_tokens=NEW)] == engine.generate(
            [CHAT_IDS], max_tokens=NEW)[0]
    with pytest.raises(ValueError, match="prompt 0 is a chat, but the tokenizer has no chat"):
        MLXEngine(model, word_tokenizer(128, chat=False), num_slots=128).generate([CHAT])


@pytest.mark.mlx
def test_mlx_eos_given_as_an_int_and_as_a_list_stops_generation(mlx_checkpoint, tmp_path):
    import shutil

    from mlx_lm import load

    from mlxcache.engine import Engine as MLXEngine

    path, model = mlx_checkpoint
    # IDS[1]: this tiny llama repeats itself after IDS[0]; after IDS[1] it changes its word
    ref = MLXEngine(model, num_slots=128).generate([IDS[1]], max_tokens=NEW)[0]
    k = first_new_word(ref)
    assert 1 not in ref[:k]
    # an int: the HF tokenizer's eos_token_id
    tok = word_tokenizer(128, eos=ref[k])
    engine = MLXEngine(model, tok, num_slots=128)
    assert engine.generate([TEXT[1]], max_tokens=NEW) == [ref[: k + 1]]
    assert engine.generate([TEXT[1]], max_tokens=NEW, text=True) == [tok.decode(ref[:k])]
    # a list: config.json's eos_token_id, which mlx_lm.load gives the TokenizerWrapper
    for f in ("model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(path / f, tmp_path / f)
    eos = [*unused(ref), ref[k]]
    (tmp_path / "config.json").write_text(json.dumps({**LLAMA, "eos_token_id": eos}))
    model2, wrapper = load(str(tmp_path))
    assert set(eos) <= set(wrapper.eos_token_ids)
    assert MLXEngine(model2, wrapper, num_slots=128).generate(
        [TEXT[1]], max_tokens=NEW) == [ref[: k + 1]]


@pytest.mark.mlx
def test_mlx_generate_cli_serves_a_prompt_as_a_chat(mlx_checkpoint, capsys):
    from mlx_lm import load

    from mlxcache.engine import Engine as MLXEngine
    from mlxcache.generate import main

    path, _ = mlx_checkpoint
    model, wrapper = load(str(path))
    chat = [{"role": "user", "content": "w7 w8"}]
    want = MLXEngine(model, wrapper, num_slots=128).generate([chat, "w7 w8"], max_tokens=4,
                                                           text=True)
    main(["--model", str(path), "--prompt", "w7 w8", "--prompt", "w7 w8", "--max-tokens", "4",
          "--num-slots", "128"])
    main(["--model", str(path), "--prompt", "w7 w8", "--prompt", "w7 w8", "--max-tokens", "4",
          "--num-slots", "128", "--ignore-chat-template"])
    out = capsys.readouterr().out.splitlines()
    assert out == [f"[0] {want[0]}", f"[1] {want[0]}", f"[0] {want[1]}", f"[1] {want[1]}"]
