"""The worker's HTTP API (aiohttp): OpenAI-compatible image generation plus job control.

POST /v1/images/generations takes OpenAI's fields (prompt, n, size, response_format
b64_json) and turbonode's (tier, steps, seed, guidance, negative_prompt, async); the tier
may also come from the X-Turbonode-Tier header. Synchronous requests wait for the images;
a client that disconnects cancels its job. `"async": true` answers 202 with a job id to
poll at GET /v1/jobs/{id} and cancel with DELETE. Bad input answers 4xx with a message,
full queues and shed tiers 429 with Retry-After; a worker still loading its model, draining,
or (with worker.refuse_unready) not ready for the tier answers 503 with Retry-After. Every
response of a job leaves on a socket marked with its tier's DSCP, so the node's QoS
classifies the images end to end.
GET /v1/models lists what the worker serves (OpenAI's list shape: one model, with its
family and per-tier defaults under `turbonode`).

Health, Kubernetes-style: GET /livez (the process and its engine turn), GET /readyz (the
model is loaded and the worker not draining), GET /readyz?tier=T (new work of tier T is
welcome here: render/front/readiness.py), and the original GET /healthz. GET /metrics.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import math
import random
import socket
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from render.accounts import Accounts, Admission, UnknownTier
from render.accounts.keys import AuthError
from render.accounts.trust import TrustedProxies
from render.jobs import (
    JobCancelled,
    JobFailed,
    JobRequest,
    Rejected,
    RequestDefaults,
    images_answer,
    images_data,
    tier_headers,
)
from render.png import encode_png
from turbonode.config import MAX_GUIDANCE, MAX_PIXELS, MIN_PIXELS
from turbonode.metric_names import CLIENT_CLOSED, UNKNOWN_TIER
from turbonode.text import parse_decimal, quote
from turbonode.throttle_params import MAX_STEPS
from turbonode.tier_headers import BUDGET
from turbonode.tiers import DEFAULT_TIER, PROTECTED_TIER, TIER_NAMES, tos_byte

from .admission import NewJob, predict
from .full_collections import FullCollections
from .readiness import ENGINE_STALL_S, Phase, Readiness, TierView, readiness

# How far past its objective a prediction replays the work ahead (render/front/admission.py): enough
# for a Retry-After that says when the job would fit, bounded so a deep queue costs little.
REPLAY_OBJECTIVES = 2.0

log = logging.getLogger(__name__)

MAX_PROMPT_CHARS = 4000
MAX_IMAGES = 10
MAX_WAIT_S = 600.0  # the longest GET /v1/jobs/{id}?wait= holds an answer
CHARGES_TIMEOUT_S = 2.0  # at stop: how long ended jobs' charges may take to reach the ledger
# OpenAI request fields that do not change what this worker renders; accepted and ignored.
IGNORED_OPENAI_FIELDS = {
    "model",
    "quality",
    "style",
    "user",
    "background",
    "moderation",
    "output_compression",
    "output_format",
}
TURBONODE_FIELDS = {
    "prompt",
    "negative_prompt",
    "n",
    "size",
    "response_format",
    "tier",
    "steps",
    "seed",
    "guidance",
    "async",
    "stream",
}


class BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None, status: int = 400):
        super().__init__(message)
        self.message, self.param, self.status = message, param, status


# Seeds of the jobs whose body names none: a generator seeded once from the kernel, not a draw from
# it per request (secrets.randbelow: os.urandom, a getrandom call that gives the GIL up; five per
# request, each a chance for another thread of the front, a GC storm's, to take the GIL for a whole
# collection before the request goes on). An image seed needs no secrecy.
_SEEDS = random.Random()
SEED_DRAWN = 2**31  # a drawn seed is below it (a body may name any up to 2**63 - 1)


def _int(body: dict, key: str, default, lo: int, hi: int) -> int:
    value = body.get(key, default)
    if value is None:
        value = default
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRequest(f"'{key}' must be an integer, got {quote(value)}", key)
    if not lo <= value <= hi:
        raise BadRequest(f"'{key}' must be between {lo} and {hi}, got {value}", key)
    return value


def _size(value, defaults: RequestDefaults) -> tuple[int, int]:
    if value is None or value == "auto":
        return defaults.size, defaults.size
    if not isinstance(value, str) or "x" not in value:
        raise BadRequest(
            f"'size' must be 'WIDTHxHEIGHT' (e.g. '{defaults.size}x{defaults.size}'), got {quote(value)}", "size"
        )
    w, _, h = value.partition("x")
    width, height = parse_decimal(w), parse_decimal(h)
    if width is None or height is None:
        raise BadRequest(f"'size' must be 'WIDTHxHEIGHT' with integer pixels, got {quote(value)}", "size")
    m = defaults.size_multiple
    lo = max(m, MIN_PIXELS)
    for side in (width, height):
        if not lo <= side <= MAX_PIXELS or side % m:
            raise BadRequest(
                f"'size' sides must be multiples of {m} between {lo} and {MAX_PIXELS}, got {quote(value)}", "size"
            )
    reason = defaults.size_check(height, width) if defaults.size_check else None
    if reason:
        raise BadRequest(f"'size' {reason}", "size")
    return width, height


def _text(key: str, value: str) -> None:
    """Refuse what JSON can spell but no text encoder can take: lone surrogates (e.g. "\\ud800")."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise BadRequest(
            f"'{key}' is not valid Unicode text: lone surrogate {quote(exc.object[exc.start : exc.end])} "
            f"at character {exc.start}",
            key,
        ) from None


