"""The columns of `jaxpar plan`'s table (jaxpar.cost.planner.report), defined: what
`jaxpar plan --help` prints, read before jax starts."""

COLUMNS = """columns of the table, per device unless named otherwise:
  layout        the degrees, ZeRO stage, offload, micro-batches, recompute, accumulation
  device GiB    all the device holds at the peak of a step: state, activations, buffers
  state         GiB of master parameters, gradients and optimizer state on the device,
                counted leaf by leaf as this layout places them
  paper state   the ZeRO paper's count of the same for this stage: 2 + 2 + 12 bytes a
                parameter (fp16 weights and gradients, Adam's fp32 state), the parts the
                stage splits divided by the data degree; it differs from `state` where
                the run keeps other dtypes (fp32 weights) or a leaf is not split as the
                paper assumes (a replicated norm)
  frozen        (adapter runs) GiB of the frozen base the device holds
  trained MiB   (adapter runs) the adapters, their gradients and master copies
  opt state MiB (adapter runs) the adapters' optimizer state
  activations   GiB kept for the backward pass (after recompute)
  host GiB      offloaded state, per host
  comm/step     bytes each device sends per step; comm ms, compute ms: their predicted
                times; bubble: the pipeline's idle share; step ms: the predicted step"""
