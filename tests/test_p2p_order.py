"""The pipeline's point-to-point posting order under NCCL's and gloo's semantics (``plan/p2p_order.py``).

Pure Python: every schedule, several pp sizes and microbatch counts, replayed from the programs the engine runs
(``p2p_program`` with ``posting_policy(backend)``, the engine's own calls). The check must also find the deadlocks
and mismatches of naive orders, built here by hand. The engine running the NCCL program on real processes is in
``tests/test_pipeline.py``.
"""

import pytest

from meshtrain.config import SCHEDULES
from meshtrain.plan.p2p_order import (
    Message,
    Op,
    P2POrderError,
    Post,
    Run,
    Wait,
    WaitSends,
    check_p2p_order,
    p2p_program,
    posting_policy,
    remote_input,
    remote_output,
    replay_p2p,
)
from meshtrain.plan.schedules import DEFAULT_VIRTUAL, Action, build_schedule

SIZES = [(pp, m) for pp in (2, 3, 4, 8) for m in (1, 2, 3, 4, 6, 8, 16, 24)]


def schedules():
    for name in SCHEDULES:
        for pp, m in SIZES:
            if name == "interleaved" and m % pp:
                continue  # refused by build_schedule
            yield build_schedule(name, pp, m, DEFAULT_VIRTUAL[name])


def test_the_engine_posts_in_global_order_on_nccl_and_receives_ahead_on_gloo():
    assert posting_policy("nccl") == "ordered"
    assert posting_policy("gloo") == "ahead"


@pytest.mark.parametrize("name", SCHEDULES)
def test_every_schedule_is_safe_on_nccl_and_gloo(name):
    n = 0
    for s in schedules():
        if s.name != name:
            continue
        check_p2p_order(s, "nccl")  # the engine's program on NCCL, under NCCL's semantics
        check_p2p_order(s, "gloo")
        check_p2p_order(s, "gloo", recv_ahead=1)
        # the NCCL program under gloo's semantics too (the equivalence tests run it on gloo)
        replay_p2p(s, [p2p_program(s, r, "ordered") for r in range(s.pp)], "gloo")
        n += 1
    assert n >= 16  # interleaved: the sizes with m % pp == 0


@pytest.mark.parametrize("name", SCHEDULES)
def test_the_ordered_program_moves_every_message_once(name):
    s = build_schedule(name, 4, 8, DEFAULT_VIRTUAL[name])
    want = {m for acts in s.actions for a in acts if (m := remote_output(s, a)) is not None}
    assert want == {m for acts in s.actions for a in acts if (m := remote_input(s, a)) is not None}
    sent, received = [], []
    for r in range(s.pp):
        prog = p2p_program(s, r, "ordered")
        assert [st.action for st in prog if isinstance(st, Run)] == s.actions[r]
        for st in prog:
            if isinstance(st, Post):
                assert len(st.ops) == 1  # one op per batch: the proof's premise
                (sent if st.ops[0].op == "send" else received).append(st.ops[0].msg)
    assert sorted(sent, key=str) == sorted(want, key=str) == sorted(received, key=str)


@pytest.mark.parametrize("name", SCHEDULES)
def test_receives_posted_at_the_step_start_deadlock_on_nccl(name):
    """Today's gloo order (every receive first) replayed under NCCL: the first receive blocks the rank's stream, and
    the send its peer waits for is queued behind it."""
    for pp, m in [(2, 4), (4, 8)]:
        s = build_schedule(name, pp, m, DEFAULT_VIRTUAL[name])
        ahead = [p2p_program(s, r, "ahead") for r in range(pp)]
        replay_p2p(s, ahead, "gloo")  # fine where tags match and operations run on their own
        with pytest.raises(P2POrderError, match="deadlock under nccl: rank 0 .*stream blocked at \\[recv"):
            replay_p2p(s, ahead, "nccl")


def _1f1b_pp2_m2():
    s = build_schedule("1f1b", 2, 2)
    assert s.actions == [[Action("F", 0, 0), Action("F", 1, 0), Action("B", 0, 0), Action("B", 1, 0)],
                         [Action("F", 0, 1), Action("B", 0, 1), Action("F", 1, 1), Action("B", 1, 1)]]
    act = [Message(0, mb, 0, 1) for mb in range(2)]
    grad = [Message(1, mb, 1, 0) for mb in range(2)]
    return s, act, grad


