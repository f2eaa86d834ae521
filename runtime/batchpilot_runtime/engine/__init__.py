"""The engine: the thread that runs scheduler and model step by step, and its watchdog."""
