"""`turboctl render PROMPT`: images through the worker's HTTP API, written as PNG.

The job is submitted asynchronously; one request waits for its end (GET /v1/jobs/{id}?wait=S)
while short polls show its progress, step n of N, on stderr. A full queue (429) or a node not ready for the tier
(503) is retried after the server's Retry-After, a bounded number of times. `--async` prints
the job id and returns at once; Ctrl-C cancels the job (DELETE /v1/jobs/{id}).
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import sys
import threading
import time
import urllib.error
import urllib.request

import click

from turbonode.config import WorkerConfig, split_host_port
from turbonode.config.loader import CLI_ENV_API_KEY, CLI_ENV_WORKER_URL

from .params import TIER, json_option

DEFAULT_URL = f"http://127.0.0.1:{split_host_port(WorkerConfig().listen)[1]}"
POLL_S = 0.2
MAX_WAIT_S = 600.0  # the worker's limit for GET /v1/jobs/ID?wait= (render/front/http_api.py)
RETRY_CODES = (429, 503)  # queue full or tier shed; loading, draining or not ready for the tier


class WorkerAnswer(Exception):
    """The worker answered with an HTTP error."""

    def __init__(self, code: int, message: str, retry_after: float | None, retry: bool = True):
        super().__init__(
            f"worker answered {code}: {message}" + (f" (retry after {retry_after:g} s)" if retry_after else "")
        )
        self.code, self.retry_after = code, retry_after
        self.retry = retry  # False: the worker says a retry cannot help (x-should-retry: a key's spent budget)


def _call(
    url: str, method: str = "GET", body: dict | None = None, timeout: float = 30.0, key: str | None = None
) -> tuple[int, dict]:
    data = json.dumps(body).encode() if body is not None else None
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(url, data=data, headers=headers, method=method)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        try:
            message = json.loads(exc.read())["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = exc.reason
        retry = exc.headers.get("Retry-After")
        should = exc.headers.get("x-should-retry") != "false"
        raise WorkerAnswer(exc.code, message, float(retry) if retry and retry.isdigit() else None, should) from None
    except (urllib.error.URLError, OSError) as exc:
        raise click.ClickException(f"cannot reach the worker at {url}: {getattr(exc, 'reason', exc)}") from None


def submit(base: str, body: dict, retries: int, deadline: float, say, key: str | None = None) -> dict:
    """POST the job; on 429/503 wait the server's Retry-After and try again, at most `retries` times
    (not a key's spent budget: it lasts until the period resets)."""
    for attempt in range(retries + 1):
        try:
            return _call(base + "/v1/images/generations", "POST", body, key=key)[1]
        except WorkerAnswer as exc:
            wait = exc.retry_after or 1.0
            if exc.code not in RETRY_CODES or not exc.retry or attempt == retries or time.monotonic() + wait > deadline:
                raise click.ClickException(str(exc)) from None
            say(f"{exc}; retrying in {wait:g} s ({attempt + 1} of {retries})")
            time.sleep(wait)
    raise AssertionError("unreachable")


def progress_line(job: dict) -> str:
    if job["state"] == "queued":
        return f"{job['id']} ({job['tier']}): queued {job.get('age_s', 0):.1f} s"
    if job["state"] == "running":
        return f"{job['id']} ({job['tier']}): step {job.get('step', 0)} of {job['steps']}"
    return f"{job['id']} ({job['tier']}): {job['state']}"


def wait_for_job(base: str, job: dict, deadline: float, say, key: str | None = None) -> dict:
    """The job's end, with its images. One request waits for it the whole time (GET
    /v1/jobs/ID?wait=S), so a worker that drains and exits right after the job still answers
    it; meanwhile short polls of the same job show its progress through `say`."""
    path = f"{base}/v1/jobs/{job['id']}"
    result: dict = {}

    def wait() -> None:
        try:
            while not result:
                left = deadline - time.monotonic()
                if left <= 0:
                    result["timeout"] = True
                    return
                wait_s = min(left, MAX_WAIT_S)
                answer = _call(f"{path}?wait={wait_s:.1f}", timeout=wait_s + 30, key=key)[1]
                if answer["state"] in ("done", "failed", "cancelled"):
                    result["job"] = answer
        except (WorkerAnswer, click.ClickException) as exc:
            result["error"] = str(exc.message if isinstance(exc, click.ClickException) else exc)

    waiter = threading.Thread(target=wait, name="render-wait", daemon=True)
    waiter.start()
    shown = None
    try:
        while waiter.is_alive():
            line = progress_line(job)
            if line != shown:
                say(line)
                shown = line
            waiter.join(POLL_S)
            with contextlib.suppress(WorkerAnswer, click.ClickException):  # progress only: the waiter decides
                job = _call(path, key=key)[1]
    except KeyboardInterrupt:
        with contextlib.suppress(WorkerAnswer, click.ClickException):
            _call(path, "DELETE", key=key)
        raise click.ClickException(f"interrupted; {job['id']} cancelled") from None
    if "error" in result:
        raise click.ClickException(result["error"])
    if "timeout" in result:
        with contextlib.suppress(WorkerAnswer, click.ClickException):
            _call(path, "DELETE", key=key)
        raise click.ClickException(f"{job['id']}: not done in time; cancelled")
    job = result["job"]
    if job["state"] != "done":
        raise click.ClickException(f"{job['id']} {job['state']}: {job.get('error', '')}")
    if "data" not in job:
        raise click.ClickException(f"{job['id']} is done but its images are no longer held ({job.get('images')})")
    return job


@click.command("render")
@click.argument("prompt")
@click.option("--tier", type=TIER, help="job tier (default: the worker's, 'other')")
@click.option(
    "--out",
    type=click.Path(dir_okay=False, writable=True),
    default="render.png",
    show_default=True,
    help="PNG to write (with -n > 1: name-1.png, name-2.png ...)",
)
@click.option("--url", default=DEFAULT_URL, show_default=True, envvar=CLI_ENV_WORKER_URL, help="worker API")
@click.option("--size", help="WIDTHxHEIGHT, e.g. 512x512 (default: the worker's worker.size)")
@click.option("--steps", type=click.IntRange(min=1), help="denoising steps (default: the tier's, worker.steps)")
@click.option(
    "--seed", type=click.IntRange(min=0), help="noise seed: the same seed gives the same image (default: random)"
)
@click.option(
    "--guidance",
    type=click.FloatRange(min=0),
    help="classifier-free guidance scale (default: the tier's, worker.guidance)",
)
@click.option("-n", "n", type=click.IntRange(1, 10), default=1, show_default=True, help="images")
@click.option("--timeout", type=float, default=600.0, show_default=True, help="seconds to wait, retries included")
@click.option(
    "--retries",
    type=click.IntRange(min=0),
    default=3,
    show_default=True,
    help="times to retry a 429/503 after the server's Retry-After",
)
@click.option("--async", "run_async", is_flag=True, help="submit, print the job id and return (poll GET /v1/jobs/ID)")
@click.option("--api-key", envvar=CLI_ENV_API_KEY, help=f"the worker's API key, if it has keys (or ${CLI_ENV_API_KEY})")
@json_option
def command(prompt, tier, out, url, size, steps, seed, guidance, n, timeout, retries, run_async, api_key, as_json):
    """Render PROMPT on a worker and write the PNG; shows step n of N while it renders."""
    body = {"prompt": prompt, "n": n, "response_format": "b64_json", "async": True}
    for key, value in (("tier", tier), ("size", size), ("steps", steps), ("seed", seed), ("guidance", guidance)):
        if value is not None:
            body[key] = value
    base = url.rstrip("/")
    deadline = time.monotonic() + timeout
    tty = sys.stderr.isatty()

    def say(line: str) -> None:
        click.echo(("\r\033[K" + line) if tty else line, err=True, nl=not tty)

    job = submit(base, body, retries, deadline, say, api_key)
    if run_async:
        click.echo(json.dumps(job) if as_json else job["id"])
        return
    job = wait_for_job(base, job, deadline, say, api_key)
    if tty:
        click.echo("", err=True)
    stem, ext = os.path.splitext(out)
    paths = [out] if n == 1 else [f"{stem}-{i + 1}{ext or '.png'}" for i in range(n)]
    for path, item in zip(paths, job["data"]):
        with open(path, "wb") as f:
            f.write(base64.b64decode(item["b64_json"]))
    meta = {k: v for k, v in job.items() if k != "data"} | {"files": paths}
    if as_json:
        click.echo(json.dumps(meta))
    else:
        tier_said = meta.get("tier")
        if meta.get("downgraded"):  # the worker ran it in a lower tier than asked: say which and why
            tier_said = f"{tier_said}, not {meta.get('requested_tier')}: {meta['downgraded']}"
        click.echo(
            f"wrote {', '.join(paths)} ({tier_said}, {meta.get('steps')} steps, seed {meta.get('seed')}, "
            f"{meta.get('elapsed_s', 0):.2f} s)"
        )
