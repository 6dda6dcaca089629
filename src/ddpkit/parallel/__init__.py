"""The building blocks of a data-parallel loop: the model (DDP, FSDP2, synced
BatchNorm), the data (samplers, loaders, batches), precision, gradient sync and the
rank helpers (`print`, `reduce_sum`, `gather_for_metrics`, ...)."""
