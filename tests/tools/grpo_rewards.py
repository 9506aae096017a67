"""Reward modules for tests/tools/test_posttrain.py (posttrain.grpo.reward_modules): the share of
completion words that are "w1" (samples of one prompt differ and the policy can learn it), and the
completion's length in words over 6 (non-zero for the untrained model)."""


def share_of_w1(record: dict, completion: str) -> float:
    words = completion.split()
    return sum(w == "w1" for w in words) / max(len(words), 1)


def words_over_6(record: dict, completion: str) -> float:
    return len(completion.split()) / 6


def register(registry) -> None:
    registry.register("share_of_w1", share_of_w1)
    registry.register("words_over_6", words_over_6)
