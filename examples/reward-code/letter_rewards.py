"""A reward function shipped without an image (examples/grpo-reward-configmap-tiny-cpu.yaml):

    kubectl create configmap letter-rewards --from-file=examples/reward-code/letter_rewards.py

It scores the tiny toy task as the built-in repeat_letter does: the share of the response's
characters that are the answer letter. Only the standard library: the worker image has nothing
of yours.
"""


def share_of_letter(batch):
    rewards = []
    for sample in batch:
        letters = sample.response.strip()
        rewards.append(sum(c == sample.answer for c in letters) / len(letters) if letters else 0.0)
    return rewards
