"""Watching acceptance: sources (scrape, PromQL, log lines), windows, the pure policy, and the watcher."""
