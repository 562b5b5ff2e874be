"""Running a loop: `scan`/`while_loop`, a step traced into a step program and replayed, and the
executor that runs a plan's forward, snapshots and backward as one tape entry.
"""
