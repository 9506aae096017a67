"""Write the bundled SFT and DPO sets: sft_instructions.jsonl (240) and preferences.jsonl (180).

Six simple, verifiable task families, each correct by construction; the preference set pairs the
correct reply (``chosen``) with a plausible wrong one of the same form (``rejected``):

    task          user asks                                     correct reply            rejected reply
    arithmetic    What is a +/- b? End ... "Answer: <number>".  "a + b = c.\\nAnswer: c" c off by 1, 2 or 10
    reverse       Reverse the letters of the word "w" ...       reversed(w)              two letters swapped, or w
    uppercase     Rewrite in capital letters: "p"               p.upper()                p.title(), or 1st word only
    count_letter  How many times does the letter "x" ... "w"?   "... \\nAnswer: n"       n +/- 1
    larger        Which number is larger, a or b? ...           max(a, b)                min(a, b)
    next_day      What day of the week comes after/before D?    the neighbouring day     the day on the other side

Every record carries a ``task`` field naming its family (the tests recompute each answer from the
user text). No question of arithmetic_heldout.jsonl appears here. About a third of the records
start with a system turn. Deterministic (fixed seeds).

    python -m engine.posttrain.data.make_sft [--out DIR]
"""
from __future__ import annotations

import random

from engine.posttrain.data.make_arithmetic import build_records as arithmetic_records
from engine.posttrain.data.make_arithmetic import problem, prompt_text, solve, write_all

SFT_SEED = 21
PREFERENCE_SEED = 22
HELDOUT_PREFERENCE_SEED = 23
NUM_HELDOUT_PREFERENCES = 48
NUM_SFT = 240
NUM_PREFERENCES = 180
TASKS = ("arithmetic", "reverse", "uppercase", "count_letter", "larger", "next_day")
SYSTEM = "You are a helpful assistant. Answer briefly and exactly."
DAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")
# Lowercase, no palindromes (a reversed word must differ from the word).
WORDS = ("planet", "garden", "window", "silver", "orange", "pencil", "rocket", "bridge", "castle", "forest",
         "guitar", "island", "jacket", "kitten", "lemon", "market", "needle", "ocean", "pepper", "rabbit",
         "saddle", "tomato", "umbrella", "valley", "winter", "yellow", "zebra", "anchor", "basket", "candle",
         "dragon", "engine", "feather", "glove", "harbor", "insect", "jungle", "ladder", "mirror", "number",
         "object", "puzzle", "river", "spring", "ticket", "violin", "wagon", "strawberry", "banana", "letter",
         "coffee", "bottle", "balloon", "cherry", "apple", "school", "summer", "little", "happy", "cookie")
ANSWER_LINE = 'End your reply with a line of the form "Answer: <number>".'


def _arithmetic(rng: random.Random) -> tuple[str, str, str]:
    a, op, b = problem(rng)
    c = solve(a, op, b)
    wrong = c + rng.choice((-10, -2, -1, 1, 2, 10))
    if wrong < 0:
        wrong = c + rng.choice((1, 2, 10))
    return prompt_text(a, op, b), f"{a} {op} {b} = {c}.\nAnswer: {c}", f"{a} {op} {b} = {wrong}.\nAnswer: {wrong}"


def _reverse(rng: random.Random) -> tuple[str, str, str]:
    word = rng.choice(WORDS)
    right = word[::-1]
    # A near miss: two adjacent different letters of the reversal swapped, or the word unchanged.
    spots = [i for i in range(len(right) - 1) if right[i] != right[i + 1]]
    if rng.random() < 0.75:
        i = rng.choice(spots)
        wrong = right[:i] + right[i + 1] + right[i] + right[i + 2:]
    else:
        wrong = word
    return f'Reverse the letters of the word "{word}". Reply with the reversed word only.', right, wrong


def _uppercase(rng: random.Random) -> tuple[str, str, str]:
    phrase = " ".join(rng.sample(WORDS, rng.randint(2, 3)))
    right = phrase.upper()
    if rng.random() < 0.5:
        wrong = phrase.title()
    else:
        first, rest = phrase.split(" ", 1)
        wrong = f"{first.upper()} {rest}"
    return f'Rewrite in capital letters: "{phrase}"', right, wrong


