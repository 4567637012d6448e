"""The training loop (`trainer`) and what plugs into it around the steps (`hooks`), its
run directory (`rundir`), metrics and plots (`metrics`), what it prints (`console`),
checkpoints with orbax (`checkpoint`), and export (`export`)."""