def parse_json_body(raw: bytes, charset: str | None):
    """The request body as JSON; BadRequest for an unknown charset, undecodable bytes, bad or
    too deeply nested JSON (the decoder recurses per level: a deep body must not be a 500)."""
    charset = charset or "utf-8"
    try:
        return json.loads(raw.decode(charset))
    except LookupError:  # no codec of that name, or one that is no text encoding (rot13, base64, zlib)
        raise BadRequest(f"unsupported charset {quote(charset)} in Content-Type (send UTF-8 JSON)") from None
    except ValueError as exc:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise BadRequest(f"body is not valid JSON: {exc}") from None
    except RecursionError:
        raise BadRequest("body is not valid JSON: nested too deeply") from None


def parse_generation(body, tier: str | None, defaults: RequestDefaults) -> tuple[JobRequest, bool]:
    """Validate a generation request body; returns (request, async?) or raises BadRequest. `tier`:
    the tier the request runs in (render/accounts/ decides it), None: the body's own."""
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    unknown = set(body) - TURBONODE_FIELDS - IGNORED_OPENAI_FIELDS
    if unknown:
        raise BadRequest(f"unknown field(s): {', '.join(sorted(unknown))}", sorted(unknown)[0])
    prompt = body.get("prompt")
    if not isinstance(prompt, str) or not prompt.strip():
        raise BadRequest("'prompt' is required and must be a non-empty string", "prompt")
    if len(prompt) > MAX_PROMPT_CHARS:
        raise BadRequest(f"'prompt' is longer than {MAX_PROMPT_CHARS} characters", "prompt")
    negative = body.get("negative_prompt") or ""
    if not isinstance(negative, str) or len(negative) > MAX_PROMPT_CHARS:
        raise BadRequest(
            f"'negative_prompt' must be a string of at most {MAX_PROMPT_CHARS} characters", "negative_prompt"
        )
    _text("prompt", prompt)
    _text("negative_prompt", negative)
    fmt = body.get("response_format") or "b64_json"
    if fmt != "b64_json":
        raise BadRequest(
            f"'response_format' {quote(fmt)} is not supported; this worker answers b64_json only", "response_format"
        )
    if body.get("stream"):
        raise BadRequest("'stream' is not supported", "stream")
    tier = tier or body.get("tier") or DEFAULT_TIER
    if tier not in TIER_NAMES:
        raise BadRequest(f"'tier': unknown tier {quote(tier)} (expected one of {', '.join(TIER_NAMES)})", "tier")
    width, height = _size(body.get("size"), defaults)
    guidance = body.get("guidance", defaults.guidance[tier])
    if guidance is None:
        guidance = defaults.guidance[tier]
    if isinstance(guidance, bool) or not isinstance(guidance, (int, float)) or not 0 <= guidance <= MAX_GUIDANCE:
        raise BadRequest(f"'guidance' must be a number between 0 and {MAX_GUIDANCE}, got {quote(guidance)}", "guidance")
    run_async = body.get("async", False)
    if not isinstance(run_async, bool):
        raise BadRequest("'async' must be true or false", "async")
    request = JobRequest(
        prompt=prompt,
        negative_prompt=negative,
        tier=tier,
        n=_int(body, "n", 1, 1, MAX_IMAGES),
        steps=_int(body, "steps", defaults.steps[tier], 1, MAX_STEPS),
        seed=_int(body, "seed", _SEEDS.randrange(SEED_DRAWN), 0, 2**63 - 1),
        guidance=float(guidance),
        width=width,
        height=height,
    )
    return request, run_async


