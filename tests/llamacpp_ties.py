"""llama.cpp's greedy run of a real model against our log-probabilities along its tokens (the
rule of tests/model/test_gemma3_vs_llamacpp.py, whose docstring says why these bounds): our
argmax is llama.cpp's token at every position, or from the first place it is not, a near tie
for both engines; the top-1 log-probabilities agree on average and at worst."""
from __future__ import annotations

import torch

NEAR_TIE = 0.15      # llama.cpp's own top-2 gap where we may take its second
OUR_TIE = 0.2        # and ours there


def first_departure(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def check_case(lp: torch.Tensor, case: dict) -> int | None:
    """lp [64, V] float64 along case["gen_ids"]: asserts the rule, returns where ours departs."""
    ours = lp.argmax(-1).tolist()                                          # teacher-forced greedy picks
    top1_err = [abs(lp[i, top[0][0]].item() - top[0][1]) for i, top in enumerate(case["top5"])]
    assert sum(top1_err) / len(top1_err) < 0.1 and max(top1_err) < 0.5, (case["input"], max(top1_err))
    first = first_departure(ours, case["gen_ids"])
    if first is not None:
        (_, lp1), (t2, lp2) = case["top5"][first][:2]
        gap = lp[first].topk(2).values
        assert ours[first] == t2 and lp1 - lp2 < NEAR_TIE, (case["input"], first, case["top5"][first][:2])
        assert float(gap[0] - gap[1]) < OUR_TIE, (case["input"], first, gap)
    return first
