"""The worker's front process: the HTTP API, admission and readiness, the balancer's weight, the
control socket, the metrics, and its handle on the engine process (remote_engine). It never
imports torch or render.engine (tests/test_layout.py): what it shares with the engine lives at
the top of render/, and the messages between them in render/link.py."""
