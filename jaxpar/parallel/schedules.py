"""Pipeline schedules: the order in which stages run forward and backward on micro-batches.

Every schedule is a tick table built on the host, [ticks, p, (action, micro-batch,
chunk)], which the executor reads on the device and from which the ledger measures the
bubble. Executors run inside the step's shard_map (manual over `data`, `pipeline` and `context`);
`value_and_grad` is the one entry for all of them:
- gpipe / interleaved: a forward loop of v*m + p - 1 ticks in which every device runs
  one chunk on one micro-batch and hands the result to the next device (ppermute);
  autodiff runs the same loop backwards. Micro-batch i meets chunk k*p + s at device s
  on tick s + (i // p)*v*p + k*p + i % p, so every hand-over is consumed on the very
  next tick. All m micro-batches' activations are alive at the turn.
- 1f1b: each tick a device runs one forward or one backward of a micro-batch
  (PipeDream-flush order: p - s - 1 warm-up forwards, then one forward and one backward
  in turn). A backward recomputes its chunk from the stage input kept since its
  forward, so at most about p inputs are alive, not m.
- zb-h1: as 1f1b, with each backward split into R (the chunk's forward recomputed from
  its stage input, its residuals kept), B (the input's gradient, handed back) and W (the
  weights', run where 1F1B idles): Qi et al.'s ZB-H1, at 1F1B's count of micro-batches
  in flight. Each op is about one forward's work, so ticks run in lockstep lose
  nothing to a neighbour's longer op, as they do in 1f1b (a forward beside a backward
  three times its length).

What a chunk reads of its micro-batch besides the activation (the documents' segment
ids and positions, jaxpar.nn.documents) travels with no hand-over: every stage holds the
whole micro-batch (the batch is split over `data`, not `pipeline`) and the tick table
says which micro-batch each stage runs, so each stage takes its own copy's rows.

The activation handed on is any pytree (a mixture of experts hands its routing's sums
on beside the residual stream).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from jaxpar.config.sections import Schedule

IDLE, FWD, BWD, INPUT, WEIGHT, RECOMPUTE = 0, 1, 2, 3, 4, 5
# What each op computes, in forward passes of its chunk (the unit of the bubble): a 1F1B
# backward recomputes the chunk's forward, then makes both gradients; a zero-bubble R
# recomputes it, keeping each layer's residuals; B makes the input's gradient from
# them, keeping what W reads; W makes the weights' gradient from that.
WORK = {IDLE: 0, FWD: 1, BWD: 3, RECOMPUTE: 1, INPUT: 1, WEIGHT: 1}
BACKWARDS = (BWD, INPUT)  # the ops that hand a gradient back to the previous stage
TICKED = (Schedule.ONE_F_ONE_B, Schedule.ZB_H1)  # the tables that hold backward ticks


class Ticked(NamedTuple):
    """A schedule whose table holds its backward ticks, and the slots a device needs."""

    table: np.ndarray  # [ticks, p, 2] of (action, micro-batch)
    inputs: int  # stage inputs held at once (arrival to backward)
    residuals: int  # chunks' recomputed residuals held at once (R to B; 1f1b: 0)
    weights: int  # what B kept for W, held at once (B to W; 1f1b: 0)


def _ready(kind: int, s: int, i: int, p: int, done: dict, t: int) -> bool:
    """Whether op (kind, stage s, micro-batch i) may run on tick t: what it reads was
    made on an earlier tick (a hand-over arrives one tick later)."""
    before = lambda *op: done.get(op, t) < t  # noqa: E731
    if kind == FWD:
        return s == 0 or before(FWD, s - 1, i)
    if kind == WEIGHT:
        return before(INPUT, s, i)
    if kind == RECOMPUTE:
        return before(FWD, s, i)
    mine = before(RECOMPUTE, s, i) if kind == INPUT else before(FWD, s, i)
    return mine and (s == p - 1 or before(BWD, s + 1, i) or before(INPUT, s + 1, i))


def _placed(choose, p: int, total: int) -> tuple[list, dict]:
    """Tick by tick, each stage runs the op `choose(s, done, t)` names (or None: idle)
    until every stage has run `total` ops; (rows of (kind, micro-batch), done: op ->
    tick)."""
    done: dict = {}
    count, rows, t = [0] * p, [], 0
    while any(c < total for c in count):
        row = [(IDLE, 0)] * p
        for s in range(p):
            op = choose(s, done, t) if count[s] < total else None
            if op is not None:
                row[s] = op
        for s, (kind, i) in enumerate(row):
            if kind != IDLE:
                done[(kind, s, i)] = t
                count[s] += 1
        rows.append(row)
        t += 1
    return rows, done


def _in_order(order: list[list], p: int):
    """choose: each stage's ops in the fixed `order`, each as soon as it is ready."""
    ptr = [0] * len(order)

    def choose(s, done, t):
        kind, i = order[s][ptr[s]]
        if not _ready(kind, s, i, p, done, t):
            return None
        ptr[s] += 1
        return kind, i

    return choose


