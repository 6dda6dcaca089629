"""Crash and hang diagnosis: the watchdog in each rank, the shim that `ddpkit run`
starts in each worker, and the report the supervisor reads back."""
