"""`jaxpar bench --only experts`: a mixture of experts split over expert = 1, 2, 4, 8: the
expert bytes against the minimum, and the share of choices dropped at each capacity."""

from __future__ import annotations

from jaxpar.bench import measure

# A mixture of experts in the base model's blocks (8 experts, top 2), its experts split
# over expert = 1, 2, 4, 8 (the rest of the 8 devices on data), ZeRO-0.
EXPERTS = {
    f"expert={x}{name}": (
        "model.name=mixtral", "model.experts=8", f"parallel.data={8 // x}", f"parallel.expert={x}",
        f"model.capacity_factor={factor}",
    )
    for x, name, factor in ((1, "", 1.25), (2, "", 1.25), (4, "", 1.25), (8, "", 1.25),
                            (2, ", capacity 2.0", 2.0), (1, ", dropless", 0),
                            (2, ", dropless", 0), (8, ", dropless", 0))
}  # fmt: skip

EXPERT_COLUMNS = {
    "step ms": measure.step_ms,
    "tokens/s": measure.tokens_per_s,
    "device params": measure.bytes_of(lambda rep: rep.memory_per_device.params),
    "device opt state": measure.bytes_of(lambda rep: rep.memory_per_device.opt_state),
    "expert wire": measure.bytes_of(lambda rep: rep.comm.by_axis["expert"].wire),
    "expert min": measure.bytes_of(lambda rep: rep.comm.by_axis["expert"].minimum or 0),
    "dropped": lambda r: f"{r['dropped']:.1%}",
    "comm/step": measure.comm,
    "ratio": measure.comm_ratio,
}


def run(base: measure.Base, steps: int, tables: dict, out=None) -> dict:
    where = measure.where(base)
    title = (
        f"mixture of experts (model.name=mixtral, 8 experts, top 2; capacity factor 1.25 "
        f"unless named; dropped: the last step's share of choices), {where}, ZeRO-0"
    )
    return {
        "experts": measure.layouts(
            "experts", tables, title, "experts over", EXPERTS, EXPERT_COLUMNS, steps, base
        )
    }