def _held(done: dict, p: int, m: int, ticks: int, start: int, end: int) -> int:
    """The most micro-batches a stage holds at once, from op `start`'s tick (FWD: from the
    input's arrival) to op `end`'s."""

    def since(s, i):
        if start != FWD:
            return done[(start, s, i)]
        return done[(FWD, 0, i)] if s == 0 else done[(FWD, s - 1, i)] + 1

    return max(
        sum(since(s, i) <= t0 <= done[(end, s, i)] for i in range(m))
        for s in range(p)
        for t0 in range(ticks)
    )


def one_f_one_b(p: int, m: int) -> tuple[np.ndarray, int]:
    """([ticks, p, 2] of (action, micro-batch), slots): PipeDream-flush 1F1B, each op
    run on the first tick its inputs are there (a hand-over arrives one tick later)."""
    order = []
    for s in range(p):
        warm = min(p - s - 1, m)
        ops = [(FWD, i) for i in range(warm)]
        for i in range(m - warm):
            ops += [(FWD, warm + i), (BWD, i)]
        ops += [(BWD, i) for i in range(m - warm, m)]
        order.append(ops)
    rows, done = _placed(_in_order(order, p), p, 2 * m)
    return np.array(rows, dtype=np.int32), _held(done, p, m, len(rows), FWD, BWD)


def zb_h1(p: int, m: int) -> Ticked:
    """ZB-H1 (Qi et al. 2024). Each tick a stage runs, by priority: the next B that is
    ready (the previous stage waits for it); else the next R once the next stage has
    recomputed that micro-batch (its B follows, so this stage's B can run a tick after
    it); else the next forward if it holds fewer than p micro-batches (forward run, W not
    yet: 1F1B's count, on its first stage); else the oldest W waiting: the W's fill what
    1F1B leaves idle."""
    nxt = {}

    def choose(s, done, t):
        f, r, b, w = (nxt.get((k, s), 0) for k in (FWD, RECOMPUTE, INPUT, WEIGHT))
        after_next = s == p - 1 or done.get((RECOMPUTE, s + 1, r), t) < t
        if b < r and _ready(INPUT, s, b, p, done, t):
            op = INPUT, b
        elif r < f and after_next and _ready(RECOMPUTE, s, r, p, done, t):
            op = RECOMPUTE, r
        elif f < m and f - w < p and _ready(FWD, s, f, p, done, t):
            op = FWD, f
        elif w < b:
            op = WEIGHT, w
        else:
            return None
        nxt[(op[0], s)] = op[1] + 1
        return op

    rows, done = _placed(choose, p, 4 * m)
    ticks = len(rows)
    return Ticked(
        np.array(rows, dtype=np.int32),
        inputs=_held(done, p, m, ticks, FWD, INPUT),
        residuals=_held(done, p, m, ticks, RECOMPUTE, INPUT),
        weights=_held(done, p, m, ticks, INPUT, WEIGHT),
    )


