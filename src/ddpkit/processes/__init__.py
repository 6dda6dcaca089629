"""Starting and supervising the processes of a job.

`launch` (one machine) and `ddpkit run` (torchrun's elastic agent) start workers, set
their environment, watch them for crashes and hangs and report what went wrong. The
process group's life (`group`), passing stop signals on to the workers, SLURM and the
scratch folder live here too; what runs inside each rank for them is `ddpkit.inrank`.
Nothing here knows about models or training.
"""