def mark_socket(sock, tier: str) -> bool:
    """Set the socket's DSCP (IP_TOS, and IPV6_TCLASS on IPv6) to the tier's; False if not possible."""
    if sock is None:
        return False
    tos = tos_byte(tier)
    try:
        if sock.family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_TCLASS, tos)
            try:  # an IPv4-mapped peer on a dual-stack socket uses the IPv4 header
                sock.setsockopt(socket.IPPROTO_IP, socket.IP_TOS, tos)
            except OSError:
                pass
        elif sock.family == socket.AF_INET:
            sock.setsockopt(socket.IPPROTO_IP, socket.IP_TOS, tos)
        else:
            return False
    except OSError as exc:
        log.debug("cannot set DSCP for tier %s: %s", tier, exc)
        return False
    return True


# Linux's autotuning ceiling (the default net.ipv4.tcp_wmem max), so a fixed buffer never holds
# less than autotuning would; the kernel caps it at net.core.wmem_max (docs/worker.md).
SEND_BUFFER_BYTES = 4 << 20


def listening_socket(host: str, port: int, tier: str) -> socket.socket:
    """A bound, listening TCP socket carrying `tier`'s DSCP ('' leaves it unmarked). The kernel sends
    a SYN-ACK with the listener's TOS and an accepted socket inherits it, so a connection's
    handshake and first packets (the ACKs of the request) leave in that tier's class before any
    request has named its own; each request then re-marks its socket (mark_socket).

    Its send buffer (SEND_BUFFER_BYTES) lets a whole response into the kernel in one write: the
    event loop need not come back to feed the socket while the link drains it, and each time it
    comes back is a wait for the GIL when the front is busy."""
    family, kind, proto, _, addr = socket.getaddrinfo(
        host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)  # accepted sockets inherit it
        if tier:
            mark_socket(sock, tier)
        sock.bind(addr)
        sock.listen(socket.SOMAXCONN)
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock


def _mark(request: web.Request, tier: str) -> None:
    if request.transport is not None:
        mark_socket(request.transport.get_extra_info("socket"), tier)


class AnsweredByEngine(web.StreamResponse):
    """A sync answer the engine process wrote on the connection itself (render/engine/answer.py):
    nothing is left to send, and the connection closes (the engine said `Connection: close`).
    Its status and headers are what the engine sent, for the access log and the metrics."""

    def __init__(self, headers: Mapping[str, str]):
        super().__init__(status=200, headers=headers)
        self.force_close()

    async def prepare(self, request):  # type: ignore[override]
        return None

    async def write_eof(self, data: bytes = b"") -> None:
        return None


async def _png(sample) -> str:
    """A sample's base64 PNG: as the engine process encoded it (render/front/remote_engine.py: no
    suspension, so the answer goes out in the same turn of the loop), or encoded here from its
    pixels (an engine in this process, as the tests run it), off the event loop."""
    png = getattr(sample, "png", None)
    if png is not None:
        return png
    return await asyncio.get_running_loop().run_in_executor(None, encode_png, sample.image)


async def _pngs(job) -> list[str]:
    """A done job's images as base64 PNGs, in order (_png)."""
    return [await _png(s) for s in job.samples]


