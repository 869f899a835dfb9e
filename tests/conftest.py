"""Plugins for every test: skip_guard (no silent skips under CI=true)."""

pytest_plugins = ["skip_guard"]
