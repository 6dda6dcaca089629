"""Built-in jobs that `ddpkit train --example NAME` runs (their names are in
`ddpkit.training.jobspec.EXAMPLES`). Each module has `DEFAULTS` (TrainConfig values that
suit it) and `build(ctx) -> Job`."""