async def _off_loop(fn: Callable[..., Any], *args: Any) -> Any:
    """Run `fn` in a thread: it asks the engine process and waits for the answer, which would
    hold every request on the event loop (a turbo answer among them) for that round trip."""
    return await asyncio.get_running_loop().run_in_executor(None, fn, *args)


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def unauthorized(exc: AuthError) -> web.Response:
    """401 in OpenAI's shape (its clients raise AuthenticationError on it), with RFC 6750's challenge."""
    code = None if exc.reason == "missing" else "invalid_api_key"
    return web.json_response(
        error_body(str(exc), "invalid_request_error", None, code),
        status=401,
        headers={"WWW-Authenticate": 'Bearer realm="turbonode"'},
    )


def peer_address(request: web.Request) -> str | None:
    """The connection's peer, never a forwarded-for header: what worker.trusted_proxies is matched on."""
    peer = request.transport.get_extra_info("peername") if request.transport is not None else None
    return peer[0] if isinstance(peer, tuple) and peer else None


@web.middleware
async def json_errors(request, handler):
    """Answer aiohttp's own 4xx/5xx (404, 405, 413 ...) with an OpenAI-style JSON error body."""
    try:
        return await handler(request)
    except AuthError as exc:
        return unauthorized(exc)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return web.json_response(
            error_body(
                exc.reason or exc.text or "error", "invalid_request_error" if exc.status < 500 else "server_error"
            ),
            status=exc.status,
            headers={k: v for k, v in exc.headers.items() if k.lower() in ("allow", "retry-after")},
        )


