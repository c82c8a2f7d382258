"""Torch-free tokenizer for Hugging Face model directories.

Reads tokenizer.json (through the `tokenizers` library), tokenizer_config.json, the chat
template, generation_config.json and config.json; encodes, decodes and renders chat
templates without importing torch or transformers, so the gateway and the SDK stay light.
"""
from __future__ import annotations

import json
import logging
from functools import cached_property
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, processors
from tokenizers import Tokenizer as _Backend

logger = logging.getLogger(__name__)

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
CHAT_TEMPLATE_JINJA_FILE = "chat_template.jinja"
CHAT_TEMPLATE_JSON_FILE = "chat_template.json"
GENERATION_CONFIG_FILE = "generation_config.json"
MODEL_CONFIG_FILE = "config.json"

_NAMED_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token")


class Tokenizer:
    """A Hugging Face fast tokenizer plus the settings transformers keeps beside it.

    Contract: `encode` gives the same ids as transformers' `AutoTokenizer.encode` for
    tokenizer.json files whose post-processor agrees with `add_bos_token`. When
    tokenizer_config.json states `add_bos_token` / `add_eos_token` explicitly, the
    post-processor is rebuilt from those flags (as transformers 4.x Llama tokenizers do), so a
    BOS is added exactly once whether the file's post-processor adds it or not.
    """

    def __init__(
        self,
        backend: _Backend,
        tokenizer_config: Mapping[str, Any] | None = None,
        *,
        chat_template: str | None = None,
        extra_eos_token_ids: Iterable[int] = (),
        fallback_bos_token_id: int | None = None,
        source: str = "<memory>",
    ) -> None:
        config = dict(tokenizer_config or {})
        self._backend = backend
        self._source = source
        # Truncation/padding stored in tokenizer.json would silently cut prompts; limits are
        # enforced by the caller instead (transformers also disables them per call).
        backend.no_truncation()
        backend.no_padding()

        self._special_tokens: dict[str, str] = {}
        for field in _NAMED_SPECIAL_TOKENS:
            content = _token_content(config.get(field), field, source)
            if content is not None:
                self._special_tokens[field] = content
                if backend.token_to_id(content) is None:
                    # transformers adds a named special token that the vocabulary lacks; do the same
                    # so ids agree.
                    backend.add_special_tokens([AddedToken(content, special=True, normalized=False)])
                    logger.info("%s: added missing %s %r to the vocabulary", source, field, content)

        self._bos_token_id = self._id_of("bos_token")
        if self._bos_token_id is None:
            self._bos_token_id = fallback_bos_token_id
        self._eos_token_ids = frozenset(
            [i for i in [self._id_of("eos_token")] if i is not None] + list(extra_eos_token_ids)
        )
        self._pad_token_id = self._id_of("pad_token")
        self._unk_token_id = self._id_of("unk_token")

        if "add_bos_token" in config or "add_eos_token" in config:
            self._rebuild_post_processor(
                _flag(config, "add_bos_token", source), _flag(config, "add_eos_token", source)
            )

        self._vocab_size = max(backend.get_vocab(with_added_tokens=True).values(), default=-1) + 1
        named_ids = set(self._eos_token_ids)
        if self._bos_token_id is not None:
            named_ids.add(self._bos_token_id)
        for token_id in named_ids:
            if not 0 <= token_id < self._vocab_size:
                raise ValueError(
                    f"{source}: special token id {token_id} is outside the vocabulary (size {self._vocab_size})"
                )
        special = {i for i, tok in backend.get_added_tokens_decoder().items() if tok.special}
        named = (self._bos_token_id, self._pad_token_id, self._unk_token_id)
        special.update(i for i in named if i is not None)
        special.update(self._eos_token_ids)
        self._special_token_ids = frozenset(special)

        self._chat_template = chat_template
        self._compiled_template: jinja2.Template | None = None

    # ------------------------------------------------------------------ loading

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """Load the tokenizer of a Hugging Face model directory.

        tokenizer.json is required; tokenizer_config.json, chat_template.jinja,
        chat_template.json, generation_config.json and config.json are read when present.
        Raises ValueError naming the file when one is missing or malformed.
        """
        root = Path(path)
        if not root.is_dir():
            raise ValueError(f"tokenizer directory {str(root)!r} does not exist or is not a directory")
        tokenizer_file = root / TOKENIZER_FILE
        if not tokenizer_file.is_file():
            raise ValueError(f"{tokenizer_file}: missing (a Hugging Face fast tokenizer file is required)")
        try:
            backend = _Backend.from_file(str(tokenizer_file))
        except Exception as exc:  # the Rust side raises a bare Exception on bad input
            raise ValueError(f"{tokenizer_file}: not a valid tokenizers file: {exc}") from exc

        config = _read_json(root / TOKENIZER_CONFIG_FILE) or {}
        generation = _read_json(root / GENERATION_CONFIG_FILE) or {}
        model_config = _read_json(root / MODEL_CONFIG_FILE) or {}
        extra_eos: set[int] = set()
        fallback_bos = None
        for name, data in ((GENERATION_CONFIG_FILE, generation), (MODEL_CONFIG_FILE, model_config)):
            extra_eos.update(_id_list(data.get("eos_token_id"), f"{root / name}: eos_token_id"))
            bos_ids = _id_list(data.get("bos_token_id"), f"{root / name}: bos_token_id")
            if fallback_bos is None and bos_ids:
                fallback_bos = bos_ids[0]
        return cls(
            backend,
            config,
            chat_template=_find_chat_template(root, config),
            extra_eos_token_ids=extra_eos,
            fallback_bos_token_id=fallback_bos,
            source=str(root),
        )

    # --------------------------------------------------------------- properties

    @property
    def vocab_size(self) -> int:
        """One more than the largest token id the tokenizer knows (added tokens included)."""
        return self._vocab_size

    @property
    def bos_token_id(self) -> int | None:
        return self._bos_token_id

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """Every id that ends generation: tokenizer_config, generation_config and config.json."""
        return self._eos_token_ids

    @property
    def pad_token_id(self) -> int | None:
        return self._pad_token_id

    @property
    def special_token_ids(self) -> frozenset[int]:
        """Added tokens marked special, plus the named bos/eos/pad/unk ids."""
        return self._special_token_ids

    @property
    def special_tokens(self) -> dict[str, str]:
        """Named special tokens as strings, e.g. {'bos_token': '<s>', 'eos_token': '</s>'}."""
        return dict(self._special_tokens)

    @property
    def chat_template(self) -> str | None:
        return self._chat_template

    @property
    def backend(self) -> _Backend:
        """The underlying `tokenizers.Tokenizer` (post-processor already adjusted)."""
        return self._backend

    # ------------------------------------------------------------------ methods

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; with `add_special_tokens`, BOS/EOS as the model expects."""
        if not isinstance(text, str):
            raise ValueError(f"text must be a str, got {type(text).__name__}")
        return list(self._backend.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids` (no clean-up of spaces around punctuation is applied)."""
        try:
            return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
        except (OverflowError, TypeError) as exc:
            raise ValueError(f"token ids must be non-negative integers: {exc}") from exc

    @cached_property
    def id_limit(self) -> int:
        """One past the largest id with a vocabulary entry: ids from here up decode to nothing
        (a model's embedding table is often padded past its tokenizer's vocabulary)."""
        return max(self._backend.get_vocab(with_added_tokens=True).values(), default=-1) + 1

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str | None]:
        """Vocabulary strings of `ids` (None for an id the vocabulary lacks)."""
        return [self._backend.id_to_token(int(i)) for i in ids]

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> str:
        """Render `messages` ([{'role': ..., 'content': ...}, ...]) with the chat template.

        Extra keyword arguments (tools, documents, enable_thinking, ...) reach the template as
        variables. Raises ValueError when there is no template, the messages are malformed,
        or the template itself rejects them (`raise_exception`).
        """
        if self._chat_template is None:
            raise ValueError(
                f"{self._source}: no chat template ({TOKENIZER_CONFIG_FILE} has no chat_template and "
                f"there is no {CHAT_TEMPLATE_JINJA_FILE} or {CHAT_TEMPLATE_JSON_FILE})"
            )
        if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
            raise ValueError("messages must be a list of {'role', 'content'} objects")
        for index, message in enumerate(messages):
            if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
                raise ValueError(f"messages[{index}] must be an object with a string 'role'")
        if self._compiled_template is None:
            try:
                self._compiled_template = _template_environment().from_string(self._chat_template)
            except jinja2.TemplateSyntaxError as exc:
                raise ValueError(f"{self._source}: chat template does not parse: {exc}") from exc
        variables: dict[str, Any] = {**self._special_tokens, **template_kwargs}
        variables.setdefault("tools", None)
        variables.setdefault("documents", None)
        try:
            return self._compiled_template.render(
                messages=[dict(m) for m in messages], add_generation_prompt=add_generation_prompt, **variables
            )
        except jinja2.TemplateError as exc:
            raise ValueError(f"chat template rejected the messages: {exc}") from exc

    # ---------------------------------------------------------------- internals

    def _id_of(self, field: str) -> int | None:
        content = self._special_tokens.get(field)
        return None if content is None else self._backend.token_to_id(content)

    def _rebuild_post_processor(self, add_bos: bool, add_eos: bool) -> None:
        bos = self._special_tokens.get("bos_token") if add_bos else None
        eos = self._special_tokens.get("eos_token") if add_eos else None
        single = f"{bos + ':0 ' if bos else ''}$A:0{' ' + eos + ':0' if eos else ''}"
        pair = f"{single}{' ' + bos + ':1' if bos else ''} $B:1{' ' + eos + ':1' if eos else ''}"
        special = [(t, self._backend.token_to_id(t)) for t in dict.fromkeys(x for x in (bos, eos) if x)]
        self._backend.post_processor = processors.TemplateProcessing(
            single=single, pair=pair, special_tokens=special
        )


