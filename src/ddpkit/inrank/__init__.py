"""What runs inside each rank for ddpkit's supervisor: the stop vote and what a stop
signal does in a rank (`preemption`), the hang watch and its collective tracker
(`watchdog`), the line that sends a rank's output to `ddpkit run` and the rank prefix
(`output`), and the audit's hooks and the file each rank writes (`audit`).

`training` and `parallel` use these, and the launchers in `processes` start them and
read what they leave; they import only the bottom layer (errors, storage, collectives,
hashing), and none imports torch when it is imported.
"""
