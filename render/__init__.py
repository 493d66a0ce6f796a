"""The worker: diffusion backends, step-level priority scheduler, HTTP API, control server."""
