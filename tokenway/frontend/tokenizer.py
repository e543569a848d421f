"""Text <-> token ids, and chat messages -> prompt text, for one model directory.

The BPE itself is the `tokenizers` library's (`Tokenizer.hf`); this class adds what a model
directory says around it: special tokens and BOS (tokenizer_config.json), extra stop ids
(generation_config.json) and the chat template, rendered the way HuggingFace transformers does.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.meta
import tokenizers
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

_SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")
# Texts longer than this go through encode_batch, which runs without the GIL (encode holds it:
# 7 MB took 10 s during which no other thread ran); shorter ones are quicker through encode.
_GIL_FREE_CHARS = 4096


class PromptTooLong(ValueError):
    """The text needs more tokens than allowed, known without tokenizing it."""

    def __init__(self, num_tokens_at_least: int, max_num_tokens: int) -> None:
        super().__init__(f"prompt: at least {num_tokens_at_least} tokens, more than the {max_num_tokens} allowed")
        self.num_tokens_at_least = num_tokens_at_least


class Tokenizer:
    def __init__(
        self,
        hf: tokenizers.Tokenizer,
        tokenizer_config: dict[str, Any],
        generation_config: dict[str, Any] | None = None,
        chat_template: str | None = None,
        source: str = "tokenizer",
    ) -> None:
        self.hf = hf
        self._token_text: dict[int, str] = {}  # bounded by the vocabulary
        self.vocab_size = hf.get_vocab_size(with_added_tokens=True)
        # Special token strings a chat template may use, e.g. {{ bos_token }}.
        tokens = {name: _token_content(tokenizer_config.get(name)) for name in _SPECIAL_TOKEN_NAMES}
        self._special_tokens = {name: token for name, token in tokens.items() if token is not None}
        generation_config = generation_config or {}
        self.bos_token_id = self._token_id("bos_token", generation_config.get("bos_token_id"))
        generation_eos_ids = _as_id_list(generation_config.get("eos_token_id"))
        self.eos_token_id = self._token_id("eos_token", generation_eos_ids[0] if generation_eos_ids else None)
        # Chat models often stop on an end-of-turn token too, which only generation_config.json lists.
        self.eos_token_ids = frozenset(generation_eos_ids + ([] if self.eos_token_id is None else [self.eos_token_id]))
        added = hf.get_added_tokens_decoder()
        self._special_ids = frozenset(i for i, t in added.items() if t.special)
        # Added tokens (special or not) are matched whole before the BPE runs: a tool format's
        # marker that is one of them is that token (tool_grammars.py). The first of duplicates wins.
        self._added_text_to_id: dict[str, int] = {}
        for token_id, token in sorted(added.items()):
            self._added_text_to_id.setdefault(token.content, token_id)
        # The special tokens' strings, longest first (one may begin another): where they stand in
        # a caller's text they are text, not control tokens (special_text.py).
        special_texts = sorted({t.content for t in added.values() if t.special and t.content}, key=len, reverse=True)
        self.special_token_pattern = re.compile("|".join(map(re.escape, special_texts))) if special_texts else None
        # True: a special token's string in a message is the token itself (the caller may write
        # control tokens; serve --special-tokens-in-messages). Off by default, as in vLLM.
        self.special_tokens_in_messages = False
        self._as_text_hf: tokenizers.Tokenizer | None = None  # a copy that reads special tokens as text
        # A tokenizer.json post-processor may already insert BOS; then add_bos_token must not add a second.
        post_processor = hf.post_processor
        adds_special = post_processor is not None and post_processor.num_special_tokens_to_add(False) > 0
        self._prepend_bos = (
            bool(tokenizer_config.get("add_bos_token", False)) and self.bos_token_id is not None and not adds_special
        )
        # A model without a chat template (a base model) is templated as ChatML, as llama.cpp
        # does: chat clients work, and `chat_template_is_fallback` lets the log say so.
        is_fallback = chat_template is None
        if chat_template is None:
            adds_bos = self.bos_token_id is not None and (self._prepend_bos or adds_special)
            chat_template = _CHATML_WITH_BOS if adds_bos else CHATML
        self.use_chat_template(chat_template, source)
        self.chat_template_is_fallback = is_fallback
        self._source = source
        self.max_token_chars = _max_token_chars(hf)
        self.segment_cache = None  # see enable_segment_cache

    def use_chat_template(self, chat_template: str, source: str = "chat template") -> None:
        """Render chats with `chat_template` from now on (serve --chat-template replaces the
        model's own at start-up, before any request). A ValueError for a template that is not
        valid Jinja."""
        env = _chat_template_env()
        try:
            template = env.from_string(chat_template)
            variables = jinja2.meta.find_undeclared_variables(env.parse(chat_template))
        except jinja2.TemplateSyntaxError as exc:
            raise ValueError(f"{source}: chat template is not valid jinja ({exc})") from None
        self.chat_template, self._template = chat_template, template
        # The variables the template reads: its switches (enable_thinking), a caller's kwargs.
        self.template_variables = frozenset(variables)
        self._template_supports_tools = "tools" in variables
        self.chat_template_is_fallback = False

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> Tokenizer:
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise ValueError(f"{path}: not found; tokenway needs a fast-tokenizer tokenizer.json")
        try:
            hf = tokenizers.Tokenizer.from_file(str(path))
        except Exception as exc:  # the Rust side raises a bare Exception
            raise ValueError(f"{path}: not a valid tokenizer.json ({exc})") from None
        tokenizer_config = _read_json(model_dir / "tokenizer_config.json")
        chat_template = tokenizer_config.get("chat_template")
        if isinstance(chat_template, list):  # older format: named templates
            templates = {t.get("name"): t.get("template") for t in chat_template}
            chat_template = templates.get("default", next(iter(templates.values()), None))
        template_path = model_dir / "chat_template.jinja"
        if template_path.is_file():  # transformers >= 4.50 saves the template here, and it wins
            chat_template = template_path.read_text()
        return cls(
            hf,
            tokenizer_config,
            generation_config=_read_json(model_dir / "generation_config.json"),
            chat_template=chat_template,
            source=str(model_dir),
        )

    def encode(self, text: str, add_special_tokens: bool = True, max_num_tokens: int | None = None) -> list[int]:
        """Token ids of `text`. With max_num_tokens, a text that certainly needs more tokens
        (each token covers at most max_token_chars characters) raises PromptTooLong at once,
        without the seconds tokenizing megabytes would take."""
        text = _without_surrogates(text)
        if max_num_tokens is not None and self.max_token_chars is not None:
            num_tokens_at_least = -(-len(text) // self.max_token_chars)
            if num_tokens_at_least > max_num_tokens:
                raise PromptTooLong(num_tokens_at_least, max_num_tokens)
        if self.segment_cache is not None and not add_special_tokens:
            token_ids = self.segment_cache.encode(text)
        else:
            token_ids = self._encode(text, add_special_tokens)
        if add_special_tokens and self._prepend_bos:
            assert self.bos_token_id is not None  # _prepend_bos needs one
            return [self.bos_token_id, *token_ids]
        return token_ids

    def _encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        if len(text) > _GIL_FREE_CHARS:
            return self.hf.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        return self.hf.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_special_tokens_as_text(self, text: str) -> list[int]:
        """Token ids of `text` with special-token strings in it encoded as the text they are."""
        text = _without_surrogates(text)
        if self._as_text_hf is None:
            hf = tokenizers.Tokenizer.from_str(self.hf.to_str())
            hf.encode_special_tokens = True  # set once, before the copy is shared: never toggled
            self._as_text_hf = hf
        if len(text) > _GIL_FREE_CHARS:
            return self._as_text_hf.encode_batch([text], add_special_tokens=False)[0].ids
        return self._as_text_hf.encode(text, add_special_tokens=False).ids

    def enable_segment_cache(self, max_chars: int = 4_000_000) -> bool:
        """Remember the ids of the text between added tokens (segment_cache.py): a chat
        prompt's earlier turns are then not tokenized again. False where that would not be
        exact for this tokenizer (nothing is cached then)."""
        from tokenway.frontend.segment_cache import SegmentCache

        self.segment_cache = SegmentCache.for_tokenizer(self.hf, self._encode, max_chars)
        return self.segment_cache is not None

    def decode(self, token_ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """One token's text, special tokens included (logprobs show it). Cached for the
        tokenizer's lifetime: every request's logprobs ask for the same ids again."""
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self.hf.decode([token_id], skip_special_tokens=False)
        return text

    def apply_chat_template(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        **kwargs: Any,
    ) -> str:
        variables = {
            **self._special_tokens,
            "messages": messages,
            "add_generation_prompt": add_generation_prompt,
            "tools": tools,
            **kwargs,
        }
        try:
            return self._template.render(**variables)
        except (jinja2.TemplateError, TypeError) as exc:
            # Templates index and concatenate message fields; a malformed message fails in here.
            raise ValueError(f"chat template failed on these messages: {exc}") from None

    @property
    def template_supports_tools(self) -> bool:
        return self._template_supports_tools

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special_ids

    def added_token_id(self, text: str) -> int | None:
        """The id of the added token (a control or user-defined one) whose text is `text`; None
        where the tokenizer spells `text` out of its vocabulary."""
        return self._added_text_to_id.get(text)

    def _token_id(self, config_name: str, fallback: int | None) -> int | None:
        token = self._special_tokens.get(config_name)
        token_id = None if token is None else self.hf.token_to_id(token)
        return fallback if token_id is None else token_id


def _max_token_chars(hf: tokenizers.Tokenizer) -> int | None:
    """The most characters of text one token can stand for, where that is known: a byte-level
    BPE (GPT-2, Llama 3, Qwen, SmolLM) with no normalizer writes each byte of text as one
    character of a token, so no token covers more characters than its own length. None for
    other tokenizers (a normalizer can shrink text; an unknown token can cover any run)."""
    # The parts' own JSON, not the whole tokenizer's (its vocabulary and merges: ~50 ms more).
    if hf.normalizer is not None or hf.pre_tokenizer is None or type(hf.model).__name__ != "BPE":
        return None
    pre = json.loads(hf.pre_tokenizer.__getstate__())
    pre_types = {p.get("type") for p in pre.get("pretokenizers", [])} | {pre.get("type")}
    if "ByteLevel" not in pre_types:
        return None
    return max(map(len, hf.get_vocab(with_added_tokens=True)))


class _Sandbox(ImmutableSandboxedEnvironment):
    """The sandbox's verdict on an attribute depends on the object's type and the attribute's
    name only (jinja2's is_internal_attribute and modifies_known_mutable look at nothing
    else), so it is remembered: the checks were half of rendering a 40-message conversation."""

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self._type_attribute_to_safe: dict[tuple[type, str], bool] = {}

    def is_safe_attribute(self, obj: Any, attr: str, value: Any) -> bool:
        key = (type(obj), attr)
        safe = self._type_attribute_to_safe.get(key)
        if safe is None:
            safe = self._type_attribute_to_safe[key] = super().is_safe_attribute(obj, attr, value)
        return safe


def _chat_template_env() -> ImmutableSandboxedEnvironment:
    """The environment transformers renders chat templates in, so prompts match byte for byte."""
    env = _Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys=False) -> str:
    # Jinja's own tojson escapes <, >, & and ' for HTML, which would change tool schemas in prompts.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    raise ValueError(message)


def _token_content(token: Any) -> str | None:
    # tokenizer_config.json writes a special token as a string or as a serialized AddedToken.
    if isinstance(token, dict):
        return token.get("content")
    return token if isinstance(token, str) else None


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: not valid JSON ({exc})") from None


# llama.cpp's default chat template: ChatML. Content that is a list of parts joins its text parts.
CHATML = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- elif message['content'] -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'text' -%}{{- part['text'] -}}{%- endif -%}{%- endfor -%}{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)
# Templates carry the BOS themselves (chat prompts are encoded without special tokens): a model
# whose tokenizer adds one (Gemma, Llama 2) gets it first.
_CHATML_WITH_BOS = "{{- bos_token -}}" + CHATML

_SURROGATE = re.compile("[\ud800-\udfff]")


def _without_surrogates(text: str) -> str:
    """text with lone surrogates (a JSON "\\ud800" escape decodes to one; they are not characters
    and the tokenizer refuses them) replaced by U+FFFD, as a UTF-8 decoder would."""
    if text.isascii() or _SURROGATE.search(text) is None:
        return text
    return _SURROGATE.sub("\ufffd", text)
