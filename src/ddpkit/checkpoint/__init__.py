"""Checkpoints: one `.pt` file (`pt`) or a sharded DCP folder (`sharded`), the training
state that both hold (`state`), and digests of models and states (`digest`)."""
