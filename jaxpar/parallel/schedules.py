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
- zbv: ZB-H1's ops on two chunks a device, placed in a V (device s holds chunk s and
  chunk 2p - 1 - s), so a micro-batch's forward turns on the last device with no
  hand-over and ends on the first, which also holds the embedding. Twice the ops, each
  half the work: the warm-up and cool-down idle half as long.
- dualpipev: DeepSeek's DualPipeV on zbv's V, each device's ops in its order: in the
  steady state each tick is a pair, one micro-batch's forward of one chunk then
  another's whole backward (R, B and W) of the other chunk, on one tick (DualPipe's
  overlapped step; here one after the other, the hand-overs at the tick's end); warm-up
  and cool-down as single ops, with zero-bubble W's deferred where DualPipeV defers them.

What a chunk reads of its micro-batch besides the activation (the documents' segment
ids and positions, jaxpar.nn.documents) travels with no hand-over: every stage holds the
whole micro-batch (the batch is split over `data`, not `pipeline`) and the tick table
says which micro-batch each stage runs, so each stage takes its own copy's rows.

The activation handed on is any pytree (a mixture of experts hands its routing's sums
on beside the residual stream).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import numpy as np

from jaxpar.config.sections import Schedule

IDLE, FWD, BWD, INPUT, WEIGHT, RECOMPUTE, PAIR = 0, 1, 2, 3, 4, 5, 6
# What each op computes, in forward passes of its chunk (the unit of the bubble): a 1F1B
# backward recomputes the chunk's forward, then makes both gradients; a zero-bubble R
# recomputes it, keeping each layer's residuals; B makes the input's gradient from
# them, keeping what W reads; W makes the weights' gradient from that. A DualPipeV pair
# is a forward of one chunk and the R, B and W of the other's, on one tick.
WORK = {IDLE: 0, FWD: 1, BWD: 3, RECOMPUTE: 1, INPUT: 1, WEIGHT: 1, PAIR: 4}
BACKWARDS = (BWD, INPUT)  # the ops that hand a gradient back to the previous chunk
FORWARDS = (FWD, PAIR)  # the ops that hand an activation on (a pair: and a gradient)
# tables with backward ticks
TICKED = (Schedule.ONE_F_ONE_B, Schedule.ZB_H1, Schedule.ZBV, Schedule.DUALPIPEV)
SPLIT = TICKED[1:]  # each backward as R, B and W (zero-bubble)
V_SHAPED = TICKED[2:]  # two chunks a device, in a V (jaxpar.parallel.pipeline)


class Ticked(NamedTuple):
    """A schedule whose table holds its backward ticks, and the slots a chunk needs."""

    # [ticks, p, 3] of (action, micro-batch, the device's chunk k); dualpipev's [ticks, p,
    # 4], a pair's backward micro-batch (of the other chunk) fourth
    table: np.ndarray
    inputs: int  # chunk inputs held at once (arrival to backward)
    residuals: int  # recomputed residuals a device holds at once over its chunks (R to B;
    # 1f1b: 0): one, as each B runs the tick after its R
    weights: int  # what B kept for W, held at once (B to W; 1f1b: 0)


def chunk_of(s, k, p: int, vee: bool):
    """The pipeline-order chunk that device `s` holds as its k-th: s, or in a V (two
    chunks a device) 2p - 1 - s for the second (numpy or jax integers alike)."""
    return (2 * p - 1 - s) * k + s * (1 - k) if vee else s


def _ready(kind: int, c: int, i: int, n: int, done: dict, t: int) -> bool:
    """Whether op (kind, chunk c of n, micro-batch i) may run on tick t: what it reads
    was made on an earlier tick (a hand-over arrives one tick later)."""
    before = lambda *op: done.get(op, t) < t  # noqa: E731
    if kind == FWD:
        return c == 0 or before(FWD, c - 1, i)
    if kind == WEIGHT:
        return before(INPUT, c, i)
    if kind == RECOMPUTE:
        return before(FWD, c, i)
    mine = before(RECOMPUTE, c, i) if kind == INPUT else before(FWD, c, i)
    return mine and _gradient_there(c, i, n, done, t)


def _gradient_there(c: int, i: int, n: int, done: dict, t: int) -> bool:
    """Whether chunk c's output gradient of micro-batch i is there on tick t: the last
    chunk's from its own forward (which takes the loss), the others' handed back."""
    before = lambda *op: done.get(op, t) < t  # noqa: E731
    return c == n - 1 or before(BWD, c + 1, i) or before(INPUT, c + 1, i)


