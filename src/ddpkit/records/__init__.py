"""What a run leaves behind for people: the run log, experiment trackers and charts."""
