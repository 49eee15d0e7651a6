"""Grouping of stack dumps across ranks (PROTOCOL.md 2.5 "Grouping", section 4 ``groups``)."""
from __future__ import annotations

from typing import Any, Dict, List, Optional

import msgspec
import pytest

from broker.stacks.groups import group_dumps, main_frames, stack_groups
from rank_agent.protocol import Stacks


def fr(function: str, line: int = 1, file: str = "train.py", code: str = "") -> Dict[str, Any]:
    return {"file": file, "line": line, "function": function, "code": code}


OUTER = [fr("<module>", 90), fr("train", 40), fr("train_step", 12)]
ALL_REDUCE = OUTER + [fr("backward", 7, "torch/autograd.py"), fr("all_reduce", 3, "c10d.py")]
NEXT = OUTER + [fr("__next__", 631, "dataloader.py")]


def dump(frames: List[Dict[str, Any]], reason: str = "stall", request_id: str = "",
         main: Optional[int] = 0, extra_first: bool = False) -> Dict[str, Any]:
    threads = [{"name": "MainThread", "frames": frames, "main": main == 0}]
    if extra_first:  # another thread listed before the training thread
        threads.insert(0, {"name": "loader", "frames": [fr("poll", 1, "selectors.py")],
                           "main": False})
    return {"type": "stacks", "run": "r", "rank": 0, "reason": reason,
            "request_id": request_id, "taken_at": 1.0, "threads": threads}


def ranks_of(groups: List[Dict[str, Any]]) -> List[List[int]]:
    return [g["ranks"] for g in groups]


def test_largest_group_first_ties_by_lowest_rank() -> None:
    other = OUTER + [fr("save", 5)]
    dumps = {9: dump(NEXT), 4: dump(other), 0: dump(ALL_REDUCE), 1: dump(ALL_REDUCE),
             7: dump(ALL_REDUCE), 3: dump(NEXT)}
    groups = group_dumps(dumps.items())
    assert ranks_of(groups) == [[0, 1, 7], [3, 9], [4]]
    # a tie: equal sizes go by their lowest rank, whatever order the dumps came in
    assert ranks_of(group_dumps([(8, dump(NEXT)), (2, dump(other))])) == [[2], [8]]
    assert ranks_of(group_dumps([(2, dump(other)), (8, dump(NEXT))])) == [[2], [8]]


def test_group_object_shape_frames_outermost_first_with_the_lowest_ranks_source() -> None:
    a = [dict(f, code=f"{f['function']}()  # rank 5") for f in ALL_REDUCE]
    b = [dict(f, code=f"{f['function']}()  # rank 2") for f in ALL_REDUCE]
    (group,) = group_dumps([(5, dump(a)), (2, dump(b))])
    assert group == {"reason": "stall", "request_id": "", "ranks": [2, 5], "frames": b}
    assert group["frames"][0]["function"] == "<module>"  # outermost first, as in the dump


def test_the_key_is_the_main_threads_file_line_function() -> None:
    moved = [*ALL_REDUCE[:-1], fr("all_reduce", 4, "c10d.py")]  # same function, another line
    other_file = [*ALL_REDUCE[:-1], fr("all_reduce", 3, "c10d_v2.py")]
    groups = group_dumps([(0, dump(ALL_REDUCE)), (1, dump(moved)), (2, dump(other_file)),
                          (3, dump(ALL_REDUCE, extra_first=True))])
    assert ranks_of(groups) == [[0, 3], [1], [2]]  # rank 3's main thread is not its first


def test_a_dump_without_a_main_thread_uses_its_first_thread() -> None:
    no_main = dump(ALL_REDUCE, main=None, extra_first=True)
    assert main_frames(no_main) == [fr("poll", 1, "selectors.py")]
    groups = group_dumps([(0, no_main), (1, dump(NEXT, main=None))])
    assert [g["frames"][-1]["function"] for g in groups] == ["poll", "__next__"]


def test_profiles_and_empty_dumps_are_not_grouped() -> None:
    profile = {"reason": "request", "request_id": "q", "taken_at": 1.0, "threads": [],
               "profile": [{"stack": ["f (a.py:1)"], "count": 3}], "samples": 3}
    assert group_dumps([(0, profile), (1, dump([]))]) == [
        {"reason": "stall", "request_id": "", "ranks": [1], "frames": []}]


def test_stack_groups_takes_stalled_ranks_and_the_latest_requests_answers() -> None:
    stall = {0: dump(ALL_REDUCE), 1: dump(ALL_REDUCE), 2: dump(NEXT)}
    answers = {0: dump(ALL_REDUCE, "request", "q2"), 1: dump(NEXT, "request", "q1"),
               3: dump(ALL_REDUCE, "request", "q2")}
    groups = stack_groups(stall, {0, 2}, answers, "q2")  # rank 1 recovered; q1 is old
    assert [(g["reason"], g["request_id"], g["ranks"]) for g in groups] == [
        ("request", "q2", [0, 3]),  # rank 0: stalled and answering, in one group of each
        ("stall", "", [0]),
        ("stall", "", [2]),
    ]
    assert ranks_of(stack_groups(stall, set(), answers, None)) == []


def test_structs_and_dicts_group_alike() -> None:
    dumps = {r: dump(ALL_REDUCE if r % 3 else NEXT) for r in range(12)}
    structs = {r: msgspec.convert(d, Stacks) for r, d in dumps.items()}
    assert group_dumps(structs.items()) == group_dumps(dumps.items())
    assert ranks_of(group_dumps(structs.items())) == [[1, 2, 4, 5, 7, 8, 10, 11], [0, 3, 6, 9]]


@pytest.mark.parametrize("n", [1024])
def test_a_thousand_ranks_in_three_groups(n: int) -> None:
    dumps = [(r, dump(NEXT if r == 417 else [*ALL_REDUCE, fr("wait", r % 2)]))
             for r in range(n)]
    groups = group_dumps(dumps)
    assert [len(g["ranks"]) for g in groups] == [512, 511, 1]
    assert groups[0]["ranks"][0] == 0 and groups[2]["ranks"] == [417]
