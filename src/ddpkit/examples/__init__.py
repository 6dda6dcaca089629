"""Built-in jobs that `ddpkit train --example NAME` runs. Each module has `DEFAULTS`
(TrainConfig values that suit it) and `build(ctx) -> Job`."""
