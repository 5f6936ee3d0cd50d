"""Tokenizer: a Hugging Face ``tokenizer.json`` run by the ``tokenizers`` library, the chat
template and special tokens from ``tokenizer_config.json``, and streaming detokenization.

It reproduces what transformers' fast tokenizer does for the same files (encode, decode, chat
template) without importing transformers. Two deliberate differences: ``decode`` never applies
``clean_up_tokenization_spaces`` (transformers 5 skips it for BPE models too, and it would make
streamed text disagree with the final text), and ``decode`` skips special tokens by default.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Sequence
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import tokenizers
from jinja2 import nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, processors

from lorapage.errors import InvalidRequestError

NAMED_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
_BYTE_TOKEN = re.compile(r"^<0x[0-9A-Fa-f]{2}>$")  # SentencePiece byte-fallback pieces


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}


def _token_content(value: Any) -> str | None:
    """A special token as tokenizer_config writes it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _as_ids(value: Any) -> tuple[int, ...]:
    if isinstance(value, int):
        return (value,)
    return tuple(v for v in value if isinstance(v, int)) if isinstance(value, list) else ()


def _read_chat_templates(model_dir: Path, config: dict) -> dict[str, str]:
    """The model's chat templates by name, found as transformers finds them: ``chat_template.jinja``
    (the default) and ``additional_chat_templates/NAME.jinja`` beside the model take priority over
    tokenizer_config.json's ``chat_template``, a string (the default) or a list of named templates
    (``[{"name": "default", "template": ...}, {"name": "tool_use", ...}]``); chat_template.json (an
    older processor file) last."""
    templates: dict[str, str] = {}
    jinja_file = model_dir / "chat_template.jinja"
    if jinja_file.is_file():
        templates["default"] = jinja_file.read_text(encoding="utf-8")
    extra_dir = model_dir / "additional_chat_templates"
    if extra_dir.is_dir():
        for path in sorted(extra_dir.glob("*.jinja")):
            templates[path.name.removesuffix(".jinja")] = path.read_text(encoding="utf-8")
    if templates:
        return templates
    template = config.get("chat_template") or _read_json(model_dir / "chat_template.json").get("chat_template")
    if isinstance(template, list):
        return {
            t["name"]: t["template"]
            for t in template
            if isinstance(t, dict) and isinstance(t.get("name"), str) and isinstance(t.get("template"), str)
        }
    return {"default": template} if isinstance(template, str) else {}


class _GenerationTag(jinja2.ext.Extension):
    """Accepts ``{% generation %}...{% endgeneration %}`` (used by training templates) and renders
    the body unchanged."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body, lineno=lineno)


def _raise_exception(message: str) -> None:
    # A template raises when the conversation breaks its rules (roles out of order, unknown
    # role): that is the caller's request to fix, not a server fault.
    raise InvalidRequestError(f"the chat template refused the messages: {message}", param="messages")


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys: bool = False
) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _jinja_env() -> ImmutableSandboxedEnvironment:
    """The environment transformers renders chat templates in: same options, filters, globals."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