# ---------------------------------------------------------------------- helpers


def _read_json(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object at the top level")
    return data


def _token_content(value: Any, field: str, source: str) -> str | None:
    """A special token given as a string or as a serialized AddedToken dict."""
    if value is None:
        return None
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    raise ValueError(
        f"{source}/{TOKENIZER_CONFIG_FILE}: {field} must be a string or an object with 'content', got {value!r}"
    )


def _flag(config: Mapping[str, Any], field: str, source: str) -> bool:
    value = config.get(field, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise ValueError(f"{source}/{TOKENIZER_CONFIG_FILE}: {field} must be true or false, got {value!r}")
    return value


def _id_list(value: Any, where: str) -> list[int]:
    """An `eos_token_id`-style field: absent, one int, or a list of ints."""
    if value is None:
        return []
    items = value if isinstance(value, list) else [value]
    for item in items:
        if isinstance(item, bool) or not isinstance(item, int) or item < 0:
            raise ValueError(f"{where} must be a non-negative int or a list of them, got {value!r}")
    return list(items)


def _find_chat_template(root: Path, config: Mapping[str, Any]) -> str | None:
    """chat_template.jinja, then chat_template.json, then tokenizer_config's chat_template."""
    jinja_file = root / CHAT_TEMPLATE_JINJA_FILE
    if jinja_file.is_file():
        try:
            return jinja_file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"{jinja_file}: cannot be read as UTF-8 text: {exc}") from exc
    json_file = root / CHAT_TEMPLATE_JSON_FILE
    json_data = _read_json(json_file)
    if json_data is not None:
        return _pick_template(json_data.get("chat_template"), json_file)
    return _pick_template(config.get("chat_template"), root / TOKENIZER_CONFIG_FILE)


def _pick_template(value: Any, where: Path) -> str | None:
    """A template string, or the 'default' entry of a list of {'name', 'template'} objects."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {}
        for entry in value:
            if not isinstance(entry, Mapping) or not isinstance(entry.get("template"), str):
                raise ValueError(f"{where}: chat_template entries must be objects with 'name' and 'template'")
            named[entry.get("name")] = entry["template"]
        if "default" in named:
            return named["default"]
        return next(iter(named.values()), None)
    raise ValueError(f"{where}: chat_template must be a string or a list of named templates")


class _GenerationTag(jinja2.ext.Extension):
    """Accepts `{% generation %}...{% endgeneration %}` (used for assistant masks) and renders the body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

    def _render_body(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    # Jinja's own tojson escapes HTML characters, which chat templates do not expect.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


_ENVIRONMENT: ImmutableSandboxedEnvironment | None = None


def _template_environment() -> ImmutableSandboxedEnvironment:
    """The sandboxed Jinja environment transformers renders chat templates with."""
    global _ENVIRONMENT
    if _ENVIRONMENT is None:
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        _ENVIRONMENT = env
    return _ENVIRONMENT
