"""What the worker's HTTP API reads and answers about tiers (docs/worker.md, "Accounts"): the
header names and the reasons a request runs in a lower tier than it asked for. Shared by the
worker, the load generator and the HAProxy example (deploy/haproxy/turbonode.cfg)."""

from __future__ import annotations

# Request: the tier asked for, honoured only from worker.trusted_proxies (the balancer).
# Response: the tier that served the request.
TIER_HEADER = "X-Turbonode-Tier"
# Request: the name of the key the balancer authenticated (worker.trusted_proxies only).
ACCOUNT_HEADER = "X-Turbonode-Account"
# Response, when the serving tier is not the one asked for: why (one of DOWNGRADE_REASONS) ...
DOWNGRADED_HEADER = "X-Turbonode-Downgraded"
# ... and the tier that was asked for.
REQUESTED_TIER_HEADER = "X-Turbonode-Requested-Tier"

BUDGET = "budget"  # the key's budget of engine seconds for the tier is spent this period
NOT_ENTITLED = "not_entitled"  # the key may not use the tier
SHED = "shed"  # the node's throttle sheds the tier (new jobs of it are refused)
PAUSED = "paused"  # the node's throttle pauses the tier (its jobs wait)
HEADER_IGNORED = "header_ignored"  # the tier header came from an address outside worker.trusted_proxies
DOWNGRADE_REASONS = (BUDGET, NOT_ENTITLED, SHED, PAUSED, HEADER_IGNORED)
