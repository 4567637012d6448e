"""Placement and collectives: the mesh axes (`axes`) and the mesh (`mesh`), logical names
to axes and the four shardings of a leaf (`sharding`), the batch arithmetic
(`batches`), data parallelism (`data_parallel`, over the `ring` or a gradient `server`),
ZeRO (`zero`), the pipeline's stages and schedules (`pipeline`, `schedules`), context
parallelism (`context`), the checks every layout meets (`layout_checks`), hand-written
collectives (`collectives`), and many processes (`distributed`)."""
