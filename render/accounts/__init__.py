"""Who is asking, for which tier, and what they used: the front's accounts (docs/worker.md, "Accounts").

The HTTP API asks this module, per request, who the caller is (`identify`: a key from the keys
file, or the account a trusted balancer names), which tier it asked for and may start at
(`asked`: tier headers only from worker.trusted_proxies), and which tier it gets
(`admit`: entitlement, budget from the ledger, the node's throttle: render/accounts/tier_grant.py); and,
at each job's end, charges the key the engine seconds the job used (`charge`). Without a keys
file every caller is anonymous and may use every tier; nothing is counted against anyone.
The engine only measures (render/engine/scheduler.py); deciding and counting happen here, in the front.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from turbonode.accounts import Account, parse_period
from turbonode.config import WorkerConfig
from turbonode.text import quote
from turbonode.tier_headers import ACCOUNT_HEADER, TIER_HEADER
from turbonode.tiers import DEFAULT_TIER, TIER_NAMES

from .keys import AuthError, KeyRing
from .ledger import Ledger, counter
from .ledger_stores import open_store
from .tier_grant import Grant, grant
from .trust import TrustedProxies

log = logging.getLogger(__name__)


class UnknownTier(ValueError):
    """A tier name that is none of the tiers; the message names where it came from."""


@dataclass(frozen=True)
class Asked:
    requested: str  # the tier the client asked for
    start: str  # the highest tier it may get: `requested`, or lower when its header was ignored


@dataclass(frozen=True)
class Admission:
    account: Account | None
    grant: Grant
    retry_after_s: float | None = None  # a refusal for budget: until the period resets


class Accounts:
    def __init__(
        self,
        keyring: KeyRing | None,
        ledger: Ledger | None,
        trusted: TrustedProxies,
        metrics: Any = None,
        wall: Callable[[], float] = time.time,
    ):
        self.keyring, self.ledger, self.trusted = keyring, ledger, trusted
        self.metrics = metrics
        self.wall = wall

    @classmethod
    def from_config(cls, cfg: WorkerConfig, metrics: Any = None) -> Accounts:
        """As the worker's settings say: a keys file and a ledger (embedded or Redis), or open."""
        trusted = TrustedProxies(cfg.trusted_proxies)
        if not cfg.keys_file:
            return cls(None, None, trusted, metrics)
        keyring = KeyRing(cfg.keys_file, parse_period(cfg.budget_period))
        return cls(keyring, Ledger(open_store(cfg.ledger, cfg.ledger_file)), trusted, metrics)

    @property
    def keyed(self) -> bool:
        return self.keyring is not None

    def start(self) -> None:
        """On the event loop that serves the API: the ledger's writer."""
        if self.ledger is not None:
            self.ledger.start()

    async def close(self) -> None:
        if self.ledger is not None:
            await self.ledger.close()

    # ---- per request -----------------------------------------------------------------

    def _trusted(self, headers: Mapping[str, str], peer: str | None) -> bool:
        """Whether `peer` may set the tier and account headers; counts and logs the ignored ones."""
        if self.trusted.trusts(peer):
            return True
        sent = [h for h in (TIER_HEADER, ACCOUNT_HEADER) if h in headers]
        if sent:
            self.trusted.ignored(peer, sent)
            if self.metrics is not None:
                for h in sent:
                    self.metrics.untrusted_headers.labels(h).inc()
        return False

    def identify(self, headers: Mapping[str, str], peer: str | None) -> Account | None:
        """The caller's account (None without keys); AuthError (render/accounts/keys.py) when it has none."""
        if self.keyring is None:
            self._trusted(headers, peer)  # counted and logged all the same
            return None
        try:
            name = headers.get(ACCOUNT_HEADER)
            if name is not None and self._trusted(headers, peer):
                return self.keyring.named(name)
            return self.keyring.authenticate(headers.get("Authorization"))
        except AuthError as exc:
            if self.metrics is not None:
                self.metrics.auth_failures.labels(exc.reason).inc()
            raise

    def asked(self, body_tier: Any, headers: Mapping[str, str], peer: str | None) -> Asked:
        """The tier asked for and the one the request may start at. A trusted balancer's header is
        its decision and wins over the body; anyone else's is ignored (the body's tier, or the
        default, then applies). UnknownTier for a name that is no tier, where it is obeyed."""
        header = headers.get(TIER_HEADER)
        if body_tier is not None and body_tier not in TIER_NAMES:
            raise UnknownTier(f"'tier': unknown tier {quote(body_tier)} (expected one of {', '.join(TIER_NAMES)})")
        if header is not None and self.trusted.trusts(peer):
            if header not in TIER_NAMES:
                raise UnknownTier(
                    f"header {TIER_HEADER}: unknown tier {quote(header)} (expected one of {', '.join(TIER_NAMES)})"
                )
            return Asked(header, header)
        start = body_tier or DEFAULT_TIER
        claimed = header if header in TIER_NAMES and not body_tier else None
        return Asked(claimed or start, start)

    async def admit(self, account: Account | None, asked: Asked, throttle: Any = None) -> Admission:
        """The tier the request runs in (or a refusal), from what the key may use, what it has
        spent this period (read from the ledger) and what the node's throttle sheds or pauses."""
        shed = throttle.shed_tiers if throttle is not None else ()
        paused = throttle.paused_tiers if throttle is not None else ()
        if account is None:
            g = grant(asked.requested, asked.start, TIER_NAMES, (), shed, paused)
            return self._counted(None, g)
        now = self.wall()
        window = account.period.window(now)
        budgeted = [t for t in account.tiers if t in account.budget]
        spent: set[str] = set()
        if budgeted and self.ledger is not None:
            used = await self.ledger.spent_us([counter(account.name, t, window.id) for t in budgeted])
            spent = {t for t, us in zip(budgeted, used) if us >= account.budget[t] * 1e6}
        g = grant(asked.requested, asked.start, account.tiers, spent, shed, paused)
        retry = max(1.0, window.end - now) if g.tier is None and spent else None
        return self._counted(account, g, retry)

    def _counted(self, account: Account | None, g: Grant, retry_after_s: float | None = None) -> Admission:
        if g.downgraded and self.metrics is not None:
            self.metrics.downgrades.labels(g.requested, g.reason).inc()
        return Admission(account, g, retry_after_s)

    # ---- at a job's end ----------------------------------------------------------------

    def charge(self, account: Account | None, tier: str, engine_s: float) -> None:
        """The key pays the engine seconds its job used, in the tier it ran in, this period."""
        if account is None or self.ledger is None or engine_s <= 0:
            return
        window = account.period.window(self.wall())
        # kept one period after its own ends: `turboctl keys` can still show the last period
        expires = window.end + (window.end - window.start)
        self.ledger.charge(counter(account.name, tier, window.id), round(engine_s * 1e6), expires)
        if self.metrics is not None:
            self.metrics.engine_seconds.labels(account.name, tier).inc(engine_s)