class Tokenizer:
    """Encode, decode and chat-format text for one model directory.

    Build it with :meth:`from_dir`. ``eos_token_ids`` gathers every end-of-sequence id the model's
    files name (tokenizer_config's ``eos_token``, then generation_config.json's and config.json's
    ``eos_token_id``); ``eos_token_id`` is the first of them.
    """

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        special_tokens: dict[str, str],
        chat_template: str | dict[str, str] | None = None,
        extra_eos_token_ids: Sequence[int] = (),
        name: str = "tokenizer",
    ) -> None:
        self.backend = backend
        self.special_tokens = dict(special_tokens)  # "eos_token" -> "</s>", ...: the template sees these
        # Named templates (transformers' "default", "tool_use", ...); a lone one is the default.
        named = (
            chat_template if isinstance(chat_template, dict) else {"default": chat_template} if chat_template else {}
        )
        self.chat_templates: dict[str, str] = dict(named)
        self.chat_template: str | None = self.chat_templates.get("default")  # the one a chat without tools gets
        self._compiled: dict[str, jinja2.Template] = {}
        self.name = name
        named_eos = self.backend.token_to_id(special_tokens["eos_token"]) if "eos_token" in special_tokens else None
        eos_ids = ([named_eos] if named_eos is not None else []) + list(extra_eos_token_ids)
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(eos_ids))
        self.eos_token_id: int | None = self.eos_token_ids[0] if self.eos_token_ids else None
        bos = special_tokens.get("bos_token")
        self.bos_token_id: int | None = self.backend.token_to_id(bos) if bos is not None else None
        self._byte_fallback = bool(getattr(backend.model, "byte_fallback", False))  # only BPE has it

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> Tokenizer:
        """Load ``tokenizer.json`` + ``tokenizer_config.json`` (+ eos ids from the model configs)."""
        model_dir = Path(model_dir)
        tokenizer_file = model_dir / "tokenizer.json"
        if not tokenizer_file.exists():
            raise FileNotFoundError(
                f"no tokenizer.json in {model_dir}; lorapage needs the fast-tokenizer file "
                "(save the tokenizer with transformers' save_pretrained to produce it)"
            )
        backend = tokenizers.Tokenizer.from_file(str(tokenizer_file))
        config = _read_json(model_dir / "tokenizer_config.json")
        special = {k: t for k in NAMED_SPECIAL_TOKENS if (t := _token_content(config.get(k))) is not None}
        _add_missing_special_tokens(backend, special, config)
        if "add_bos_token" in config or "add_eos_token" in config or backend.post_processor is None:
            _set_bos_eos_processor(
                backend, special, bool(config.get("add_bos_token")), bool(config.get("add_eos_token"))
            )
        extra_eos = _as_ids(_read_json(model_dir / "generation_config.json").get("eos_token_id"))
        extra_eos += _as_ids(_read_json(model_dir / "config.json").get("eos_token_id"))
        return cls(
            backend,
            special_tokens=special,
            chat_template=_read_chat_templates(model_dir, config),
            extra_eos_token_ids=extra_eos,
            name=str(model_dir),
        )

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added (special) tokens included."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    @functools.cached_property
    def max_chars_per_token(self) -> int:
        """The most input characters one token can stand for: the longest vocabulary entry (added
        tokens included), times 4 when the tokenizer normalizes its input first (Unicode
        composition turns at most 4 code points into one). A prompt of more than
        ``max_model_len x`` this many characters cannot fit the context, so it can be refused
        without tokenizing it.

        A byte-level entry has one character per byte and a byte-fallback piece (``<0xE2>``) six
        characters for one byte, so the entry's length bounds the characters it covers from above.
        """
        longest = max(map(len, self.backend.get_vocab(with_added_tokens=True)), default=1)
        return longest * (4 if self.backend.normalizer is not None else 1)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; ``add_special_tokens`` adds what the model adds (BOS for Llama)."""
        # encode_batch releases the GIL while it works and encode does not: a worker thread
        # tokenizing a long prompt must not stall the event loop's thread meanwhile.
        return self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def is_byte_piece(self, token_id: int) -> bool:
        """Whether ``token_id`` is a SentencePiece byte-fallback piece such as ``<0xE2>``."""
        return self._byte_fallback and _BYTE_TOKEN.match(self.backend.id_to_token(token_id) or "") is not None

    @property
    def tool_template(self) -> str | None:
        """The template a chat with tools gets: ``tool_use`` when the model names one, else the default."""
        return self.chat_templates.get("tool_use", self.chat_template)

    def template_name(self, tools: bool) -> str:
        """Which named template renders a chat (``tools``: with tools), as transformers picks it."""
        if tools and "tool_use" in self.chat_templates:
            return "tool_use"
        if "default" in self.chat_templates:
            return "default"
        if not self.chat_templates:
            raise InvalidRequestError(
                f"the model at {self.name} has no chat template; send a plain prompt to the completions route instead",
                param="messages",
            )
        raise InvalidRequestError(
            f"the model at {self.name} has chat templates named {sorted(self.chat_templates)} and no default one; "
            "send a plain prompt to the completions route, or give the model a default chat template",
            param="messages",
        )

    def _template(self, name: str) -> jinja2.Template:
        if name not in self._compiled:
            self._compiled[name] = _jinja_env().from_string(self.chat_templates[name])
        return self._compiled[name]

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any) -> str:
        """Render a conversation with the model's chat template, as transformers would (with
        ``tools``, its ``tool_use`` template when it has one).

        The template sees ``messages``, ``add_generation_prompt``, the special tokens
        (``bos_token``, ``eos_token``, ...) and any extra keyword (``tools``, ``documents``,
        ``enable_thinking``...). Encode the result with ``add_special_tokens=False`` when the
        template writes BOS itself.
        """
        variables = {
            **self.special_tokens,
            **kwargs,
            "messages": messages,
            "add_generation_prompt": add_generation_prompt,
        }
        return self._template(self.template_name(kwargs.get("tools") is not None)).render(**variables)

    @cached_property
    def takes_system_role(self) -> bool:
        """Whether the chat template renders a system message (Gemma 2's raises on one)."""
        probe = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
        try:
            self.apply_chat_template(probe)
        except Exception:  # any refusal of the probe: the template has no place for a system turn
            return False
        return True


def _add_missing_special_tokens(backend: tokenizers.Tokenizer, special: dict[str, str], config: dict) -> None:
    """Named special tokens absent from tokenizer.json are added, as transformers does on load."""
    extras = config.get("additional_special_tokens") or config.get("extra_special_tokens") or []
    contents = [*special.values(), *(_token_content(t) for t in extras if isinstance(t, (str, dict)))]
    missing = [c for c in dict.fromkeys(contents) if c is not None and backend.token_to_id(c) is None]
    if missing:
        backend.add_special_tokens([AddedToken(c, special=True, normalized=False) for c in missing])


def _set_bos_eos_processor(
    backend: tokenizers.Tokenizer, special: dict[str, str], add_bos: bool, add_eos: bool
) -> None:
    """Rebuild the post-processor from add_bos_token / add_eos_token, as transformers does when
    tokenizer_config.json sets either flag (or tokenizer.json has no post-processor)."""
    bos, eos = special.get("bos_token", ""), special.get("eos_token", "")
    add_bos = add_bos and backend.token_to_id(bos) is not None if bos else False
    add_eos = add_eos and backend.token_to_id(eos) is not None if eos else False
    single = f"{bos + ':0 ' if add_bos else ''}$A:0{' ' + eos + ':0' if add_eos else ''}"
    pair = f"{single}{' ' + bos + ':1' if add_bos else ''} $B:1{' ' + eos + ':1' if add_eos else ''}"
    ids = [(t, backend.token_to_id(t)) for t, on in ((bos, add_bos), (eos, add_eos)) if on]
    backend.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=ids)


