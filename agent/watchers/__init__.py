"""Watchers: each reads one source, turns it into policy signals, and reports its own success."""
