"""Write the bundled GRPO arithmetic prompts: arithmetic_train.jsonl (256) and arithmetic_heldout.jsonl (64).

Each record: ``{"messages": [{"role": "user", "content": PROMPT}], "answer": int, "reward": "arithmetic"}``.
Problems are ``a + b`` or ``a - b`` (a >= b, so answers are >= 0) with operands of one or two digits,
all distinct (no problem is in both files). Deterministic: a fixed seed, the same files on every run.

    python -m engine.posttrain.data.make_arithmetic [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import os
import random

SEED = 20
NUM_TRAIN = 256
NUM_HELDOUT = 64
# The format the shipped "format" reward checks (engine/posttrain/rewards.py).
PROMPT = 'What is {a} {op} {b}? End your reply with a line of the form "Answer: <number>".'


def problem(rng: random.Random) -> tuple[int, str, int]:
    """One (a, op, b): both one-digit, one of each, or both two-digit, each a third of the time."""
    kind = rng.randrange(3)
    a = rng.randint(1, 9) if kind == 0 else rng.randint(10, 99)
    b = rng.randint(1, 9) if kind in (0, 1) else rng.randint(10, 99)
    if rng.random() < 0.5:
        a, b = b, a
    op = rng.choice("+-")
    if op == "-" and a < b:
        a, b = b, a
    return a, op, b


def solve(a: int, op: str, b: int) -> int:
    return a + b if op == "+" else a - b


def prompt_text(a: int, op: str, b: int) -> str:
    return PROMPT.format(a=a, op=op, b=b)


def build_records() -> dict[str, list[dict]]:
    """{file name: records}, the exact content of the bundled files."""
    rng = random.Random(SEED)
    seen: set[tuple[int, str, int]] = set()
    problems = []
    while len(problems) < NUM_TRAIN + NUM_HELDOUT:
        p = problem(rng)
        if p not in seen:
            seen.add(p)
            problems.append(p)
    records = [{"messages": [{"role": "user", "content": prompt_text(*p)}], "answer": solve(*p),
                "reward": "arithmetic"} for p in problems]
    return {"arithmetic_train.jsonl": records[:NUM_TRAIN], "arithmetic_heldout.jsonl": records[NUM_TRAIN:]}


def write_jsonl(path: str, records: list[dict]) -> None:
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        for r in records:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")


def write_all(build, description: str) -> None:
    """The generator scripts' command line: write ``build()``'s files into ``--out`` (default: here)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--out", default=os.path.dirname(os.path.abspath(__file__)))
    args = parser.parse_args()
    for name, records in build().items():
        write_jsonl(os.path.join(args.out, name), records)
        print(f"{name}: {len(records)} records")


def main() -> None:
    write_all(build_records, __doc__.splitlines()[0])


if __name__ == "__main__":
    main()
