"""Per-request sampling parameters. Every row of a batch carries its own."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from lorapage.config import LOGPROBS_MODES
from lorapage.errors import InvalidRequestError
from lorapage.structured.spec import StructuredSpec

SAMPLING_EPS = 1e-5  # temperatures below this are greedy, as in vLLM: logits / T would overflow
MAX_STOP_SEQUENCES = 16  # OpenAI takes 4; lm-eval sends its `until` strings plus EOS
MAX_STOP_CHARS = 256  # per stop string: the engine matches every stop against the text each token
MAX_STOP_TOKEN_IDS = 64  # every generated token is looked up among them
MAX_LOGIT_BIAS = 1024  # entries (OpenAI: values in [-100, 100])
MAX_ALLOWED_TOKEN_IDS = 262_144  # a whole large vocabulary
MAX_BAD_WORDS = 64
MAX_N = 64  # sequences per request


@dataclass(frozen=True)
class SamplingParams:
    """How one request picks its tokens and when it stops.

    ``temperature`` below :data:`SAMPLING_EPS` (0 included) is greedy. ``top_k == 0`` and
    ``top_p == 1`` disable those filters.
    ``logprobs`` is the number of top alternatives to report per token (``None`` reports none;
    ``0`` reports only the chosen token's log-probability), in ``logprobs_mode`` (vLLM's names;
    None: the engine's ``EngineConfig.logprobs_mode``):
    ``raw_logprobs`` / ``raw_logits`` of the model, or ``processed_logprobs`` /
    ``processed_logits`` of the distribution the token was drawn from (after the request's
    processors, temperature, top-k, min-p and top-p; a greedy row's after its processors).
    ``seed`` makes sampling reproducible for this request regardless of what else is in the batch.
    """

    max_tokens: int = 16
    n: int = 1  # sequences from one prompt: one prefill, then branches (seed k + i for branch i)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    logprobs_mode: str | None = None  # one of LOGPROBS_MODES; None: the engine's (EngineConfig.logprobs_mode)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    include_stop_str_in_output: bool = False
    # vLLM's extras: per row, like everything above.
    min_tokens: int = 0  # EOS and stop_token_ids cannot end the output before this many tokens
    repetition_penalty: float = 1.0  # > 1 discourages tokens of the prompt and output (HF's rule)
    min_p: float = 0.0  # drop tokens below min_p x the most likely token's probability
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit); a dict is accepted
    allowed_token_ids: tuple[int, ...] | None = None  # only these may be chosen
    bad_words: tuple[str, ...] = ()  # these words are never completed (token ids made at intake)
    skip_special_tokens: bool = True  # leave special tokens out of the text
    detokenize: bool = True  # False: token ids only, the text left empty (no stop strings then)
    truncate_prompt_tokens: int | None = None  # keep only the prompt's last this many tokens
    prompt_logprobs: int | None = None  # logprobs of every prompt token, with this many alternatives
    structured: StructuredSpec | None = None  # the output must follow it (JSON schema, regex, ...)
    extra: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if isinstance(self.logit_bias, Mapping):
            object.__setattr__(self, "logit_bias", tuple(self.logit_bias.items()))
        object.__setattr__(self, "logit_bias", tuple((k, v) for k, v in self.logit_bias))
        if self.allowed_token_ids is not None:
            object.__setattr__(self, "allowed_token_ids", tuple(self.allowed_token_ids))
        object.__setattr__(self, "bad_words", tuple(self.bad_words))
        self.validate()

    def validate(self) -> None:
        """Raise :class:`InvalidRequestError` naming the first field outside its range."""
        checks = (
            (isinstance(self.max_tokens, int) and self.max_tokens >= 1, "max_tokens", "an integer >= 1"),
            (type(self.n) is int and 1 <= self.n <= MAX_N, "n", f"an integer between 1 and {MAX_N}"),
            (0.0 <= self.temperature <= 2.0, "temperature", "between 0 and 2"),
            (0.0 < self.top_p <= 1.0, "top_p", "in (0, 1]"),
            (isinstance(self.top_k, int) and self.top_k >= 0, "top_k", "an integer >= 0 (0 disables)"),
            (self.logprobs is None or 0 <= self.logprobs <= 20, "logprobs", "between 0 and 20"),
            (
                self.logprobs_mode is None or self.logprobs_mode in LOGPROBS_MODES,
                "logprobs_mode",
                "one of " + ", ".join(LOGPROBS_MODES),
            ),
            (-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", "between -2 and 2"),
            (-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", "between -2 and 2"),
            (len(self.stop) <= MAX_STOP_SEQUENCES, "stop", f"at most {MAX_STOP_SEQUENCES} sequences"),
            (self.detokenize or not self.stop, "stop", "empty with detokenize=False (stop strings are found in text)"),
            (all(isinstance(s, str) and s for s in self.stop), "stop", "non-empty strings"),
            (
                all(not isinstance(s, str) or len(s) <= MAX_STOP_CHARS for s in self.stop),
                "stop",
                f"strings of at most {MAX_STOP_CHARS} characters",
            ),
            (len(self.stop_token_ids) <= MAX_STOP_TOKEN_IDS, "stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} ids"),
            (_ints(self.stop_token_ids), "stop_token_ids", "token ids (integers >= 0)"),
            (
                isinstance(self.min_tokens, int) and 0 <= self.min_tokens <= self.max_tokens,
                "min_tokens",
                "an integer between 0 and max_tokens",
            ),
            (0.0 < self.repetition_penalty <= 10.0, "repetition_penalty", "in (0, 10]"),
            (0.0 <= self.min_p <= 1.0, "min_p", "between 0 and 1"),
            (len(self.logit_bias) <= MAX_LOGIT_BIAS, "logit_bias", f"at most {MAX_LOGIT_BIAS} entries"),
            (
                all(_int(k) and math.isfinite(v) and -100 <= v <= 100 for k, v in self.logit_bias),
                "logit_bias",
                "token ids mapped to biases between -100 and 100",
            ),
            (
                self.allowed_token_ids is None
                or (0 < len(self.allowed_token_ids) <= MAX_ALLOWED_TOKEN_IDS and _ints(self.allowed_token_ids)),
                "allowed_token_ids",
                f"a non-empty list of at most {MAX_ALLOWED_TOKEN_IDS} token ids",
            ),
            (
                len(self.bad_words) <= MAX_BAD_WORDS
                and all(isinstance(w, str) and 0 < len(w) <= MAX_STOP_CHARS for w in self.bad_words),
                "bad_words",
                f"at most {MAX_BAD_WORDS} non-empty strings of at most {MAX_STOP_CHARS} characters",
            ),
            (
                self.truncate_prompt_tokens is None
                or (_int(self.truncate_prompt_tokens) and self.truncate_prompt_tokens >= 1),
                "truncate_prompt_tokens",
                "an integer >= 1",
            ),
            (
                self.prompt_logprobs is None or (_int(self.prompt_logprobs) and self.prompt_logprobs <= 20),
                "prompt_logprobs",
                "between 0 and 20",
            ),
            (self.structured is None or isinstance(self.structured, StructuredSpec), "structured", "a StructuredSpec"),
        )
        for ok, name, expected in checks:
            if not ok:
                raise InvalidRequestError(f"{name} must be {expected}; got {_shown(getattr(self, name))}", param=name)

    @property
    def greedy(self) -> bool:
        """Whether this request takes the argmax (a temperature too small to divide by)."""
        return self.temperature < SAMPLING_EPS


def _int(v: object) -> bool:
    return type(v) is int and v >= 0


def _ints(values: tuple) -> bool:
    return all(type(v) is int and v >= 0 for v in values)


def _shown(value: Any) -> str:
    """A refused value as the client sent it: a list as JSON with its length (never a Python
    tuple), anything else as its repr; cut at 100 characters (no echo of a huge value)."""
    if isinstance(value, tuple | list):
        text = json.dumps(list(value), ensure_ascii=False, default=repr)
        text = text if len(text) <= 100 else f"{text[:100]}... ({len(text)} characters)"
        return f"{len(value)}: {text}"
    text = repr(value)
    return text if len(text) <= 100 else f"{text[:100]}... ({len(text)} characters)"
