"""The worker's engine process: its host (host.py: started by the front, serves its calls), the
scheduler thread (scheduler.py), the job table, the model, the four stages, the backends, the
model families and the tiny models. It never imports aiohttp, prometheus_client, redis,
render.front or render.accounts (tests/test_layout.py)."""
