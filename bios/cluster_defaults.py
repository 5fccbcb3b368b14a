"""Defaults that `bios-coordinator` and `bios up` share, so the two ways of starting a cluster agree."""

# Every 10 optimizer steps, two kept per run: if the coordinator and every worker are lost together, a run
# resumes at most 9 steps back; a lone coordinator restart or worker loss rolls back nothing (live replicas hold
# every acknowledged step). `--checkpoint-every 1` makes every acknowledged step survive even losing every
# process at once, for about the cost of one save per step (bench/coordinator_restart.py measures it).
CHECKPOINT_EVERY = 10
KEEP_CHECKPOINTS = 2

# Seconds a worker's collective may wait for a peer that is alive but busier (one long row): the coordinator's
# --collective-timeout, sent to the workers with each generation. Liveness is the heartbeats' call, not this one's.
COLLECTIVE_TIMEOUT_S = 600.0

# The longest pause between the coordinator's progress checks (and so between its notices to waiting clients).
PROGRESS_EVERY_S = 30.0