def check(table: np.ndarray, m: int) -> None:
    """Raise ValueError unless `table` ([ticks, p, >=2]) runs every op of every
    micro-batch on every stage exactly once (a forward, and a fused backward or its R, B
    and W), each after what it reads."""
    ticks, p = table.shape[:2]
    done: dict = {}
    for t in range(ticks):
        for s in range(p):
            kind, i = (int(v) for v in table[t, s, :2])
            if kind == IDLE:
                continue
            if (kind, s, i) in done or not 0 <= i < m:
                raise ValueError(f"tick {t}, stage {s}: {_NAMES[kind]} of micro-batch {i} twice")
            if not _ready(kind, s, i, p, done, t):
                raise ValueError(
                    f"tick {t}, stage {s}: {_NAMES[kind]} of micro-batch {i} runs before "
                    "what it reads is there"
                )
        for s in range(p):
            kind, i = (int(v) for v in table[t, s, :2])
            if kind != IDLE:
                done[(kind, s, i)] = t
    for s in range(p):
        for i in range(m):
            split = (INPUT, s, i) in done
            wanted = (FWD, RECOMPUTE, INPUT, WEIGHT) if split else (FWD, BWD)
            missing = [_NAMES[k] for k in wanted if (k, s, i) not in done]
            if missing:
                raise ValueError(f"stage {s}: micro-batch {i} never runs {', '.join(missing)}")


_NAMES = {FWD: "F", BWD: "B+W", RECOMPUTE: "R", INPUT: "B", WEIGHT: "W"}


def circular(p: int, m: int, v: int) -> np.ndarray:
    """[v*m + p - 1, p, 3] of (action, micro-batch, chunk k): the gpipe / interleaved
    forward loop. Device s runs chunk k*p + s; idle ticks repeat the nearest real
    (micro-batch, chunk), which the executor runs with every layer skipped."""
    rows = []
    for t in range(v * m + p - 1):
        row = []
        for s in range(p):
            n = t - s
            busy = 0 <= n < v * m
            group, rest = divmod(min(max(n, 0), v * m - 1), v * p)
            row.append((FWD if busy else IDLE, group * p + rest % p, rest // p))
        rows.append(row)
    return np.array(rows, dtype=np.int32)


def tick_table(schedule: Schedule, p: int, m: int, v: int) -> np.ndarray:
    """[ticks, p, 3] of (action, micro-batch, chunk k) for each device on each tick:
    the forward loop for gpipe / interleaved (autodiff mirrors it), the whole step for
    1f1b (where a tick holds a forward or a backward)."""
    if schedule in TICKED:
        table = ticked_table(schedule, p, m).table
        return np.concatenate([table, np.zeros_like(table[..., :1])], axis=-1)
    return circular(p, m, v)


def ticked_table(schedule: Schedule, p: int, m: int) -> Ticked:
    """A schedule whose table holds its backward ticks (1f1b, zb-h1)."""
    if schedule is Schedule.ZB_H1:
        return zb_h1(p, m)
    return Ticked(*one_f_one_b(p, m), residuals=0, weights=0)


def idle_share(table: np.ndarray) -> float:
    """The share of (tick, device) slots of a tick table that idle: the tick count's
    bubble, which the last release reported (the bubble is now `lockstep`'s, each op
    weighed by its work)."""
    return float((table[..., 0] == IDLE).mean())


def lockstep(table: np.ndarray) -> tuple[int, float]:
    """(the step's length, its idle share) with each op weighed by what it computes
    (WORK) and each tick as long as its longest op: the ticks run in lockstep, each
    ending with its hand-overs."""
    work = np.vectorize(WORK.get)(table[..., 0])
    longest = work.max(axis=1)
    return int(longest.sum()), float(1 - work.sum() / (longest.sum() * table.shape[1]))


def handover_share(schedule: Schedule, p: int, m: int) -> float:
    """Share of the tick loop's hand-overs that really happen: 1f1b and zb-h1 skip the ticks on
    which no stage sends that way (the ledger, reading the HLO, counts every tick)."""
    if schedule not in TICKED:
        return 1.0
    table = ticked_table(schedule, p, m).table
    back = np.isin(table[:, 1:, 0], BACKWARDS)
    fired = (table[:, :-1, 0] == FWD).any(axis=1).sum() + back.any(axis=1).sum()
    return float(fired) / (2 * len(table))


TICKS_SCOPE = "pipeline_ticks"  # named scope of the tick loop, found in the HLO by the ledger
