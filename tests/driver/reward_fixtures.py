"""Reward functions the reward-worker tests name by import path, as a job's spec.reward.function would."""

from __future__ import annotations

import os
import time

SECONDS_PER_SAMPLE = 0.25


def slow_length_shaped(batch):
    """A verifier that takes SECONDS_PER_SAMPLE per sample (a sandbox, a judge call) and shapes by
    length: extra_info's weight times the share of the response budget used. Each call notes its
    process id in extra_info's pid_dir, so a test can see which workers ran."""
    out = []
    for x in batch:
        time.sleep(SECONDS_PER_SAMPLE)
        if x.extra_info.get("pid_dir"):
            with open(os.path.join(x.extra_info["pid_dir"], f"{os.getpid()}"), "a") as f:
                f.write(f"{x.group}\n")
        out.append(x.extra_info["weight"] * x.response_tokens / x.max_response_tokens)
    return out


def wrong_count(batch):
    return [0.0] * (len(batch) - 1)