class IncrementalDecoder:
    """Turns one request's generated token ids into text deltas as they arrive.

    Each :meth:`push` decodes a short window of recent tokens twice (without and with the new
    token) and returns what the new token added. Text is held back while it ends in U+FFFD (a
    multi-byte character split across tokens) or, for SentencePiece byte-fallback models, while
    the last token is a byte piece; :meth:`flush` releases what is still held when the request ends.

    Without ``prompt_ids``, the concatenated deltas plus :meth:`flush` equal
    ``tokenizer.backend.decode(generated_ids)``. With them, the last few prompt tokens are decoding context
    (as in vLLM), so a SentencePiece word piece that starts the answer keeps its leading space; for
    byte-level BPE models (Llama 3, Qwen2, the tiny model) the text is the same either way.
    """

    CONTEXT_TOKENS = 5

    def __init__(
        self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (), *, skip_special_tokens: bool = True
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        context = list(prompt_ids[-self.CONTEXT_TOKENS :]) if prompt_ids else []
        if self._decode(context).endswith("\ufffd"):
            context = []  # a prompt cut mid-character gives no clean place to start from
        self._ids: list[int] = context
        self._prefix_offset = 0  # window start: the tokens whose text is already out, as context
        self._read_offset = len(context)  # first token whose text is not out yet
        self._prefix_text: str | None = None  # decode of ids[prefix_offset:read_offset], cached

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.backend.decode(ids, skip_special_tokens=self.skip_special_tokens) if ids else ""

    def _pending(self) -> tuple[str, str]:
        if self._prefix_text is None:
            self._prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        return self._prefix_text, self._decode(self._ids[self._prefix_offset :])

    def _advance(self, prefix: str, text: str) -> str:
        if len(text) <= len(prefix) or not text.startswith(prefix):
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        self._prefix_text = None
        return text[len(prefix) :]

    def push(self, token_id: int) -> str:
        """Record one generated token; return the text it completes (often ``""``)."""
        self._ids.append(token_id)
        prefix, text = self._pending()
        if text.endswith("\ufffd") or self.tokenizer.is_byte_piece(token_id):
            return ""
        return self._advance(prefix, text)

    def flush(self) -> str:
        """Text still held back (an unfinished character decodes to U+FFFD); call once at the end."""
        return self._advance(*self._pending())


class NoText:
    """The detokenizer of a request with ``detokenize=False`` (vLLM's): token ids only, nothing decoded."""

    def push(self, token_id: int) -> str:
        return ""

    def flush(self) -> str:
        return ""
