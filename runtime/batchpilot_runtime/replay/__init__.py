"""Replays: traces, the step-cost model, ServeGen day generation and the load generator."""
