"""engine/posttrain/rewards and the bundled data: answer parsing and the format check on written-out cases,
the registry (register, decorator, duplicates, the unknown-name error listing registered names, record
checks), and engine/posttrain/data: every file parses, is what its script writes (byte for byte), stays
small, and every answer is recomputed from the question text (SFT, preferences, arithmetic)."""
import json
import os
import re

import pytest

from engine.posttrain.data import make_arithmetic, make_sft
from engine.posttrain.rewards import (RewardRegistry, arithmetic_reward, default_registry, final_number,
                                      format_reward)

DATA = os.path.dirname(make_arithmetic.__file__)


# ------------------------------------------------------------------------------------------ arithmetic
@pytest.mark.parametrize("completion,answer,reward", [
    ("17 + 25 = 42", 42, 1.0),
    ("The answer is 12.", 12, 1.0),
    ("The answer is 12.", 13, 0.0),
    ("Let me think.\n#### 12", 12, 1.0),
    ("17 + 25 = 42.\nAnswer: 42", 42, 1.0),
    ("**Answer:** 42", 42, 1.0),
    ("The answer is: 7", 7, 1.0),
    ("$\\boxed{19}$", 19, 1.0),
    ("Answer: 42\n\nI hope this helps with question 3.", 42, 1.0),  # the marker beats a later number
    ("The answer is 12, not 13.", 12, 1.0),
    ("Answer: 40\nWait, 17 + 25 = 42. Answer: 42", 42, 1.0),  # the last marker wins
    ("First 3, then 5, so 8", 8, 1.0),
    ("It is 12.0", 12, 1.0),
    ("It is 12.5", 12, 0.0),
    ("x = -5", -5, 1.0),
    ("5 - 3", 3, 1.0),  # "5-3"'s minus is an operator, not the sign of 3
    ("8-3=5", 5, 1.0),
    ("It is \u22124.", -4, 1.0),
    ("1,234 apples", 1234, 1.0),
    ("I don't know.", 0, 0.0),
    ("", 7, 0.0),
    ("42", "42", 1.0),  # a string answer in the record works too
])
def test_arithmetic_reward(completion, answer, reward):
    assert arithmetic_reward({"answer": answer}, completion) == reward


def test_final_number_and_record_errors():
    assert final_number("no digits") is None
    assert str(final_number("a 3 b 44 c")) == "44"
    with pytest.raises(ValueError, match="has no 'answer' field"):
        arithmetic_reward({"messages": []}, "12")
    with pytest.raises(ValueError, match="is not a finite number"):
        arithmetic_reward({"answer": "twelve"}, "12")


@pytest.mark.parametrize("completion,reward", [
    ("17 + 25 = 42.\nAnswer: 42", 1.0),
    ("Answer: 42", 1.0),
    ("answer:42.\n\n  ", 1.0),
    ("Answer: -3", 1.0),
    ("Answer: 42\nThanks!", 0.0),  # not the last line
    ("The answer is 42.", 0.0),
    ("Answer: forty-two", 0.0),
    ("Answer: 4.5", 0.0),  # an integer
    ("Answer: 42 apples", 0.0),
    ("", 0.0),
])
def test_format_reward(completion, reward):
    assert format_reward({}, completion) == reward


# -------------------------------------------------------------------------------------------- registry
def test_registry_register_get_and_unknown_name():
    reg = RewardRegistry()
    reg.register("length", lambda record, completion: float(len(completion)))

    @reg.register("const")
    def const(record, completion):
        return 1

    assert reg.names() == ["const", "length"] and "const" in reg and "nope" not in reg
    assert reg.get("length")({}, "abc") == 3.0
    assert reg.score({"reward": "const"}, "x") == 1.0 and isinstance(reg.score({"reward": "const"}, "x"), float)
    with pytest.raises(ValueError, match=r"unknown reward function 'nope'; registered: \['const', 'length'\]"):
        reg.get("nope")
    with pytest.raises(ValueError, match="'const' is already registered"):
        reg.register("const", const)
    reg.register("const", lambda r, c: 2.0, overwrite=True)
    assert reg.get("const")({}, "") == 2.0
    with pytest.raises(ValueError, match="must be callable"):
        reg.register("bad", 3)
    with pytest.raises(ValueError, match="non-empty string"):
        reg.register("", const)


def test_registry_checks_records_before_training():
    reg = default_registry()
    reg.check_records([{"reward": "arithmetic"}, {"reward": "format"}])
    with pytest.raises(ValueError, match=r"prompt record 1: unknown reward function 'exact'; "
                                         r"registered: \['arithmetic', 'format'\]"):
        reg.check_records([{"reward": "arithmetic"}, {"reward": "exact"}])
    with pytest.raises(ValueError, match="prompt record 0 has no 'reward' field"):
        reg.check_records([{"answer": 3}])


def test_default_registry_is_fresh_each_time():
    a, b = default_registry(), default_registry()
    a.register("extra", lambda r, c: 0.0)
    assert "extra" not in b and b.names() == ["arithmetic", "format"]
    assert b.get("arithmetic") is arithmetic_reward and b.get("format") is format_reward


