"""Running a scenario: the run loop, the target, faults on schedule, the timeline and what a
run folder holds."""