def _count_letter(rng: random.Random) -> tuple[str, str, str]:
    word = rng.choice(WORDS)
    if rng.random() < 0.85:
        letter = rng.choice(sorted(set(word)))
    else:
        letter = rng.choice(sorted(set("abcdefghijklmnopqrstuvwxyz") - set(word)))
    n = word.count(letter)
    wrong = n + 1 if n == 0 or rng.random() < 0.5 else n - 1

    def say(k: int) -> str:
        return f'The letter "{letter}" appears {k} time{"" if k == 1 else "s"} in "{word}".\nAnswer: {k}'

    return f'How many times does the letter "{letter}" appear in "{word}"? {ANSWER_LINE}', say(n), say(wrong)


def _larger(rng: random.Random) -> tuple[str, str, str]:
    a, b = rng.sample(range(1, 100), 2)
    return f"Which number is larger, {a} or {b}? Reply with the number only.", str(max(a, b)), str(min(a, b))


def _next_day(rng: random.Random) -> tuple[str, str, str]:
    i = rng.randrange(7)
    step = rng.choice((1, -1))
    word = "after" if step == 1 else "before"
    right, wrong = DAYS[(i + step) % 7], DAYS[(i - step) % 7]
    return f"What day of the week comes {word} {DAYS[i]}? Reply with the day only.", right, wrong


_MAKERS = {"arithmetic": _arithmetic, "reverse": _reverse, "uppercase": _uppercase,
           "count_letter": _count_letter, "larger": _larger, "next_day": _next_day}


def _examples(seed: int, count: int, *, exclude: frozenset = frozenset()):
    """(task, system or None, user, right, wrong) x count: an equal share per task, shuffled; user texts
    are distinct while the family has new ones (next_day has only 14), and none is in ``exclude``
    (except next_day's, which cannot avoid repeats)."""
    rng = random.Random(seed)
    # Keep the GRPO held-out questions unseen, so that their reward measures generalisation after SFT/DPO.
    heldout = {r["messages"][-1]["content"] for r in arithmetic_records()["arithmetic_heldout.jsonl"]}
    out, seen = [], set(heldout) | set(exclude)
    for k in range(count):
        task = TASKS[k % len(TASKS)]
        for _ in range(100):  # next_day has only 14 distinct questions: repeats allowed once exhausted
            user, right, wrong = _MAKERS[task](rng)
            if user not in seen:
                break
        assert user not in heldout, user
        seen.add(user)
        assert right != wrong, (task, user)
        out.append((task, SYSTEM if rng.random() < 1 / 3 else None, user, right, wrong))
    rng.shuffle(out)
    return out


def _prompt(system, user) -> list[dict]:
    head = [{"role": "system", "content": system}] if system else []
    return head + [{"role": "user", "content": user}]


def sft_records() -> list[dict]:
    return [{"messages": _prompt(system, user) + [{"role": "assistant", "content": right}], "task": task}
            for task, system, user, right, _ in _examples(SFT_SEED, NUM_SFT)]


def preference_records() -> list[dict]:
    return [{"prompt": _prompt(system, user), "chosen": [{"role": "assistant", "content": right}],
             "rejected": [{"role": "assistant", "content": wrong}], "task": task}
            for task, system, user, right, wrong in _examples(PREFERENCE_SEED, NUM_PREFERENCES)]


def heldout_preference_records() -> list[dict]:
    """Preference pairs whose questions are not in preferences.jsonl (DPO's validation set)."""
    train = frozenset(r["prompt"][-1]["content"] for r in preference_records())
    return [{"prompt": _prompt(system, user), "chosen": [{"role": "assistant", "content": right}],
             "rejected": [{"role": "assistant", "content": wrong}], "task": task}
            for task, system, user, right, wrong in _examples(HELDOUT_PREFERENCE_SEED, NUM_HELDOUT_PREFERENCES,
                                                              exclude=train)]


def build_records() -> dict[str, list[dict]]:
    """{file name: records}, the exact content of the bundled files."""
    return {"sft_instructions.jsonl": sft_records(), "preferences.jsonl": preference_records(),
            "preferences_heldout.jsonl": heldout_preference_records()}


def main() -> None:
    write_all(build_records, __doc__.splitlines()[0])


if __name__ == "__main__":
    main()
