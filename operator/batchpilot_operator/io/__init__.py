"""I/O with the world: Prometheus, scraping the runtimes, pushes to their admin API, the Kubernetes API, and the operator's own metrics."""