def _pair_ready(op, s: int, p: int, done: dict, t: int) -> bool:
    """Whether a pair (PAIR, i, k, j) may run on device s on tick t: chunk k's forward
    of i, and the other chunk's R, B and W of j, one after the other on the tick (R
    reads its forward's input, B its R's residuals and the gradient handed back)."""
    _, i, k, j = op
    c, b = chunk_of(s, k, p, True), chunk_of(s, 1 - k, p, True)
    return (
        _ready(FWD, c, i, 2 * p, done, t)
        and _ready(RECOMPUTE, b, j, 2 * p, done, t)
        and _gradient_there(b, j, 2 * p, done, t)
    )


def _entry_ready(op, s: int, p: int, vee: bool, done: dict, t: int) -> bool:
    """Whether table entry `op` (an op or a pair) may run on device s on tick t."""
    kind, i, k = (int(v) for v in op[:3])
    if kind == PAIR:
        return _pair_ready(tuple(int(v) for v in op), s, p, done, t)
    return _ready(kind, chunk_of(s, k, p, vee), i, p * (2 if vee else 1), done, t)


def has_pairs(table: np.ndarray) -> bool:
    """Whether a tick table holds DualPipeV's pairs (a second hand-over a tick)."""
    return bool((table[..., 0] == PAIR).any())


def _units(op, s: int, p: int, vee: bool) -> list:
    """The (kind, pipeline chunk, micro-batch) ops that table entry `op` runs on device s
    (a pair: its forward, then the other chunk's R, B and W)."""
    kind, i, k = (int(v) for v in op[:3])
    if kind == IDLE:
        return []
    if kind != PAIR:
        return [(kind, chunk_of(s, k, p, vee), i)]
    b, j = chunk_of(s, 1 - k, p, vee), int(op[3])
    return [(FWD, chunk_of(s, k, p, vee), i)] + [(x, b, j) for x in (RECOMPUTE, INPUT, WEIGHT)]


def _placed(choose, p: int, total, vee: bool = False, width: int = 3) -> tuple[list, dict]:
    """Tick by tick, each device runs the op `choose(s, done, t)` names ((kind,
    micro-batch, its chunk k), or None: idle) until every device has run `total` ops
    (an int, or one a device);
    (rows of (kind, micro-batch, k), done: (kind, chunk, micro-batch) -> tick). `width`
    4: dualpipev's entries, a pair's backward micro-batch fourth."""
    done: dict = {}
    totals = [total] * p if isinstance(total, int) else list(total)
    count, rows, t = [0] * p, [], 0
    while any(c < n for c, n in zip(count, totals, strict=True)):
        row = [(IDLE,) + (0,) * (width - 1)] * p
        for s in range(p):
            op = choose(s, done, t) if count[s] < totals[s] else None
            if op is not None:
                row[s] = op
        for s, op in enumerate(row):
            for unit in _units(op, s, p, vee):
                done[unit] = t
            count[s] += op[0] != IDLE
        rows.append(row)
        t += 1
        if t > 4 * (max(totals) + p):  # a table's priorities that leave every stage waiting
            raise RuntimeError(f"no op can run on tick {t} of a {p}-stage table")
    return rows, done


def _in_order(order: list[list], p: int):
    """choose: each stage's ops in the fixed `order`, each as soon as it is ready."""
    ptr = [0] * len(order)

    def choose(s, done, t):
        kind, i = order[s][ptr[s]]
        if not _ready(kind, s, i, p, done, t):
            return None
        ptr[s] += 1
        return kind, i, 0

    return choose


def _held(done: dict, n: int, m: int, ticks: int, start: int, end: int) -> int:
    """The most micro-batches a chunk holds at once, from op `start`'s tick (FWD: from
    the input's arrival) to op `end`'s."""

    def since(c, i):
        if start != FWD:
            return done[(start, c, i)]
        return done[(FWD, 0, i)] if c == 0 else done[(FWD, c - 1, i)] + 1

    most = 0
    for c in range(n):  # each micro-batch held from `since` to `end`, both included
        delta = np.zeros(ticks + 1, np.int64)
        for i in range(m):
            delta[since(c, i)] += 1
            delta[done[(end, c, i)] + 1] -= 1
        most = max(most, int(np.cumsum(delta).max()))
    return most


