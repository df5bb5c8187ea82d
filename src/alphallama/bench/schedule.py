"""The order of requests in an arena run.

Pass k runs every prompt once per arm. Odd passes go in suite order; even passes go
in reversed order, so a prompt's position (warm caches, clock ramp, thermal state)
differs between its two samples. The arm order is reversed on even passes as well
(A B | B A), so over two passes each arm sits at the same average time position and a
slow drift of the box during the session does not favour the arm that ran first.

Command arms (a fresh server per arm) run in blocks: one block = one arm, one pass,
one fresh server, every prompt of the pass. With arms A and B and two passes:
    pass 1: A (P1..Pn), B (P1..Pn); pass 2: B (Pn..P1), A (Pn..P1)
— four server starts, and only one server alive at a time (a GPU holds one model).

URL arms (servers already running, nothing to restart) are interleaved per prompt,
so the arms see the same moment of the session:
    pass 1: P1 A, P1 B, P2 A, P2 B, ...; pass 2: Pn B, Pn A, Pn-1 B, Pn-1 A, ...
A run with any command arm uses blocks for every arm.
"""
from __future__ import annotations

from dataclasses import dataclass

from .suite import Prompt


@dataclass(frozen=True)
class Step:
    arm: str
    pass_no: int       # 1-based
    order: int         # position of this prompt within the arm's pass (0-based)
    prompt: Prompt


@dataclass(frozen=True)
class Block:
    """Steps run while one set of servers is up; command arms get a fresh one each."""
    pass_no: int
    arms: tuple[str, ...]
    steps: tuple[Step, ...]


def pass_prompts(prompts: tuple[Prompt, ...], pass_no: int) -> tuple[Prompt, ...]:
    return prompts if pass_no % 2 == 1 else tuple(reversed(prompts))


def pass_arms(arms: tuple[str, ...], pass_no: int) -> tuple[str, ...]:
    return arms if pass_no % 2 == 1 else tuple(reversed(arms))


def plan(arms: tuple[str, ...], prompts: tuple[Prompt, ...], passes: int = 2,
         interleave: bool = False) -> list[Block]:
    blocks: list[Block] = []
    for pass_no in range(1, passes + 1):
        order = pass_prompts(prompts, pass_no)
        arm_order = pass_arms(arms, pass_no)
        if interleave:
            steps = tuple(Step(arm, pass_no, i, p) for i, p in enumerate(order) for arm in arm_order)
            blocks.append(Block(pass_no, arm_order, steps))
        else:
            for arm in arm_order:
                steps = tuple(Step(arm, pass_no, i, p) for i, p in enumerate(order))
                blocks.append(Block(pass_no, (arm,), steps))
    return blocks
