"""`jaxpar inspect`: a compiled (never run) step, leaf by leaf.

Every parameter leaf with its shape, logical names, its storage / compute / gradient /
optimizer-state PartitionSpecs (a frozen leaf has neither of the last two) and its stored
bytes per device; then the ledger's
summary; and a picture of how the largest leaves and the batch lie over the mesh: one
panel each, a cell per device, cells holding the same block in the same colour.
"""

from __future__ import annotations

import math
from pathlib import Path

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxpar import recipe
from jaxpar.compiled.run import Run, prepare
from jaxpar.config.sections import Config
from jaxpar.cost.report import human_bytes, table
from jaxpar.parallel.axes import BATCH_AXES, CONTEXT, DATA, EXPERT, PIPE, REPLICA, TENSOR
from jaxpar.parallel.sharding import SPEC_FIELDS, LeafSpecs, leaf_key
from jaxpar.training import console, metrics

PANELS = 3  # largest leaves drawn, besides the batch


def _spec(spec: PartitionSpec) -> str:
    """(-, data*expert, tensor): a dim split over several axes joined by '*'."""

    def entry(a) -> str:
        return "-" if a is None else "*".join(a) if isinstance(a, tuple) else str(a)

    return "(" + ", ".join(entry(a) for a in spec) + ")"


def leaves(run: Run) -> list[dict]:
    """One row per parameter leaf of the trained layout (a pipeline's staged stack)."""
    trained, mesh = run.engine.problem, run.mesh
    rows = []

    def visit(path, specs: LeafSpecs, names, shape):
        stored = NamedSharding(mesh, specs.storage).shard_shape(shape.shape)
        key = leaf_key(path)
        frozen = key in trained.frozen  # no gradient, no optimizer state
        rows.append(
            {
                "path": key,
                "shape": tuple(shape.shape),
                "names": tuple(names),
                **{
                    f: None if frozen and f in ("grad", "opt") else getattr(specs, f)
                    for f in SPEC_FIELDS
                },
                "bytes": math.prod(stored) * shape.dtype.itemsize,
            }
        )

    jax.tree_util.tree_map_with_path(
        visit,
        run.engine.specs,
        trained.names,
        trained.shapes,
        is_leaf=lambda x: isinstance(x, LeafSpecs),
    )
    return rows


def leaf_table(rows: list[dict]) -> str:
    header = ["leaf", "shape", "logical names", *SPEC_FIELDS, "bytes/device"]
    cells = [
        [
            r["path"],
            "x".join(map(str, r["shape"])),
            " ".join(r["names"]),
            *("frozen" if r[f] is None else _spec(r[f]) for f in SPEC_FIELDS),
            human_bytes(r["bytes"]),
        ]
        for r in rows
    ]
    return table(cells, header)


def draw(run: Run, rows: list[dict], path: Path) -> None:
    """The largest leaves' storage and the batch over the mesh, one panel each."""
    import matplotlib  # here: only inspect pays the import

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mesh = run.mesh
    largest = sorted(rows, key=lambda r: -math.prod(r["shape"]))[:PANELS]
    batch = jax.tree.leaves(run.step.batch_shapes)[0]
    panels = [
        (f"{r['path']} {list(r['shape'])}\nstorage {_spec(r['storage'])}", r["shape"], r["storage"])
        for r in largest
    ] + [_batch_panel(run, batch.shape)]
    replicas, data = mesh.shape[REPLICA], mesh.shape[DATA]
    # (replica, data) x (expert, pipeline, context, tensor)
    grid = mesh.devices.reshape(replicas * data, -1)
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.6), dpi=110)
    for ax, (title, shape, spec) in zip(np.atleast_1d(axes), panels, strict=True):
        blocks = NamedSharding(mesh, spec).devices_indices_map(tuple(shape))
        names = {}
        for index in blocks.values():
            names.setdefault(_slices(index, shape), len(names))
        colours = plt.get_cmap("tab20", max(len(names), 1))
        for (i, j), device in np.ndenumerate(grid):
            label = _slices(blocks[device], shape)
            ax.add_patch(plt.Rectangle((j, -i - 1), 1, 1, color=colours(names[label]), alpha=0.85))
            ax.text(
                j + 0.5, -i - 0.5, f"d{device.id}\n{label}", ha="center", va="center", fontsize=6
            )
        ax.set_xlim(0, grid.shape[1])
        ax.set_ylim(-grid.shape[0], 0)
        ax.set_xticks([k + 0.5 for k in range(grid.shape[1])])
        ax.set_xticklabels([_column(mesh, k) for k in range(grid.shape[1])], fontsize=7)
        ax.set_yticks([-k - 0.5 for k in range(grid.shape[0])])
        ax.set_yticklabels(
            [
                (f"r{k // data} " if replicas > 1 else "") + f"data {k % data}"
                for k in range(grid.shape[0])
            ],
            fontsize=7,
        )
        ax.set_title(f"{title}\n{len(names)} distinct block(s)", fontsize=8)
    fig.suptitle(f"{run.report.strategy}: same colour = same block", fontsize=9)
    fig.tight_layout()
    metrics.save_figure(fig, path)


def _batch_panel(run: Run, shape) -> tuple[str, tuple, PartitionSpec]:
    """The batch's rows over the data axes; with context, each row's S tokens split
    over it too (the slots in the step's order: balanced, chunks i and 2C-1-i)."""
    if run.mesh.shape[CONTEXT] == 1:
        return f"batch {list(shape)}", shape, run.engine.batch_sharding.spec
    seq = run.cfg.train.seq_len
    order = "balanced: chunks i, 2C-1-i" if run.cfg.parallel.context_balance else "in order"
    title = f"batch inputs [{shape[0]}, {seq}]\nrows over data, tokens over context ({order})"
    return title, (shape[0], seq), PartitionSpec(BATCH_AXES, CONTEXT)


def _column(mesh, k: int) -> str:
    """A grid column's coordinates on the axes inside `data` (expert, pipeline, context,
    tensor): pipeline and tensor always, expert and context where they split."""
    inner = (EXPERT, PIPE, CONTEXT, TENSOR)
    at = np.unravel_index(k, [mesh.shape[a] for a in inner])
    shown = {EXPERT: "e", PIPE: "p", CONTEXT: "c", TENSOR: "t"}
    return " ".join(
        f"{shown[a]}{i}"
        for a, i in zip(inner, at, strict=True)
        if a in (PIPE, TENSOR) or mesh.shape[a] > 1
    )


def _slices(index: tuple, shape) -> str:
    """A block's index ranges, ':' for a whole dim."""
    parts = []
    for s, n in zip(index, shape, strict=False):
        start, stop = s.start or 0, n if s.stop is None else s.stop
        parts.append(":" if (start, stop) == (0, n) else f"{start}:{stop}")
    return "[" + ",".join(parts) + "]"


def inspect_config(cfg: Config, picture: Path) -> str:
    """A shipped model's step as the config says, compiled and not run (`jaxpar
    inspect`): the leaf table and the ledger's summary; the layout drawn to `picture`."""
    s = recipe.setup(cfg)
    run = prepare(cfg, s.problem, s.mesh, s.batches(0), force=True)
    rows = leaves(run)
    picture.parent.mkdir(parents=True, exist_ok=True)
    draw(run, rows, picture)
    n_params = sum(math.prod(x.shape) for x in jax.tree.leaves(s.problem.shapes))
    return "\n".join(
        [
            leaf_table(rows),
            "",
            console.startup(run.report, n_params, s.mesh.devices.flat[0].platform, s.source),
            f"\nlayout picture: {picture}",
        ]
    )
