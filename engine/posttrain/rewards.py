"""Reward functions for GRPO: plain Python callables registered by name.

A reward is ``fn(record: dict, completion: str) -> float``: ``record`` is the prompt record from
the JSONL file (``{"messages": [...], "answer": 42, "reward": "arithmetic"}``), ``completion`` the
decoded text the policy generated. Rewards live in a :class:`RewardRegistry` that the caller builds
and passes explicitly; there is no module-level registry. :func:`default_registry` returns a *new*
registry holding the two shipped rewards:

- ``arithmetic``: 1.0 when the completion's final answer equals ``record["answer"]`` exactly (as a
  number), else 0.0. The final answer is the number after the *last* explicit marker (``Answer:``,
  ``answer is``, ``####``, ``\\boxed{...}``), or, with no marker, the last number in the completion.
  Numbers may carry a sign (``-`` or ``\u2212``), thousands commas (``1,234``) and a zero fraction
  (``12.0`` equals 12; ``12.5`` does not).
- ``format``: 1.0 when the completion's last non-empty line is ``Answer: <integer>`` (case-insensitive
  ``answer``, optional spaces and one trailing period), else 0.0. The bundled arithmetic prompts
  ask for exactly this line.
"""
from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from typing import Callable, Iterable, Mapping, Optional

RewardFn = Callable[[dict, str], float]

# A number: optional sign not glued to a preceding word/digit ("5-3" is 5 and 3), thousands groups or
# plain digits, optional fraction. A trailing sentence period is not a fraction ("is 12." -> 12).
_NUMBER = r"(?<![\w.])[-\u2212]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?"
_NUMBER_RE = re.compile(_NUMBER)
_MARKER_RE = re.compile(
    r"(?:answer\s*(?:is\s*:?|:|=)|####|\\boxed\{)\s*\**\s*(?:=\s*)?\$?\s*(" + _NUMBER.replace(r"(?<![\w.])", "") + ")",
    re.IGNORECASE)
_FORMAT_RE = re.compile(r"^answer:[ \t]*[-\u2212]?\d+[ \t]*\.?$", re.IGNORECASE)


def _to_decimal(text: str) -> Optional[Decimal]:
    try:
        return Decimal(text.replace("\u2212", "-").replace(",", ""))
    except InvalidOperation:
        return None


def final_number(completion: str) -> Optional[Decimal]:
    """The completion's final answer as a Decimal (see the module doc), or None when it has no number."""
    markers = _MARKER_RE.findall(completion)
    if markers:
        return _to_decimal(markers[-1])
    numbers = _NUMBER_RE.findall(completion)
    return _to_decimal(numbers[-1]) if numbers else None


def _answer_of(record: Mapping) -> Decimal:
    fix = "give the expected number, e.g. \"answer\": 42, or drop the record"
    if "answer" not in record:
        raise ValueError(f"reward 'arithmetic': the record has no 'answer' field (keys: {sorted(record)}); {fix}")
    value = _to_decimal(str(record["answer"]).strip())
    if value is None or not value.is_finite():
        raise ValueError(f"reward 'arithmetic': record answer {record['answer']!r} is not a finite number; {fix}")
    return value


def arithmetic_reward(record: dict, completion: str) -> float:
    """1.0 when the completion's final number equals ``record["answer"]``, else 0.0."""
    expected = _answer_of(record)
    got = final_number(completion)
    return 1.0 if got is not None and got == expected else 0.0


# A reward declares the record fields it reads as ``fn.check(record)`` (ValueError naming the field and the
# fix): GRPO's record preparation calls it, so a bad record fails before training, not in the rollout that
# first draws it (engine/posttrain/rollout.py:prompt_records).
arithmetic_reward.check = _answer_of


def format_reward(record: dict, completion: str) -> float:
    """1.0 when the completion's last non-empty line is ``Answer: <integer>``, else 0.0."""
    lines = [line.strip() for line in completion.strip().splitlines() if line.strip()]
    return 1.0 if lines and _FORMAT_RE.match(lines[-1]) else 0.0


class RewardRegistry:
    """Named reward functions. Build one (or take :func:`default_registry`) and pass it explicitly."""

    def __init__(self) -> None:
        self._fns: dict[str, RewardFn] = {}

    def register(self, name: str, fn: Optional[RewardFn] = None, *, overwrite: bool = False):
        """Register ``fn`` under ``name``; without ``fn``, return a decorator that does.

        Re-registering a name raises unless ``overwrite=True``.
        """
        if not isinstance(name, str) or not name:
            raise ValueError(f"RewardRegistry.register: name must be a non-empty string, got {name!r}")

        def add(f: RewardFn) -> RewardFn:
            if not callable(f):
                raise ValueError(f"RewardRegistry.register: reward {name!r} must be callable "
                                 f"fn(record: dict, completion: str) -> float, got {type(f).__name__}")
            if name in self._fns and not overwrite:
                raise ValueError(f"RewardRegistry.register: reward {name!r} is already registered; "
                                 f"pick another name or pass overwrite=True")
            self._fns[name] = f
            return f

        return add if fn is None else add(fn)

    def get(self, name: str) -> RewardFn:
        """The reward registered as ``name``; a ValueError listing the registered names if there is none."""
        try:
            return self._fns[name]
        except (KeyError, TypeError):
            raise ValueError(f"unknown reward function {name!r}; registered: {self.names()}. Register it with "
                             f"RewardRegistry.register(name, fn) before training") from None

    def names(self) -> list[str]:
        """Registered names, sorted."""
        return sorted(self._fns)

    def __contains__(self, name: object) -> bool:
        return name in self._fns

    def check_records(self, records: Iterable[Mapping], *, key: str = "reward") -> None:
        """Raise a ValueError before training if any record lacks ``key`` or names an unregistered reward."""
        for i, record in enumerate(records):
            if key not in record:
                raise ValueError(f"prompt record {i} has no {key!r} field naming its reward function; "
                                 f"registered: {self.names()}")
            if record[key] not in self._fns:
                raise ValueError(f"prompt record {i}: unknown reward function {record[key]!r}; "
                                 f"registered: {self.names()}")

    def score(self, record: Mapping, completion: str, *, key: str = "reward") -> float:
        """``float(fn(record, completion))`` with ``fn`` the reward that ``record[key]`` names."""
        return float(self.get(record[key])(dict(record), completion))


def default_registry() -> RewardRegistry:
    """A new registry with the shipped rewards ``arithmetic`` and ``format`` (module doc)."""
    registry = RewardRegistry()
    registry.register("arithmetic", arithmetic_reward)
    registry.register("format", format_reward)
    return registry
