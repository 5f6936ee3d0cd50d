"""What load replays and the simulator share: the trace format (one request a line), the record of
each request's fate, and the statistics over records (percentiles, goodput under SLOs, fairness)."""
