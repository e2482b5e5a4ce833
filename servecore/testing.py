"""Test support: a real tokenizer small enough to reason about, and a fake engine core.

``FakeCore`` is an ``servecore.engine.EngineCore`` without a model: each request's tokens are
``fake_tokens(request)``, a function of the request alone, one per round, so a test of the
shared layers (``servecore.streams``, the server) knows what every caller must receive.
``FakeEngine`` is the front door (``servecore.client.EngineClient``) over one.


``word_tokenizer(V)`` is a Hugging Face fast tokenizer (the ``tokenizers`` package's
``WordLevel`` model behind transformers' ``PreTrainedTokenizerFast``) whose vocabulary is
numbered so that a test can write the expected ids by hand, independently of the tokenizer:

==========  ===========================================================
id          token
==========  ===========================================================
0, 1, 2     ``<unk>``, ``</s>`` (EOS unless ``eos=`` names a word), ``<s>`` (BOS, added
            only with ``bos=True``)
3, 4, 5     ``<|system|>``, ``<|user|>``, ``<|assistant|>``
6 .. V-1    ``w6`` .. ``w{V-1}``: the word ``wN`` is token ``N``
==========  ===========================================================

Words are split on whitespace and decoded joined by spaces. Its chat template renders each
message as ``<|role|> content`` and the generation prompt as ``<|assistant|>``, so
``[{"role": "user", "content": "w7 w8"}]`` is ``[4, 7, 8, 5]``. ``save_word_tokenizer``
writes the same tokenizer as files (``tokenizer.json``, ``tokenizer_config.json``) into a
checkpoint directory, where ``AutoTokenizer`` (and so ``load_tokenizer`` and
``mlx_lm.load``) reads it. Needs ``tokenizers`` and ``transformers``.

>>> tok = word_tokenizer(16)
>>> tok.encode("w6 w7"), tok.decode([6, 7]), tok.eos_token_id
([6, 7], 'w6 w7', 1)
>>> tok.apply_chat_template([{"role": "user", "content": "w7 w8"}], tokenize=False,
...                         add_generation_prompt=True)
'<|user|> w7 w8 <|assistant|>'
"""

from __future__ import annotations

import json
import os
from collections import deque
from typing import Any

from servecore.client import EngineClient
from servecore.engine import Event, TokenLogprobs
from servecore.requests import GenerationRequest, finish_reason
from servecore.stats import ServingStats

__all__ = ["CHAT_TEMPLATE", "FIRST_WORD", "FakeCore", "FakeEngine", "FakeFailure",
           "fake_logprobs", "fake_tokens", "save_word_tokenizer", "word_tokenizer"]

CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} {% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")
"""The word tokenizer's chat template (Jinja, as Hugging Face tokenizers keep theirs)."""

FIRST_WORD = 6
"""The id of the first word, ``w6``; lower ids are the special and role tokens."""

_SPECIAL = ["<unk>", "</s>", "<s>", "<|system|>", "<|user|>", "<|assistant|>"]


def _backend(vocab_size: int, bos: bool):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    if not isinstance(vocab_size, int) or vocab_size <= FIRST_WORD:
        raise ValueError(f"vocab_size={vocab_size!r} must be an int > {FIRST_WORD}")
    vocab = {t: i for i, t in enumerate(_SPECIAL)}
    vocab.update({f"w{i}": i for i in range(FIRST_WORD, vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins the words with spaces
    if bos:
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", 2)])
    return tok


def _eos_token(vocab_size: int, eos: int) -> str:
    if eos == 1:
        return "</s>"
    if not isinstance(eos, int) or not FIRST_WORD <= eos < vocab_size:
        raise ValueError(f"eos={eos!r} must be 1 (</s>) or a word id in [{FIRST_WORD}, "
                         f"{vocab_size})")
    return f"w{eos}"


def _config(vocab_size: int, chat: bool, bos: bool, eos: int) -> dict[str, Any]:
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "<unk>",
              "eos_token": _eos_token(vocab_size, eos), "bos_token": "<s>" if bos else None}
    if chat:
        config["chat_template"] = CHAT_TEMPLATE
    return config


def word_tokenizer(vocab_size: int, *, chat: bool = True, bos: bool = False,
                   eos: int = 1) -> Any:
    """The word tokenizer of ``vocab_size`` tokens (see the module docstring), in memory;
    ``chat=False`` leaves out the chat template, ``bos=True`` adds ``<s>`` (id 2) in front of
    every encoded text, ``eos=N`` makes the word ``wN`` the EOS token (a test picks a token
    that a model is known to generate).

    >>> word_tokenizer(16, bos=True).encode("w9")
    [2, 9]
    >>> word_tokenizer(16, eos=9).eos_token_id
    9
    """
    from transformers import PreTrainedTokenizerFast

    config = _config(vocab_size, chat, bos, eos)
    del config["tokenizer_class"]
    return PreTrainedTokenizerFast(tokenizer_object=_backend(vocab_size, bos), **config)


def save_word_tokenizer(path: str | os.PathLike[str], vocab_size: int, *, chat: bool = True,
                        bos: bool = False, eos: int = 1) -> None:
    """Write the word tokenizer into the directory ``path`` (created if need be), as a
    checkpoint ships its tokenizer: ``tokenizer.json`` and ``tokenizer_config.json``. The
    options are ``word_tokenizer``'s.

    >>> import tempfile
    >>> from transformers import AutoTokenizer
    >>> with tempfile.TemporaryDirectory() as path:
    ...     save_word_tokenizer(path, 16)
    ...     AutoTokenizer.from_pretrained(path).encode("w6 w15")
    [6, 15]
    """
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    _backend(vocab_size, bos).save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as fh:
        json.dump(_config(vocab_size, chat, bos, eos), fh, indent=2)
        fh.write("\n")


class FakeFailure(Exception):
    """What ``FakeCore`` raises from a round told to fail."""


def fake_tokens(request: GenerationRequest, vocab_size: int = 32) -> list[int]:
    """Everything ``FakeCore`` generates for ``request``: a function of its prompt, seed and
    position, ended by the shared finishing rule (``servecore.requests.finish_reason``).

    >>> from servecore.requests import RequestBuilder
    >>> fake_tokens(RequestBuilder(vocab_size=32).one([1, 2], 3))
    [3, 10, 17]
    """
    out: list[int] = []
    while finish_reason(out, request) is None:
        out.append((sum(request.tokens) + 7 * len(out) + (request.sampling.seed or 0))
                   % vocab_size)
    return out


class FakeCore:
    """An engine core without a model: ``rows`` rows, FIFO admission, one token per running
    request a round (``fake_tokens``). ``fail_next = True`` makes the next round that serves
    anything drop every running request (listed in ``dropped``) and raise ``FakeFailure``.

    >>> from servecore.requests import RequestBuilder
    >>> from servecore.streams import Streams
    >>> Streams(FakeCore(), RequestBuilder(vocab_size=32)).generate([[1, 2], [5]], 2)
    [[3, 10], [5, 12]]
    """

    def __init__(self, rows: int = 3, vocab_size: int = 32):
        self.rows = rows
        self.vocab_size = vocab_size
        self.waiting: deque[int] = deque()
        self.running: dict[int, list[int]] = {}
        self.requests: dict[int, GenerationRequest] = {}
        self.fail_next = False
        self.dropped: list[int] = []
        self.closed = False

    def submit(self, rid: int, request: GenerationRequest) -> None:
        """Queue ``request``."""
        self.requests[rid] = request
        self.waiting.append(rid)

    def cancel(self, rid: int) -> bool:
        """Drop ``rid`` if it is queued or running."""
        if rid in self.waiting:
            self.waiting.remove(rid)
            return True
        return self.running.pop(rid, None) is not None

    def has_work(self) -> bool:
        """Whether any request is queued or running."""
        return bool(self.waiting or self.running)

    def close(self) -> None:
        """Forget every request (``closed`` becomes True)."""
        self.waiting.clear()
        self.running.clear()
        self.closed = True

    def run_round(self, emit) -> bool:
        """Admit what fits, then one token of every running request (or the failure)."""
        while self.waiting and len(self.running) < self.rows:
            rid = self.waiting.popleft()
            self.running[rid] = fake_tokens(self.requests[rid], self.vocab_size)
        if not self.running:
            return False
        if self.fail_next:
            self.fail_next = False
            err = FakeFailure("the step failed")
            self.dropped = list(self.running)
            for rid in self.dropped:
                emit(Event(rid, None, True, err))
            self.running.clear()
            raise err
        for rid, left in list(self.running.items()):
            token = left.pop(0)
            if not left:
                del self.running[rid]
            emit(Event(rid, token, not left, logprobs=fake_logprobs(
                token, self.requests[rid].logprobs, self.vocab_size)))
        return True


def fake_logprobs(token: int, k: int | None, vocab_size: int) -> TokenLogprobs | None:
    """``FakeCore``'s log-probabilities of ``token`` when a request asked for ``k``
    alternatives: the token at -0.5, then the next ids at -1.5, -2.5, ...

    >>> fake_logprobs(30, 2, 32)
    TokenLogprobs(logprob=-0.5, top=((30, -0.5), (31, -1.5)))
    """
    if k is None:
        return None
    return TokenLogprobs(-0.5, tuple(((token + i) % vocab_size, -0.5 - i) for i in range(k)))


class FakeEngine(EngineClient):
    """An engine over a ``FakeCore`` (``core``; or one given, a subclass that is slow or
    fails, say): the front door without a model, for tests of the layers above it (the
    server).

    >>> engine = FakeEngine(rows=2)
    >>> engine.generate([[1, 2]], 3), engine.stats.requests
    ([[3, 10, 17]], 0)
    """

    def __init__(self, core: FakeCore | None = None, *, rows: int = 3, vocab_size: int = 32,
                 tokenizer: Any = None, eos_ids: frozenset[int] = frozenset()):
        self.core = core if core is not None else FakeCore(rows=rows, vocab_size=vocab_size)
        super().__init__(self.core, vocab_size=vocab_size, tokenizer=tokenizer,
                         eos_ids=eos_ids, name="FakeEngine")
        self.stats = ServingStats()

    @property
    def memory(self) -> dict[str, int]:
        """Nothing is held: no pools."""
        return {}