class Api:
    """The HTTP routes. `engine` is None while the model loads: the server is up from the start
    (a busy port is reported before loading), answers /livez, /readyz and /metrics, and refuses
    generation with 503 + Retry-After until `attach` hands it the engine."""

    def __init__(
        self,
        engine,
        registry,
        defaults: RequestDefaults | None,
        *,
        model_id: str = "",
        metrics=None,
        slo: Mapping[str, float] | None = None,
        refuse_unready: bool = False,
        accounts: Accounts | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.engine = engine
        # without keys: anyone may ask for any tier, and no tier header is obeyed
        self.accounts = accounts or Accounts(None, None, TrustedProxies(()), metrics)
        self._at_end: set[asyncio.Future] = set()  # what waits for a job's end: charges, late counts
        self.registry = registry  # what /metrics serves
        self.defaults = defaults
        # what the worker serves: the engine's description once loaded, the configured id before
        self.model: dict = engine.describe_model() if engine is not None else {"model": model_id}
        self.created = int(time.time())  # when this worker loaded its model: the model object's `created`
        self.metrics = metrics
        self.slo = dict(slo or {})
        self.refuse_unready = refuse_unready
        self.clock = clock
        self.full_collections: FullCollections | None = None  # the front's, once serving (the daemon's)
        if metrics is not None:
            metrics.watch_readiness(lambda tier: self.readiness(tier).ready, self.slo)

    def attach(self, engine, defaults: RequestDefaults) -> None:
        """The model has loaded: serve it."""
        self.defaults, self.model, self.created = defaults, engine.describe_model(), int(engine.wall())
        self.engine = engine

    def app(self) -> web.Application:
        app = web.Application(middlewares=[json_errors])
        app.on_startup.append(self._start_accounts)
        app.on_cleanup.append(self._close_accounts)
        app.add_routes(
            [
                web.post("/v1/images/generations", self.generate),
                web.get("/v1/jobs/{id}", self.get_job),
                web.delete("/v1/jobs/{id}", self.delete_job),
                web.get("/v1/models", self.list_models),
                web.get("/v1/models/{id:.+}", self.get_model),  # a directory's id has slashes
                web.get("/livez", self.livez),
                web.get("/readyz", self.readyz),
                web.get("/healthz", self.healthz),
                web.get("/metrics", self.metrics_page),
            ]
        )
        return app

    # ---- health -----------------------------------------------------------------------

    def phase(self) -> Phase:
        engine = self.engine
        if engine is None:
            return Phase.LOADING
        if not engine.accepting:
            return Phase.DRAINING
        return Phase.SERVING if engine.alive else Phase.STOPPED

    def readiness(self, tier: str | None = None, request: JobRequest | None = None) -> Readiness:
        """The worker's, or a tier's for a new job of it (`request`; else one with the defaults)."""
        phase = self.phase()
        if phase is not Phase.SERVING or tier is None:
            return readiness(phase)
        engine = self.engine
        lease = engine.throttle.current()
        objective = self.slo.get(tier)
        snap = engine.snapshot() if objective is not None else None  # one call: queue waits and pace
        view = TierView(
            unready_by_agent=lease is not None and tier in lease.unready_tiers,
            shed_by_agent=lease is not None and tier in lease.shed_tiers,
            agent_reason=lease.reason if lease is not None else "",
            lease_left_s=lease.expires_at - engine.clock() if lease is not None else 0.0,
            oldest_wait_s=snap["tiers"][tier]["oldest_wait_s"] if snap else 0.0,
            objective_s=objective,
            prediction=predict(snap, self._new_job(tier, request), REPLAY_OBJECTIVES * objective)
            if snap and objective
            else None,
        )
        return readiness(phase, tier, view)

    def _new_job(self, tier: str, request: JobRequest | None) -> NewJob:
        if request is not None:
            return NewJob(tier, request.steps, request.n, request.height, request.width, request.guidance)
        d = self.defaults
        assert d is not None  # serving: the model has loaded
        return NewJob(tier, d.steps[tier], 1, d.size, d.size, d.guidance[tier])

    def alive(self) -> tuple[bool, str]:
        engine = self.engine
        if engine is None:
            return True, "loading"
        if not engine.alive:
            return False, "the engine thread has stopped"
        stalled = engine.clock() - engine.heartbeat
        if stalled > ENGINE_STALL_S:
            return False, f"the engine loop has not come round for {stalled:.0f} s"
        return True, self.phase().value

    async def livez(self, request: web.Request) -> web.Response:
        """Liveness (restart me if not): the process answers and its engine thread turns."""
        ok, why = await _off_loop(self.alive)
        return web.json_response({"status": "alive" if ok else "dead", "phase": why}, status=200 if ok else 503)

    async def readyz(self, request: web.Request) -> web.Response:
        """Readiness (send me work): loaded and not draining; with ?tier=T, for that tier's new work."""
        tier = request.query.get("tier")
        if tier is not None and tier not in TIER_NAMES:
            raise web.HTTPBadRequest(reason=f"unknown tier {tier!r} (expected one of {', '.join(TIER_NAMES)})")
        r = await _off_loop(self.readiness, tier)
        body = {"status": r.status, "ready": r.ready, "tier": tier}
        if r.reason:
            body["reason"] = r.reason
        return web.json_response(body, status=200 if r.ready else 503, headers=r.retry_after_header())

    async def healthz(self, request: web.Request) -> web.Response:
        """The original health check: 200 while serving, else 503 saying loading, draining or engine stopped."""
        phase = self.phase()
        status = {Phase.SERVING: "ok", Phase.STOPPED: "engine stopped"}.get(phase, phase.value)
        body = {"status": status, "model": self.model["model"]}
        if self.engine is not None:
            body["backend"] = self.engine.backend.describe()
        return web.json_response(body, status=200 if phase is Phase.SERVING else 503)

    def _model_object(self) -> dict:
        """OpenAI's model object, with what turbonode adds (family, pipeline, sizes, per-tier defaults)."""
        if self.engine is None:
            r = self.readiness()
            raise web.HTTPServiceUnavailable(reason=r.reason, headers=r.retry_after_header())
        return {
            "id": self.model["model"],
            "object": "model",
            "created": self.created,
            "owned_by": "turbonode",
            "turbonode": {**self.model, "backend": self.engine.backend.describe()},
        }

    async def list_models(self, request: web.Request) -> web.Response:
        """GET /v1/models: what this worker serves, in OpenAI's list shape (one model per worker)."""
        self.accounts.identify(request.headers, peer_address(request))
        return web.json_response({"object": "list", "data": [self._model_object()]})

    async def get_model(self, request: web.Request) -> web.Response:
        self.accounts.identify(request.headers, peer_address(request))
        if request.match_info["id"] != self.model["model"]:
            raise web.HTTPNotFound(
                reason=f"no model {request.match_info['id']!r}; this worker serves {self.model['model']!r}"
            )
        return web.json_response(self._model_object())

    async def metrics_page(self, request: web.Request) -> web.Response:
        body = await _off_loop(generate_latest, self.registry)  # the engine's collectors ask it
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    # ---- generation -------------------------------------------------------------------

    async def generate(self, request: web.Request) -> web.StreamResponse:
        """One generation request, measured from arrival to its response written, by tier and outcome."""
        start = self.clock()
        tally = Tally()
        try:
            answer = await self._generate(request, tally)
            tally.outcome, tally.code = answer.outcome, answer.response.status
            await answer.response.prepare(request)
            await answer.response.write_eof()
            if answer.outcome == "ok" and self.metrics is not None:
                self.metrics.observe_stage(tally.tier, "respond", self.clock() - answer.job.finished)
            return answer.response
        except (asyncio.CancelledError, ConnectionError):
            tally.outcome, tally.code = "cancelled", CLIENT_CLOSED  # the client went away first
            raise
        finally:
            if tally.holds_collections:
                assert self.full_collections is not None
                self.full_collections.release()
            if self.metrics is not None:
                if tally.outcome == "cancelled" and tally.engine_answers is not None:
                    self._count_at_end(tally.engine_answers, tally.tier, start)
                else:
                    self.metrics.request_answered(tally.tier, tally.outcome, tally.code, self.clock() - start)

    def _count_at_end(self, job, tier: str, start: float) -> None:
        """A request whose connection the engine holds, its handler cancelled because the client
        closed: the client may have closed because it has its answer (the engine wrote it before
        this loop saw the job's end), so it is counted at the end, by what the engine did."""
        metrics = self.metrics
        assert metrics is not None

        def count() -> None:
            if job.answered:
                metrics.request_answered(tier, "ok", 200, job.finished - start)
            else:
                metrics.request_answered(tier, "cancelled", CLIENT_CLOSED, self.clock() - start)

        self._at_job_end(job, count)

    async def _generate(self, request: web.Request, tally: Tally) -> Answer:
        peer = peer_address(request)
        try:
            account = self.accounts.identify(request.headers, peer)
        except AuthError as exc:
            _mark(request, DEFAULT_TIER)
            return Answer("invalid", unauthorized(exc))
        try:
            body = parse_json_body(await request.read(), request.charset)
        except BadRequest as exc:
            return _invalid(request, exc)
        tally.tier = _tier_of(body)
        if self.engine is None or self.defaults is None:
            r = self.readiness()
            return Answer("rejected", _error(r.reason, 503, "tier", "loading", r))
        try:
            body_tier = (body.get("tier") or None) if isinstance(body, dict) else None
            asked = self.accounts.asked(body_tier, request.headers, peer)
            parse_generation(body, asked.start, self.defaults)  # every field checked before the ledger is asked
        except UnknownTier as exc:
            return _invalid(request, BadRequest(str(exc), "tier"))
        except BadRequest as exc:
            return _invalid(request, exc)
        tally.tier = asked.requested
        admission = await self.accounts.admit(account, asked, self.engine.throttle.current())
        g = admission.grant
        if g.tier is None:
            _mark(request, DEFAULT_TIER)
            return Answer("rejected" if g.reason == BUDGET else "invalid", _refused(admission))
        tier = tally.tier = g.tier
        if tier == PROTECTED_TIER and self.full_collections is not None:
            self.full_collections.hold()  # until this handler ends: no full collection meanwhile
            tally.holds_collections = True
        job_request, run_async = parse_generation(body, tier, self.defaults)  # with the tier's own defaults
        job_request = dataclasses.replace(
            job_request,
            account=account.name if account is not None else "",
            requested_tier=g.requested if g.downgraded else "",
            downgraded=g.reason if g.downgraded else "",
        )
        _mark(request, tier)
        if self.refuse_unready:
            r = await _off_loop(self.readiness, tier, job_request)
            if r.status == "not ready":  # a shed tier keeps its 429 from the job table
                message = f"this node is not ready for {tier} work: {r.reason}"
                return Answer("rejected", _error(message, 503, "tier", "not_ready", r))
        # a sync job's answer is written by the engine process on this connection, where it can
        # (render/engine/answer.py): the answer then needs no turn of this process's event loop
        conn = None if run_async else request.transport.get_extra_info("socket") if request.transport else None
        try:
            job = await self.engine.enqueue(job_request, keep_images=run_async, answer_on=conn)
            if conn is not None:
                tally.engine_answers = job
        except Rejected as exc:
            headers = {"Retry-After": str(max(1, math.ceil(exc.retry_after)))} if exc.retry_after is not None else {}
            response = web.json_response(
                error_body(
                    str(exc),
                    "rate_limit_error" if exc.status == 429 else "server_error",
                    "tier",
                    type(exc).__name__.lower(),
                ),
                status=exc.status,
                headers=headers,
            )
            return Answer("rejected", response)
        self._charge_at_end(job, admission)
        said = tier_headers(job_request)
        if run_async:
            response = web.json_response(
                job.describe(self.engine.clock()), status=202, headers={"Location": f"/v1/jobs/{job.id}", **said}
            )
            return Answer("accepted", response, job)
        try:
            await job.ended()
        except asyncio.CancelledError:
            # the client went away (aiohttp cancels the handler): free the job's slot
            asyncio.get_running_loop().run_in_executor(None, self.engine.cancel, job.id)
            raise
        except JobCancelled as exc:
            return Answer("cancelled", _error(str(exc), 409, None, "cancelled", headers=said), job)
        except JobFailed as exc:
            status = 503 if not self.engine.accepting else 500
            return Answer("failed", _error(f"job failed: {exc}", status, None, "job_failed", headers=said), job)
        if job.answered:
            return Answer("ok", AnsweredByEngine(headers=said), job)
        payload = images_answer(job.created, await _pngs(job), job.request.prompt, job.describe(self.engine.clock()))
        job.drop_images()  # delivered: a sync job's pixels are not kept
        return Answer("ok", web.json_response(payload, headers=said), job)

    def _charge_at_end(self, job, admission: Admission) -> None:
        """At the job's end (done, failed or cancelled), its key pays the engine seconds it used."""
        if admission.account is None or not self.accounts.keyed:
            return

        account = admission.account

        def charge() -> None:
            if job.state.terminal:  # else the engine went away first: what it used is unknown
                used = job.describe(self.engine.clock()).get("engine_s", 0.0)
                self.accounts.charge(account, job.tier, used)

        self._at_job_end(job, charge)

    def _at_job_end(self, job, then: Callable[[], None]) -> None:
        """`then()` once the job has ended (done, failed, cancelled, or its engine gone)."""

        async def wait() -> None:
            with contextlib.suppress(JobCancelled, JobFailed):
                await job.ended()
            then()

        task = asyncio.ensure_future(wait())
        self._at_end.add(task)
        task.add_done_callback(self._at_end.discard)

    async def _start_accounts(self, _app: web.Application) -> None:
        self.accounts.start()  # the ledger's writer, on the loop that serves

    async def _close_accounts(self, _app: web.Application) -> None:
        """At stop (after the drain): the charges of jobs that have ended reach the ledger, which
        then writes what it holds (each for a bounded time)."""
        if self._at_end:
            await asyncio.wait(set(self._at_end), timeout=CHARGES_TIMEOUT_S)
        await self.accounts.close()

    # ---- jobs -------------------------------------------------------------------------

    async def _job(self, request: web.Request, lookup: str):
        """The job the path names, by the engine's `lookup` ("get" or "cancel"), or 404; with keys,
        only its own key's caller finds it (anyone else: 404, as for a job that does not exist)."""
        account = self.accounts.identify(request.headers, peer_address(request))
        missing = web.HTTPNotFound(reason=f"no job {request.match_info['id']!r} (unknown or expired)")
        if self.engine is None:
            raise missing
        if lookup == "cancel" and account is not None:  # never cancel another key's job: look first
            found = await _off_loop(self.engine.get, request.match_info["id"])
            if found is None or found.request.account != account.name:
                raise missing
        job = await _off_loop(getattr(self.engine, lookup), request.match_info["id"])
        if job is None or account is not None and job.request.account != account.name:
            raise missing
        _mark(request, job.tier)
        return job

    async def get_job(self, request: web.Request) -> web.Response:
        """The job's state and progress, and its images once done. `?wait=S` holds the answer
        until the job ends or S seconds pass: a client waiting this way gets its images even
        when the worker drains and exits right after the job (as a synchronous request does)."""
        raw = request.query.get("wait")
        wait = None
        if raw is not None:
            try:
                wait = float(raw)
            except ValueError:
                wait = -1.0
            if not 0 <= wait <= MAX_WAIT_S:
                raise web.HTTPBadRequest(reason=f"'wait' must be seconds between 0 and {MAX_WAIT_S:g}, got {raw!r}")
        job = await self._job(request, "get")
        if wait is not None and not job.state.terminal:
            with contextlib.suppress(asyncio.TimeoutError, JobCancelled, JobFailed):
                await asyncio.wait_for(job.ended(), wait)
        out = await _off_loop(job.describe, self.engine.clock())
        if job.state.value == "done" and not job.images_dropped:
            out["data"] = images_data(await _pngs(job), job.request.prompt)
        return web.json_response(out, headers=tier_headers(job.request))

    async def delete_job(self, request: web.Request) -> web.Response:
        job = await self._job(request, "cancel")
        described = await _off_loop(job.describe, self.engine.clock())
        return web.json_response(described, headers=tier_headers(job.request))


@dataclass
class Answer:
    """A generation request's response and its outcome (one of turbonode.metric_names.OUTCOMES)."""

    outcome: str
    response: web.StreamResponse
    job: Any = None


@dataclass
class Tally:
    """How a generation request is counted, filled in as far as it got."""

    tier: str = UNKNOWN_TIER
    outcome: str = "failed"
    code: int = 500
    engine_answers: Any = None  # the job whose connection the engine process holds (it answers it)
    holds_collections: bool = False  # a turbo request: the front's full collections wait for its end


def _tier_of(body) -> str:
    """The request's tier as far as its body says, for counting a refused or bad request."""
    tier = body.get("tier") if isinstance(body, dict) else None
    tier = tier or DEFAULT_TIER
    return tier if tier in TIER_NAMES else UNKNOWN_TIER


def _error(
    message: str, status: int, param: str | None = None, code: str | None = None, r=None, headers=None
) -> web.Response:
    kind = "invalid_request_error" if status < 500 else "server_error"
    headers = {**(r.retry_after_header() if r is not None else {}), **(headers or {})}
    return web.json_response(error_body(message, kind, param, code), status=status, headers=headers)


def _refused(admission: Admission) -> web.Response:
    """No tier for this key: every one it may use at or below the one asked for is spent (429 until
    the period resets; OpenAI's `insufficient_quota`, which its clients do not retry), or it may
    use none of them (403)."""
    g, name = admission.grant, admission.account.name if admission.account else ""
    if g.reason == BUDGET:
        retry = max(1, math.ceil(admission.retry_after_s or 1))
        message = (
            f"key {name!r} has spent its budget of engine time for {g.requested} and every lower tier it may use "
            f"this period; it resets in {retry} s"
        )
        return web.json_response(
            error_body(message, "insufficient_quota", "tier", "insufficient_quota"),
            status=429,
            headers={"Retry-After": str(retry), "x-should-retry": "false"},
        )
    message = f"key {name!r} may not use tier {g.requested} or any tier below it"
    return web.json_response(error_body(message, "invalid_request_error", "tier", "tier_not_allowed"), status=403)


def _invalid(request: web.Request, exc: BadRequest) -> Answer:
    # no valid request, no tier: the answer leaves as default traffic, not in the handshake's class
    _mark(request, DEFAULT_TIER)
    return Answer("invalid", _error(exc.message, exc.status, exc.param))
