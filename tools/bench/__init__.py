"""`specserve bench`: drives a running cluster through its public API and compares speculation
configurations side by side (workload, plan, runner, metrics, report, cli)."""
