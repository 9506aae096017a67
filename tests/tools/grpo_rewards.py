"""A reward module for tests/tools/test_posttrain.py (posttrain.grpo.reward_modules): the share of
completion words that are "w1", so samples of one prompt differ and the policy can learn it."""


def share_of_w1(record: dict, completion: str) -> float:
    words = completion.split()
    return sum(w == "w1" for w in words) / max(len(words), 1)


def register(registry) -> None:
    registry.register("share_of_w1", share_of_w1)
