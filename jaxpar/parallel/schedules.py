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

What a chunk reads of its micro-batch besides the activation (the documents' segment
ids and positions, jaxpar.nn.documents) travels with no hand-over: every stage holds the
whole micro-batch (the batch is split over `data`, not `pipeline`) and the tick table
says which micro-batch each stage runs, so each stage takes its own copy's rows.

The activation handed on is any pytree (a mixture of experts hands its routing's sums
on beside the residual stream).
"""

from __future__ import annotations

import numpy as np

from jaxpar.config.sections import Schedule

IDLE, FWD, BWD = 0, 1, 2


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
    done = {}  # (kind, stage, i) -> tick
    ptr, rows, t = [0] * p, [], 0
    while any(ptr[s] < 2 * m for s in range(p)):
        row = [(IDLE, 0)] * p
        for s in range(p):
            if ptr[s] == 2 * m:
                continue
            kind, i = order[s][ptr[s]]
            if kind == FWD:
                ready = s == 0 or done.get((FWD, s - 1, i), t) < t
            else:
                ready = done.get((FWD, s, i), t) < t and (
                    s == p - 1 or done.get((BWD, s + 1, i), t) < t
                )
            if ready:
                row[s] = (kind, i)
        for s, (kind, i) in enumerate(row):
            if kind != IDLE:
                done[(kind, s, i)] = t
                ptr[s] += 1
        rows.append(row)
        t += 1

    # A stage input lives from its arrival (made there, on stage 0) to its backward.
    def arrival(s: int, i: int) -> int:
        return done[(FWD, 0, i)] if s == 0 else done[(FWD, s - 1, i)] + 1

    live = max(
        sum(arrival(s, i) <= t0 <= done[(BWD, s, i)] for i in range(m))
        for s in range(p)
        for t0 in range(len(rows))
    )
    return np.array(rows, dtype=np.int32), live


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
    if schedule is Schedule.ONE_F_ONE_B:
        table, _ = one_f_one_b(p, m)
        return np.concatenate([table, np.zeros_like(table[..., :1])], axis=-1)
    return circular(p, m, v)


def idle_share(table: np.ndarray) -> float:
    """The bubble, measured: the share of (tick, device) slots of a tick table that idle."""
    return float((table[..., 0] == IDLE).mean())


def handover_share(schedule: Schedule, p: int, m: int) -> float:
    """Share of the tick loop's hand-overs that really happen: 1f1b skips the ticks on
    which no stage sends that way (the ledger, reading the HLO, counts every tick)."""
    if schedule is not Schedule.ONE_F_ONE_B:
        return 1.0
    table, _ = one_f_one_b(p, m)
    fired = (table[:, :-1, 0] == FWD).any(axis=1).sum() + (table[:, 1:, 0] == BWD).any(axis=1).sum()
    return float(fired) / (2 * len(table))


TICKS_SCOPE = "pipeline_ticks"  # named scope of the tick loop, found in the HLO by the ledger
