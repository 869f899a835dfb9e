"""Plugins for every test: skip_guard (no silent skips under CI=true), process_guard (no test
leaves a process running)."""

pytest_plugins = ["skip_guard", "process_guard"]
