"""Adapters: low-rank updates trained on a frozen base (`adapter.*`).

- `lora`: which projections carry an adapter (by PEFT's names), and the Problem whose
  trained leaves are the adapters alone, the base frozen and stored as `adapter.base`.
- `quant`: the frozen base's 4-bit NormalFloat (QLoRA) and int8 storage.
- `peft`: adapters out to, and in from, Hugging Face PEFT's files.
- `initial`: a run's starting weights read from files, adapters and all.
"""
