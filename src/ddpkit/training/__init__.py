"""The training loop: `TrainConfig`, `Trainer` and its callbacks, and `Job`, the unit
that `ddpkit train` and `ddpkit verify` build and run."""
