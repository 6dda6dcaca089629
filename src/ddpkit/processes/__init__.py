"""Starting and supervising the processes of a job.

`launch` (one machine) and `ddpkit run` (torchrun's elastic agent) start workers, set
their environment, watch them for crashes and hangs and report what went wrong. The
process group's life (`group`), signals and preemption, SLURM and the scratch folder
live here too. Nothing here knows about models or training.
"""