# ------------------------------------------------------------------------------------------------ data
def _read(name):
    with open(os.path.join(DATA, name), encoding="utf-8") as f:
        return [json.loads(line) for line in f]


@pytest.mark.parametrize("module", [make_arithmetic, make_sft])
def test_bundled_files_are_what_the_scripts_write(module):
    for name, records in module.build_records().items():
        path = os.path.join(DATA, name)
        with open(path, encoding="utf-8") as f:
            text = f.read()
        assert text == "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), name
        assert os.path.getsize(path) < 100_000, name


_ARITH = re.compile(r'^What is (\d+) ([+-]) (\d+)\? End your reply with a line of the form "Answer: <number>"\.$')


def _solve(question):
    a, op, b = _ARITH.match(question).groups()
    return int(a) + int(b) if op == "+" else int(a) - int(b)


def test_arithmetic_prompts_and_answers():
    train, held = _read("arithmetic_train.jsonl"), _read("arithmetic_heldout.jsonl")
    assert len(train) == 256 and len(held) == 64
    reg = default_registry()
    reg.check_records(train + held)
    for r in train + held:
        assert set(r) == {"messages", "answer", "reward"} and r["reward"] == "arithmetic"
        (msg,) = r["messages"]
        assert msg["role"] == "user"
        a, op, b = _ARITH.match(msg["content"]).groups()
        assert int(a) < 100 and int(b) < 100 and r["answer"] >= 0
        assert r["answer"] == _solve(msg["content"])
        good = f"{a} {op} {b} = {r['answer']}.\nAnswer: {r['answer']}"
        assert reg.score(r, good) == 1.0 and format_reward(r, good) == 1.0
        assert reg.score(r, f"Answer: {r['answer'] + 1}") == 0.0
    questions = [r["messages"][0]["content"] for r in train + held]
    assert len(set(questions)) == len(questions)  # distinct, so held-out is unseen in train


def _recompute(task, user):
    """The correct reply, recomputed from the user text alone."""
    if task == "arithmetic":
        c = _solve(user)
        a, op, b = _ARITH.match(user).groups()
        return f"{a} {op} {b} = {c}.\nAnswer: {c}"
    if task == "reverse":
        return re.fullmatch(r'Reverse the letters of the word "(\w+)"\. Reply with the reversed word only\.',
                            user).group(1)[::-1]
    if task == "uppercase":
        return re.fullmatch(r'Rewrite in capital letters: "([a-z ]+)"', user).group(1).upper()
    if task == "count_letter":
        letter, word = re.match(r'How many times does the letter "(\w)" appear in "(\w+)"\?', user).groups()
        n = sum(ch == letter for ch in word)
        return f'The letter "{letter}" appears {n} time{"" if n == 1 else "s"} in "{word}".\nAnswer: {n}'
    if task == "larger":
        a, b = map(int, re.fullmatch(r"Which number is larger, (\d+) or (\d+)\? Reply with the number only\.",
                                     user).groups())
        return str(a if a > b else b)
    if task == "next_day":
        days = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
        side, day = re.fullmatch(r"What day of the week comes (after|before) (\w+)\? Reply with the day only\.",
                                 user).groups()
        return days[(days.index(day) + (1 if side == "after" else -1)) % 7]
    raise AssertionError(task)


def _check_prompt(messages):
    roles = [m["role"] for m in messages]
    assert roles in (["user"], ["system", "user"]), roles
    assert all(isinstance(m["content"], str) and m["content"] for m in messages)


def test_sft_instructions_are_correct():
    records = _read("sft_instructions.jsonl")
    assert len(records) == 240
    assert {r["task"] for r in records} == set(make_sft.TASKS)
    for r in records:
        *prompt, reply = r["messages"]
        _check_prompt(prompt)
        assert reply["role"] == "assistant"
        assert reply["content"] == _recompute(r["task"], prompt[-1]["content"]), r


def test_preferences_chosen_correct_rejected_wrong():
    records = _read("preferences.jsonl")
    assert len(records) == 180
    assert {r["task"] for r in records} == set(make_sft.TASKS)
    for r in records:
        _check_prompt(r["prompt"])
        (chosen,), (rejected,) = r["chosen"], r["rejected"]
        assert chosen["role"] == rejected["role"] == "assistant"
        right = _recompute(r["task"], r["prompt"][-1]["content"])
        assert chosen["content"] == right and rejected["content"] != right, r
        if r["task"] in ("arithmetic", "count_letter"):
            # Same form, wrong number: the format reward cannot tell them apart, the arithmetic one can.
            answer = int(right.rsplit(" ", 1)[1])
            assert format_reward({}, rejected["content"]) == 1.0
            assert arithmetic_reward({"answer": answer}, rejected["content"]) == 0.0
            assert arithmetic_reward({"answer": answer}, chosen["content"]) == 1.0


def test_heldout_arithmetic_unseen_in_sft_and_preferences():
    held = {r["messages"][0]["content"] for r in _read("arithmetic_heldout.jsonl")}
    users = [r["messages"][-2]["content"] for r in _read("sft_instructions.jsonl")]
    users += [r["prompt"][-1]["content"] for r in _read("preferences.jsonl")]
    assert not held & set(users)
