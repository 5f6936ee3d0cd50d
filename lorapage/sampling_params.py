"""Per-request sampling parameters. Every row of a batch carries its own."""

from __future__ import annotations

from dataclasses import dataclass, field

from lorapage.errors import InvalidRequestError

SAMPLING_EPS = 1e-5  # temperatures below this are greedy, as in vLLM: logits / T would overflow
MAX_STOP_SEQUENCES = 4  # as OpenAI
MAX_STOP_CHARS = 256  # per stop string: the engine matches every stop against the text each token
MAX_STOP_TOKEN_IDS = 64  # every generated token is looked up among them


@dataclass(frozen=True)
class SamplingParams:
    """How one request picks its tokens and when it stops.

    ``temperature`` below :data:`SAMPLING_EPS` (0 included) is greedy. ``top_k == 0`` and
    ``top_p == 1`` disable those filters.
    ``logprobs`` is the number of top alternatives to report per token (``None`` reports none;
    ``0`` reports only the chosen token's log-probability). ``seed`` makes sampling reproducible
    for this request regardless of what else is in the batch.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    include_stop_str_in_output: bool = False
    extra: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        self.validate()

    def validate(self) -> None:
        """Raise :class:`InvalidRequestError` naming the first field outside its range."""
        checks = (
            (isinstance(self.max_tokens, int) and self.max_tokens >= 1, "max_tokens", "an integer >= 1"),
            (0.0 <= self.temperature <= 2.0, "temperature", "between 0 and 2"),
            (0.0 < self.top_p <= 1.0, "top_p", "in (0, 1]"),
            (isinstance(self.top_k, int) and self.top_k >= 0, "top_k", "an integer >= 0 (0 disables)"),
            (self.logprobs is None or 0 <= self.logprobs <= 20, "logprobs", "between 0 and 20"),
            (-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", "between -2 and 2"),
            (-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", "between -2 and 2"),
            (len(self.stop) <= MAX_STOP_SEQUENCES, "stop", f"at most {MAX_STOP_SEQUENCES} sequences"),
            (all(isinstance(s, str) and s for s in self.stop), "stop", "non-empty strings"),
            (
                all(not isinstance(s, str) or len(s) <= MAX_STOP_CHARS for s in self.stop),
                "stop",
                f"strings of at most {MAX_STOP_CHARS} characters",
            ),
            (len(self.stop_token_ids) <= MAX_STOP_TOKEN_IDS, "stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} ids"),
        )
        for ok, name, expected in checks:
            if not ok:
                got = repr(getattr(self, name))
                got = got if len(got) <= 100 else f"{got[:100]}... ({len(got)} characters)"  # no echo of a huge value
                raise InvalidRequestError(f"{name} must be {expected}; got {got}", param=name)

    @property
    def greedy(self) -> bool:
        """Whether this request takes the argmax (a temperature too small to divide by)."""
        return self.temperature < SAMPLING_EPS