def one_f_one_b(p: int, m: int) -> tuple[np.ndarray, int]:
    """([ticks, p, 3] of (action, micro-batch, 0), slots): PipeDream-flush 1F1B, each op
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
    """ZB-H1 (Qi et al. 2024). Each tick a stage runs, by priority: the W of its last B
    (one W waits at most: ZB-H1's memory, what B keeps for W held for one micro-batch);
    else the next B that is ready (the previous stage waits for it); else the next R once
    the next stage has recomputed that micro-batch (its B follows, so this stage's B can
    run a tick after it); else the next forward if it holds fewer than p micro-batches
    (forward run, W not yet: 1F1B's count, on its first stage). B is shorter than 1F1B's
    backward by W, so the backward chain returns sooner: the paper's (p - 1)(F + B - W)
    idle, which letting W's wait longer would cut further only by holding more of them."""
    return _zero_bubble(p, m, vee=False, limit=p, waiting=1)


def zbv(p: int, m: int) -> Ticked:
    """ZBV (Qi et al. 2024, section 6): two chunks a device in a V, chunk s and 2p - 1 - s
    on device s, so device 0 runs both the first chunk and the last, and a micro-batch's
    forward turns on device p - 1 with no hand-over. ZB-H1's priorities over both chunks
    (the older micro-batch first, the later chunk on a tie), with at most 2p chunk
    micro-batches in flight on a device: 1F1B's activations, each half a stage."""
    return _zero_bubble(p, m, vee=True, limit=2 * p, waiting=None)


def dualpipev(p: int, m: int) -> Ticked:
    """DualPipeV (DeepSeek-V3's DualPipe cut in half, on zbv's V; read from DeepSeek's
    dualpipev.py, m >= 2p). Each device runs its own order, each entry on the first tick
    it is ready: 2(p-s-1) forwards of its first chunk; s+1 of both chunks in turn;
    p-s-1 of (the second chunk's B with its W deferred, that W, a forward of the second
    chunk); then the steady state, m-2p+s+1 of two pairs, (a first-chunk forward beside
    a second-chunk backward) and (a second-chunk forward beside a first-chunk backward)
    (the last device's first pair as single ops); p-s-1 of (a second-chunk backward, a
    pair); s+1 of the two chunks' backwards, their W's deferred from the middle on; then
    those W's, oldest first, p-s-1 of them each before a first-chunk backward."""
    if m < 2 * p:
        raise ValueError(f"dualpipev runs 2p = {2 * p} micro-batches or more, not {m}")
    orders = [_dualpipev_order(p, m, s) for s in range(p)]
    ptr = [0] * p

    def choose(s, done, t):
        op = orders[s][ptr[s]]
        if not _entry_ready(op, s, p, True, done, t):
            return None
        ptr[s] += 1
        return op

    rows, done = _placed(choose, p, [len(o) for o in orders], vee=True, width=4)
    ticks = len(rows)
    return Ticked(
        np.array(rows, dtype=np.int32),
        inputs=_held(done, 2 * p, m, ticks, FWD, INPUT),
        residuals=_most_recomputed(rows),
        weights=_held(done, 2 * p, m, ticks, INPUT, WEIGHT),
    )


def _dualpipev_order(p: int, m: int, s: int) -> list:
    """Device s's DualPipeV entries, in order: (kind, micro-batch, chunk k, a pair's
    backward micro-batch). A backward is R then B, and its W at once or deferred (the
    deferred ones run oldest first)."""
    order, fwd, bwd, deferred = [], [0, 0], [0, 0], []

    def forward(k):
        order.append((FWD, fwd[k], k, 0))
        fwd[k] += 1

    def backward(k, defer=False):
        i = bwd[k]
        bwd[k] += 1
        order.extend([(RECOMPUTE, i, k, 0), (INPUT, i, k, 0)])
        if defer:
            deferred.append((k, i))
        else:
            order.append((WEIGHT, i, k, 0))

    def weight():
        k, i = deferred.pop(0)
        order.append((WEIGHT, i, k, 0))

    def pair(k):  # chunk k's forward beside the other chunk's backward
        order.append((PAIR, fwd[k], k, bwd[1 - k]))
        fwd[k] += 1
        bwd[1 - k] += 1

    last, rest = s == p - 1, p - s - 1
    for _ in range(2 * rest):
        forward(0)
    for _ in range(s + 1):
        forward(0)
        forward(1)
    for _ in range(rest):
        backward(1, defer=True)
        weight()
        forward(1)
    for n in range(m - 2 * p + s + 1):
        if n == 0 and last:  # DeepSeek's: not overlapped, for a smaller bubble
            forward(0)
            backward(1)
        else:
            pair(0)
        pair(1)
    for _ in range(rest):
        backward(1)
        pair(1)
    defer = False
    for n in range(s + 1):  # the second half's W's deferred (from the middle on)
        defer = defer or (n == (s + 1) // 2 and s % 2 == 1)
        backward(1, defer)
        defer = defer or (n == (s + 1) // 2 and s % 2 == 0)
        backward(0, defer)
    for _ in range(rest):
        weight()
        backward(0, defer=True)
    while deferred:
        weight()
    return order


def _zero_bubble(p: int, m: int, vee: bool, limit: int, waiting: int | None) -> Ticked:
    """The zero-bubble tables: W where `waiting` W's wait (None: no bound), else B, else
    R, else F (fewer than `limit` of the device's chunk micro-batches forward run and W
    not yet), else W; among a device's chunks the older micro-batch first, the later
    chunk on a tie."""
    n, ks = p * (2 if vee else 1), (1, 0) if vee else (0,)
    nxt: dict = {}

    def choose(s, done, t):
        chunks = [(k, chunk_of(s, k, p, vee)) for k in ks]
        get = lambda kind, c: nxt.get((kind, c), 0)  # noqa: E731
        in_flight = sum(get(FWD, c) - get(WEIGHT, c) for _, c in chunks)
        held = sum(get(INPUT, c) - get(WEIGHT, c) for _, c in chunks)
        if waiting is not None and held >= waiting:
            return _oldest_weight(chunks, get, nxt)
        for kind, wanted in (
            (INPUT, lambda c, i: i < get(RECOMPUTE, c)),
            (RECOMPUTE, lambda c, i: i < get(FWD, c) and _after_next(c, i, n, done, t)),
            (FWD, lambda c, i: i < m and (in_flight < limit or c >= p)),
        ):
            ready = [
                (get(kind, c), k, c)
                for k, c in chunks
                if wanted(c, get(kind, c)) and _ready(kind, c, get(kind, c), n, done, t)
            ]
            if ready:
                i, k, c = min(ready, key=lambda r: r[0])
                nxt[(kind, c)] = i + 1
                return kind, i, k
        return _oldest_weight(chunks, get, nxt)

    rows, done = _placed(choose, p, 4 * m * len(ks), vee)
    ticks = len(rows)
    return Ticked(
        np.array(rows, dtype=np.int32),
        inputs=_held(done, n, m, ticks, FWD, INPUT),
        residuals=_most_recomputed(rows),
        weights=_held(done, n, m, ticks, INPUT, WEIGHT),
    )


def _oldest_weight(chunks: list, get, nxt: dict):
    """The oldest W whose B has run, over the device's chunks, or None."""
    ready = [(get(WEIGHT, c), k, c) for k, c in chunks if get(WEIGHT, c) < get(INPUT, c)]
    if not ready:
        return None
    i, k, c = min(ready, key=lambda r: r[0])
    nxt[(WEIGHT, c)] = i + 1
    return WEIGHT, i, k


def _most_recomputed(rows: list) -> int:
    """The most R's run whose B has not, on any device (its chunks together)."""
    kinds = np.array(rows)[..., 0]
    held = np.cumsum(kinds == RECOMPUTE, axis=0) - np.cumsum(kinds == INPUT, axis=0)
    return int(held.max())


def forward_table(p: int, m: int, vee: bool) -> Ticked:
    """The forward ticks alone (an evaluation's), each as soon as it is ready: the older
    micro-batch first, a device's later chunk on a tie."""
    n, ks = p * (2 if vee else 1), (1, 0) if vee else (0,)
    nxt: dict = {}

    def choose(s, done, t):
        ready = [
            (nxt.get(c, 0), k, c)
            for k, c in ((k, chunk_of(s, k, p, vee)) for k in ks)
            if nxt.get(c, 0) < m and _ready(FWD, c, nxt.get(c, 0), n, done, t)
        ]
        if not ready:
            return None
        i, k, c = min(ready, key=lambda r: r[0])
        nxt[c] = i + 1
        return FWD, i, k

    rows, done = _placed(choose, p, m * len(ks), vee)
    return Ticked(np.array(rows, dtype=np.int32), _held(done, n, m, len(rows), FWD, FWD), 0, 0)


def _after_next(c: int, i: int, n: int, done: dict, t: int) -> bool:
    """R of (chunk c, micro-batch i) waits for the next chunk's R of it (its B follows,
    so this chunk's B can run a tick after it)."""
    return c == n - 1 or done.get((RECOMPUTE, c + 1, i), t) < t


def check(table: np.ndarray, m: int, vee: bool = False) -> None:
    """Raise ValueError unless `table` ([ticks, p, 3], or dualpipev's 4) runs every op of
    every micro-batch on every chunk exactly once (a forward, and a fused backward or
    its R, B and W), each after what it reads; `vee`: two chunks a device in a V."""
    ticks, p = table.shape[:2]
    done: dict = {}
    for t in range(ticks):
        for s in range(p):
            op = table[t, s]
            kind, i, k = (int(v) for v in op[:3])
            if kind == IDLE:
                continue
            units = _units(op, s, p, vee)
            if any(u in done or not 0 <= u[2] < m for u in units):
                raise ValueError(
                    f"tick {t}, stage {s}: {_NAMES[kind]} of micro-batch {i}{_of(k, vee)} twice"
                )
            if not _entry_ready(op, s, p, vee, done, t):
                raise ValueError(
                    f"tick {t}, stage {s}: {_NAMES[kind]} of micro-batch {i}{_of(k, vee)} runs "
                    "before what it reads is there"
                )
        for s in range(p):
            for unit in _units(table[t, s], s, p, vee):
                done[unit] = t
    for s in range(p):
        for k in range(2 if vee else 1):
            c = chunk_of(s, k, p, vee)
            for i in range(m):
                split = (INPUT, c, i) in done
                wanted = (FWD, RECOMPUTE, INPUT, WEIGHT) if split else (FWD, BWD)
                missing = [_NAMES[kind] for kind in wanted if (kind, c, i) not in done]
                if missing:
                    raise ValueError(
                        f"stage {s}: micro-batch {i}{_of(k, vee)} never runs {', '.join(missing)}"
                    )


def _of(k: int, vee: bool) -> str:
    return f" of its chunk {k}" if vee else ""


_NAMES = {FWD: "F", BWD: "B+W", RECOMPUTE: "R", INPUT: "B", WEIGHT: "W", PAIR: "F beside R+B+W"}


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
    the ticked schedules (where a tick holds a forward or a backward)."""
    if schedule in TICKED:
        return ticked_table(schedule, p, m).table
    return circular(p, m, v)


@functools.cache  # (the step's trace, its ledger and the planner ask again)
def ticked_table(schedule: Schedule, p: int, m: int) -> Ticked:
    """A schedule whose table holds its backward ticks (1f1b, zb-h1, zbv, dualpipev)."""
    if schedule is Schedule.ZB_H1:
        return zb_h1(p, m)
    if schedule is Schedule.ZBV:
        return zbv(p, m)
    if schedule is Schedule.DUALPIPEV:
        return dualpipev(p, m)
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


def sends(table: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """([ticks], [ticks]): whether some device hands the next one something on the
    tick (first chunks' activations, a V's second chunks' gradients), and whether some
    device hands the previous one something (the rest). A V turns on its last device
    with no hand-over. A pair's gradient goes its forward's way, apart (`pair_sends`)."""
    kind, k = table[..., 0], table[..., 2]
    fwd, back = np.isin(kind, FORWARDS), np.isin(kind, BACKWARDS)
    right = (fwd & (k == 0)) | (back & (k == 1))
    left = (fwd & (k == 1)) | (back & (k == 0))
    return right[:, :-1].any(axis=1), left[:, 1:].any(axis=1)


def pair_sends(table: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """([ticks], [ticks]): whether some device's pair hands its backward's gradient to the
    next device (a first-chunk forward beside a second-chunk backward: both go that way),
    and whether some device's hands it to the previous one."""
    pair, k = table[..., 0] == PAIR, table[..., 2]
    return (pair & (k == 0))[:, :-1].any(axis=1), (pair & (k == 1))[:, 1:].any(axis=1)


def handover_share(schedule: Schedule, p: int, m: int) -> float:
    """Share of the tick loop's hand-overs that really happen: the ticked schedules skip
    the ticks on which no stage sends that way (the ledger, reading the HLO, counts every
    tick)."""
    if schedule not in TICKED:
        return 1.0
    table = ticked_table(schedule, p, m).table
    right, left = sends(table)
    pair_r, pair_l = pair_sends(table)
    pairs = 2 if has_pairs(table) else 0  # the executor's second hand-overs a tick
    return float(right.sum() + left.sum() + pair_r.sum() + pair_l.sum()) / (
        (2 + pairs) * len(right)
    )


TICKS_SCOPE = "pipeline_ticks"  # named scope of the tick loop, found in the HLO by the ledger
