"""Everything the code offers an operator is documented: every turboctl command's every
option (README.md or docs/*.md, in a paragraph that names the command), every HTTP route of
the worker, every control-socket method and parameter (docs/worker.md)."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import click

from render.front.control_server import ControlHandlers
from render.front.http_api import Api
from turboctl import main

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def paragraphs() -> list[str]:
    return [p for path in DOCS for p in re.split(r"\n\s*\n", path.read_text())]


def commands(group: click.Group = main, prefix: str = "") -> list[tuple[str, click.Command]]:
    out = []
    for name, cmd in sorted(group.commands.items()):
        path = f"{prefix}{name}"
        out.append((path, cmd))
        if isinstance(cmd, click.Group):
            out += commands(cmd, path + " ")
    return out


def option_names(cmd: click.Command) -> list[str]:
    names = []
    for param in cmd.params:
        if isinstance(param, click.Option) and not param.hidden and "--help" not in param.opts:
            longs = [o for o in param.opts if o.startswith("--")]
            names.append(longs[0] if longs else param.opts[0])
    return names


def undocumented_options(texts: list[str]) -> list[str]:
    missing = []
    for path, cmd in [("", main), *commands()]:
        here = [t for t in texts if re.search(rf"turboctl {re.escape(path)}\b" if path else r"turboctl\b", t)]
        for opt in option_names(cmd):
            if not any(re.search(rf"(?<![\w-]){re.escape(opt)}(?![\w-])", t) for t in here):
                missing.append(f"turboctl {path} {opt}".replace("  ", " "))
    return missing


def test_every_option_of_every_command_is_documented():
    assert undocumented_options(paragraphs()) == []
    # the check can fail: a paragraph without the flags leaves them undocumented
    assert "turboctl render --retries" in undocumented_options(["`turboctl render PROMPT`"])


def test_every_worker_route_and_control_method_is_documented():
    worker_md = (ROOT / "docs/worker.md").read_text()
    routes = {r.resource.canonical for r in Api(None, None, None, model_id="tiny").app().router.routes()}
    assert {"/livez", "/readyz", "/healthz", "/metrics", "/v1/jobs/{id}"} <= routes
    assert [r for r in sorted(routes) if f"`{r}" not in worker_md and f" {r}`" not in worker_md] == []
    assert "/readyz?tier=" in worker_md
    handlers = ControlHandlers.__new__(ControlHandlers)
    for method, fn in ControlHandlers.table(handlers).items():
        assert f"`{method}" in worker_md, method
        for name in inspect.signature(fn).parameters:
            assert name in worker_md, f"{method}({name})"