def _send(m):
    return Post((Op("send", m),))


def _recv(m):
    return Post((Op("recv", m),))


def test_check_finds_the_crossing_deadlock_of_just_in_time_receives():
    """Receives posted just before use and sends right after compute, each its own batch: rank 0 queues
    send(act1) then recv(grad0), rank 1 queues send(grad0) then recv(act1): each stream's head waits for the op
    queued second on the other. The same pairs fused into one batch each (torch's fwd_send + bwd_recv) finish."""
    s, act, grad = _1f1b_pp2_m2()
    f0, f1, b0, b1 = s.actions[0]
    g0, c0, g1, c1 = s.actions[1]
    rank0 = [Run(f0), _send(act[0]), Run(f1), _send(act[1]), _recv(grad[0]), Wait(grad[0]), Run(b0),
             _recv(grad[1]), Wait(grad[1]), Run(b1), WaitSends()]
    rank1 = [_recv(act[0]), Wait(act[0]), Run(g0), Run(c0), _send(grad[0]), _recv(act[1]), Wait(act[1]), Run(g1),
             Run(c1), _send(grad[1]), WaitSends()]
    replay_p2p(s, [rank0, rank1], "gloo")
    with pytest.raises(P2POrderError, match="deadlock under nccl: rank 0 waiting for grad0@1->0, its stream "
                                            "blocked at \\[send act1@0->1 to rank 1\\]; rank 1 waiting for "
                                            "act1@0->1, its stream blocked at \\[send grad0@1->0 to rank 0\\]"):
        replay_p2p(s, [rank0, rank1], "nccl")
    fused0 = [Run(f0), _send(act[0]), Run(f1), Post((Op("send", act[1]), Op("recv", grad[0]))), Wait(grad[0]),
              Run(b0), _recv(grad[1]), Wait(grad[1]), Run(b1), WaitSends()]
    fused1 = [_recv(act[0]), Wait(act[0]), Run(g0), Run(c0), Post((Op("send", grad[0]), Op("recv", act[1]))),
              Wait(act[1]), Run(g1), Run(c1), _send(grad[1]), WaitSends()]
    replay_p2p(s, [fused0, fused1], "nccl")


def test_check_finds_messages_matched_out_of_order():
    """NCCL has no tags: rank 1 receiving act1 before act0 would get act0's tensor in act1's buffer."""
    s, act, grad = _1f1b_pp2_m2()
    f0, f1, b0, b1 = s.actions[0]
    g0, c0, g1, c1 = s.actions[1]
    rank0 = [Run(f0), _send(act[0]), Run(f1), _send(act[1]), _recv(grad[0]), _recv(grad[1]), Wait(grad[0]), Run(b0),
             Wait(grad[1]), Run(b1), WaitSends()]
    rank1 = [_recv(act[1]), _recv(act[0]), Wait(act[0]), Run(g0), Run(c0), _send(grad[0]), Wait(act[1]), Run(g1),
             Run(c1), _send(grad[1]), WaitSends()]
    replay_p2p(s, [rank0, rank1], "gloo")  # tags sort it out on gloo
    with pytest.raises(P2POrderError, match="rank 1's receive number 1 from rank 0 expects act1@0->1 but gets "
                                            "act0@0->1"):
        replay_p2p(s, [rank0, rank1], "nccl")


def test_check_finds_an_action_that_runs_before_its_input():
    s, act, grad = _1f1b_pp2_m2()
    progs = [p2p_program(s, r, "ordered") for r in range(2)]
    progs[1] = [st for st in progs[1] if st != Wait(act[0])]
    with pytest.raises(P2POrderError, match="rank 1 runs F0@1 before waiting for act0@0->1"):
        replay_p2p(s, progs, "nccl")


def test_bad_policy_and_semantics_are_refused():
    s = build_schedule("1f1b", 2, 2)
    with pytest.raises(ValueError, match="unknown posting policy 'early'"):
        p2p_program(s, 0, "early")
    with pytest.raises(ValueError, match="unknown semantics 'mpi'"):
        replay_p2p(s, [], "mpi")
