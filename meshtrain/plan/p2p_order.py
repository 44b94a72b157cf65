"""The pipeline engine's point-to-point program, and its replay under NCCL's and gloo's semantics.

The engine (``parallel/pipeline/engine.py``) does not decide for itself when to post a send or a receive: it walks
the program :func:`p2p_program` returns for its rank, a list of steps

- ``Post(ops)``: one ``comm.batch_p2p`` call (on NCCL one group, which completes as a whole);
- ``Wait(msg)``: block until the receive of ``msg`` is done (its tensor is the next action's input);
- ``Run(action)``: compute (posting nothing itself; a produced tensor waits in the engine's outbox);
- ``WaitSends()``: the end of the step, every send waited.

The program depends on a *posting policy*:

- ``ahead`` (gloo): every receive of the step posted at its start (``recv_ahead=0``; k > 0: the action's own and the
  next k remote inputs), each send posted right after the action that produced it. gloo matches messages by tag and
  runs each operation on its own, so early receives only let transfers start sooner. Under NCCL it deadlocks at the
  first message: a rank's stream is stuck on a receive posted at the start while the send its peer waits for is
  queued behind it.
- ``ordered`` (NCCL): every rank posts its sends and receives, one operation per batch, in one global order of the
  step's messages (:func:`message_order`: when each message's producer ends in the schedule's simulation). A send
  is posted right after the action that produced it, a receive right after the last of the rank's own sends that
  precede it in that order. Why it cannot deadlock: take the messages in the global order and assume every earlier
  one has completed. On the sender the ops queued before the send are earlier messages (done), and the waits before
  the producing action are for messages produced before that action started (earlier, done), so the send is at the
  head of its stream; the same holds for the receive on the receiver (the sends and waits before it belong to
  actions that end no later than the message is produced). Both are running, so the message completes. Sends and
  receives between two ranks are also posted in the same order on both sides, as NCCL's matching needs.

:func:`replay_p2p` runs every rank's program under a semantics and raises :class:`P2POrderError` on a deadlock, a
message that would land in another message's buffer, or an action that runs before its input arrived:

- ``nccl``: the pp group is one communicator with one stream per rank (torch's ``batch_isend_irecv`` uses the group's
  communicator): the batches a rank posts run in posting order, whatever peers they name (a batch starts when the one
  before it has finished); the k-th send from A to B matches the k-th receive posted on B from A (NCCL has no tags);
  both complete only when both batches are running (rendezvous: no buffering is assumed, as for messages larger than
  NCCL's buffers); a wait on a receive returns when its whole batch has finished. A wait blocks the rank; since
  torch orders the NCCL stream after the compute stream at every post, what is posted after a blocked wait cannot
  start before it either, so a blocked host models a blocked device. This is stricter than "operations between a
  pair complete in posting order": every enabling condition there is one here too, so a program that finishes here
  finishes there.
- ``gloo``: each operation on its own, a send matched with the receive of the same (source, destination, tag), both
  complete once both are posted.

:func:`check_p2p_order` replays a schedule's programs for the policy a backend gets (:func:`posting_policy`), the
same functions the engine calls.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from meshtrain.plan.schedules import Action, PipelineSchedule
from meshtrain.plan.simulator import simulate

POLICIES = ("ahead", "ordered")
SEMANTICS = ("nccl", "gloo")
ACTIVATION, GRADIENT = 0, 1  # message kinds (the engine's evaluation pass uses 2)


class P2POrderError(RuntimeError):
    """A posting program that deadlocks, mismatches messages or computes before its input arrived."""


@dataclass(frozen=True)
class Message:
    """One tensor between stages on different ranks: an activation (``kind`` 0, stage s to s+1) or an input
    gradient (``kind`` 1, stage s to s-1) of microbatch ``mb``."""

    kind: int
    mb: int
    src_stage: int
    dst_stage: int

    def __str__(self) -> str:
        return f"{'act' if self.kind == ACTIVATION else 'grad'}{self.mb}@{self.src_stage}->{self.dst_stage}"


@dataclass(frozen=True)
class Op:
    """One side of a message: ``op`` is "send" or "recv"."""

    op: str
    msg: Message


@dataclass(frozen=True)
class Post:
    """Post these operations as one batch (one ``comm.batch_p2p`` call)."""

    ops: tuple[Op, ...]


@dataclass(frozen=True)
class Wait:
    """Block until the receive of ``msg`` has completed."""

    msg: Message


@dataclass(frozen=True)
class Run:
    """Compute ``action``."""

    action: Action


@dataclass(frozen=True)
class WaitSends:
    """Block until every send this rank posted in the step has completed."""


Step = Post | Wait | Run | WaitSends


def posting_policy(backend: str) -> str:
    """The policy the engine uses on a torch.distributed backend: ``ordered`` on NCCL, ``ahead`` elsewhere."""
    return "ordered" if backend == "nccl" else "ahead"


def message_tag(s: PipelineSchedule, kind: int, mb: int, dst_stage: int) -> int:
    """The tag of a message (unique per step for a (kind, microbatch, destination stage); NCCL ignores it)."""
    return (kind * s.microbatches + mb) * s.n_stages + dst_stage


def remote_input(s: PipelineSchedule, a: Action) -> Message | None:
    """The message ``a`` receives from another rank, if any (F: the previous stage's activation; B or I: the next
    stage's input gradient)."""
    r = s.placement[a.stage]
    if a.kind == "F" and a.stage > 0 and s.placement[a.stage - 1] != r:
        return Message(ACTIVATION, a.mb, a.stage - 1, a.stage)
    if a.kind in ("B", "I") and a.stage < s.n_stages - 1 and s.placement[a.stage + 1] != r:
        return Message(GRADIENT, a.mb, a.stage + 1, a.stage)
    return None


def remote_output(s: PipelineSchedule, a: Action) -> Message | None:
    """The message ``a`` sends to another rank, if any (F: its activation on; B or I: its input gradient back)."""
    r = s.placement[a.stage]
    if a.kind == "F" and a.stage < s.n_stages - 1 and s.placement[a.stage + 1] != r:
        return Message(ACTIVATION, a.mb, a.stage, a.stage + 1)
    if a.kind in ("B", "I") and a.stage > 0 and s.placement[a.stage - 1] != r:
        return Message(GRADIENT, a.mb, a.stage, a.stage - 1)
    return None


def _sends_in_order(s: PipelineSchedule, src: int, dst: int) -> list[Message]:
    """The messages rank ``src`` sends to rank ``dst`` in one step, in the order it sends them (its action order)."""
    outs = (remote_output(s, a) for a in s.actions[src])
    return [m for m in outs if m is not None and s.placement[m.dst_stage] == dst]


def message_order(s: PipelineSchedule) -> dict[Message, tuple[float, int, int, int]]:
    """Every message of a step with its place in one global order: the time its producing action ends in the
    schedule's simulation (``check_schedule``'s costs: F 1, B 2, I 1, W 1, no latency), ties broken by
    (kind, microbatch, source stage). Any causal simulation with positive costs would do (see ``ordered``)."""
    sim = simulate(s, 1.0, 2.0, 1.0)
    out: dict[Message, tuple[float, int, int, int]] = {}
    for tl in sim.timelines:
        for _, end, a in tl:
            if (m := remote_output(s, a)) is not None:
                out[m] = (end, m.kind, m.mb, m.src_stage)
    return out


def p2p_program(s: PipelineSchedule, rank: int, policy: str = "ahead", recv_ahead: int = 0) -> list[Step]:
    """The steps rank ``rank`` runs for one optimizer step of ``s`` under ``policy`` (see the module docstring).

    ``recv_ahead`` applies to ``ahead`` only: the receives posted before an action are its own and those of the
    next ``recv_ahead`` remote inputs (0: all of the step's, at its start).
    """
    if policy not in POLICIES:
        raise ValueError(f"unknown posting policy {policy!r}: choose one of {', '.join(POLICIES)}")
    if recv_ahead < 0:
        raise ValueError(f"recv_ahead must be >= 0 (0: every receive at the step's start), got {recv_ahead}")
    actions = s.actions[rank]
    prog: list[Step] = []
    if policy == "ahead":
        posted: set[Message] = set()
        needs = [(i, m) for i, a in enumerate(actions) if (m := remote_input(s, a)) is not None]
        first = 0  # needs[first] is the next remote input not yet used
        for i, a in enumerate(actions):
            while first < len(needs) and needs[first][0] < i:
                first += 1
            for _, m in needs[first: first + 1 + recv_ahead if recv_ahead else len(needs)]:
                if m not in posted:
                    posted.add(m)
                    prog.append(Post((Op("recv", m),)))
            if (m := remote_input(s, a)) is not None:
                prog.append(Wait(m))
            prog.append(Run(a))
            if (m := remote_output(s, a)) is not None:
                prog.append(Post((Op("send", m),)))
        prog.append(WaitSends())
        return prog
    # ordered: this rank's sends and receives, each its own batch, in the global message order. A send goes right
    # after its action; a receive right after the last send before it in that order (its producer ends no later than
    # the consumer here starts, so this is before the consumer's wait).
    key = message_order(s)
    recvs = sorted((m for a in actions if (m := remote_input(s, a)) is not None), key=key.__getitem__)
    nxt = 0

    def receives_upto(limit: tuple[float, int, int, int]) -> None:
        nonlocal nxt
        while nxt < len(recvs) and key[recvs[nxt]] <= limit:
            prog.append(Post((Op("recv", recvs[nxt]),)))
            nxt += 1

    for a in actions:
        if (m := remote_input(s, a)) is not None:
            receives_upto(key[m])
            prog.append(Wait(m))
        prog.append(Run(a))
        if (m := remote_output(s, a)) is not None:
            receives_upto(key[m])  # a rank never receives what it sends: no tie with key[m]
            prog.append(Post((Op("send", m),)))
    prog.append(WaitSends())
    return prog


# --------------------------------------------------------------------------------------------------------- replay


@dataclass
class _Posted:
    rank: int
    op: Op
    peer: int
    seq: int  # k-th op of this direction between the pair (NCCL's matching)
    done: bool = False


def _describe(rank: int, prog: list[Step], pc: int, stream: deque[list[_Posted]]) -> str:
    step = prog[pc] if pc < len(prog) else None
    at = "done" if step is None else (f"waiting for {step.msg}" if isinstance(step, Wait) else
                                      "waiting for its sends" if isinstance(step, WaitSends) else str(step))
    head = ""
    if stream:
        ops = ", ".join(f"{p.op.op} {p.op.msg} {'to' if p.op.op == 'send' else 'from'} rank {p.peer}"
                        for p in stream[0] if not p.done)
        head = f", its stream blocked at [{ops}]"
    return f"rank {rank} {at}{head}"


def replay_p2p(s: PipelineSchedule, programs: list[list[Step]], semantics: str = "nccl") -> None:
    """Run every rank's program together under ``semantics`` (see the module docstring); raise
    :class:`P2POrderError` naming each blocked rank on a deadlock, or naming the message on a mismatch."""
    if semantics not in SEMANTICS:
        raise ValueError(f"unknown semantics {semantics!r}: choose one of {', '.join(SEMANTICS)}")
    n = len(programs)
    pc = [0] * n
    streams: list[deque[list[_Posted]]] = [deque() for _ in range(n)]
    counts: dict[tuple[int, int, str], int] = {}  # (rank, peer, op) -> ops posted so far
    # NCCL: (src, dst, seq) -> each side; gloo: (src, dst, tag)
    sides: dict[tuple[int, int, object], dict[str, _Posted]] = {}
    received: list[set[Message]] = [set() for _ in range(n)]
    sends: list[list[_Posted]] = [[] for _ in range(n)]

    def owner(stage: int) -> int:
        return s.placement[stage]

    def key(p: _Posted) -> tuple[int, int, object]:
        src, dst = (p.rank, p.peer) if p.op.op == "send" else (p.peer, p.rank)
        if semantics == "nccl":
            return src, dst, p.seq
        return src, dst, message_tag(s, p.op.msg.kind, p.op.msg.mb, p.op.msg.dst_stage)

    def running(p: _Posted) -> bool:
        # NCCL: only the head batch of a rank's stream runs; gloo: everything posted runs
        return semantics == "gloo" or (bool(streams[p.rank]) and any(q is p for q in streams[p.rank][0]))

    def post(r: int, batch: Post) -> None:
        out = []
        for op in batch.ops:
            m = op.msg
            src, dst = owner(m.src_stage), owner(m.dst_stage)
            if (op.op == "send" and src != r) or (op.op == "recv" and dst != r) or src == dst:
                raise P2POrderError(f"{s.name}: rank {r} posts {op.op} {m}, which is not its to {op.op}")
            peer = dst if op.op == "send" else src
            c = (r, peer, op.op)
            p = _Posted(r, op, peer, counts.get(c, 0))
            counts[c] = p.seq + 1
            side = sides.setdefault(key(p), {})
            if op.op in side:
                raise P2POrderError(f"{s.name}: rank {r} posts {op.op} {m} twice")
            side[op.op] = p
            out.append(p)
            if op.op == "send":
                sends[r].append(p)
        streams[r].append(out)

    def match() -> bool:
        moved = False
        for side in sides.values():
            snd, rcv = side.get("send"), side.get("recv")
            if snd is None or rcv is None or snd.done or not (running(snd) and running(rcv)):
                continue
            if snd.op.msg != rcv.op.msg:
                raise P2POrderError(
                    f"{s.name}: under {semantics} rank {rcv.rank}'s receive number {rcv.seq + 1} from rank "
                    f"{snd.rank} expects {rcv.op.msg} but gets {snd.op.msg}: NCCL matches sends and receives "
                    f"between a pair in posting order, not by tag")
            snd.done = rcv.done = True
            if semantics == "gloo":
                received[rcv.rank].add(rcv.op.msg)
            moved = True
        for r, st in enumerate(streams):
            while st and all(p.done for p in st[0]):
                finished = st.popleft()
                if semantics == "nccl":  # one coalesced work per batch: a wait returns when all of it is done
                    received[r].update(p.op.msg for p in finished if p.op.op == "recv")
                moved = True
        return moved

    while True:
        moved = False
        for r, prog in enumerate(programs):
            while pc[r] < len(prog):
                step = prog[pc[r]]
                if isinstance(step, Post):
                    post(r, step)
                elif isinstance(step, Wait):
                    if step.msg not in received[r]:
                        break
                elif isinstance(step, Run):
                    need = remote_input(s, step.action)
                    if need is not None and need not in received[r]:
                        raise P2POrderError(f"{s.name}: rank {r} runs {step.action} before waiting for {need}")
                    received[r].discard(need)  # used: a second use would need a second message
                elif not all(p.done for p in sends[r]):
                    break
                pc[r] += 1
                moved = True
        moved = match() or moved
        if all(pc[r] == len(p) for r, p in enumerate(programs)) and not any(streams):
            return
        if not moved:
            blocked = [_describe(r, p, pc[r], streams[r]) for r, p in enumerate(programs)
                       if pc[r] < len(p) or streams[r]]
            raise P2POrderError(f"{s.name}: deadlock under {semantics}: " + "; ".join(blocked))


def check_p2p_order(s: PipelineSchedule, backend: str = "nccl", recv_ahead: int = 0) -> None:
    """Replay the programs the engine runs on ``backend`` (:func:`posting_policy`, :func:`p2p_program`) under that
    backend's semantics; raise :class:`P2POrderError` unless every rank finishes the step with the right tensors."""
    policy = posting_policy(backend)
    programs = [p2p_program(s, r, policy, recv_ahead) for r in range(s.pp)]
    replay_p2p(s, programs, "nccl" if backend == "nccl" else "gloo")
