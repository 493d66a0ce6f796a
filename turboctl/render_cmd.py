"""`turboctl render PROMPT`: one image through the worker's HTTP API, written as PNG."""

from __future__ import annotations

import base64
import json
import os
import urllib.error
import urllib.request

import click

from turbonode.config import CLI_ENV_WORKER_URL, WorkerConfig, split_host_port

from .params import TIER, json_option

DEFAULT_URL = f"http://127.0.0.1:{split_host_port(WorkerConfig().listen)[1]}"


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
@click.option("--size", help="WIDTHxHEIGHT")
@click.option("--steps", type=click.IntRange(min=1))
@click.option("--seed", type=click.IntRange(min=0))
@click.option("--guidance", type=click.FloatRange(min=0))
@click.option("-n", "n", type=click.IntRange(1, 10), default=1, show_default=True, help="images")
@click.option("--timeout", type=float, default=600.0, show_default=True, help="seconds to wait")
@json_option
def command(prompt, tier, out, url, size, steps, seed, guidance, n, timeout, as_json):
    """Render PROMPT on a worker and write the PNG."""
    body = {"prompt": prompt, "n": n, "response_format": "b64_json"}
    for key, value in (("tier", tier), ("size", size), ("steps", steps), ("seed", seed), ("guidance", guidance)):
        if value is not None:
            body[key] = value
    req = urllib.request.Request(
        url.rstrip("/") + "/v1/images/generations",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            answer = json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        try:
            message = json.loads(exc.read())["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = exc.reason
        retry = exc.headers.get("Retry-After")
        raise click.ClickException(
            f"worker answered {exc.code}: {message}" + (f" (retry after {retry} s)" if retry else "")
        ) from None
    except (urllib.error.URLError, OSError) as exc:
        raise click.ClickException(f"cannot reach the worker at {url}: {getattr(exc, 'reason', exc)}") from None
    stem, ext = os.path.splitext(out)
    paths = [out] if n == 1 else [f"{stem}-{i + 1}{ext or '.png'}" for i in range(n)]
    for path, item in zip(paths, answer["data"]):
        with open(path, "wb") as f:
            f.write(base64.b64decode(item["b64_json"]))
    meta = {**answer.get("turbonode", {}), "files": paths}
    if as_json:
        click.echo(json.dumps(meta))
    else:
        click.echo(
            f"wrote {', '.join(paths)} ({meta.get('tier')}, {meta.get('steps')} steps, seed {meta.get('seed')}, "
            f"{meta.get('elapsed_s', 0):.2f} s)"
        )
