"""The training loop (`trainer`), its run directory (`rundir`), metrics and plots
(`metrics`), what it prints (`console`), checkpoints with orbax (`checkpoint`), and
export (`export`)."""
