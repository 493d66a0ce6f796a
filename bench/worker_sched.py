"""Benchmark the worker's step-level scheduler against the alternatives, side by side, per model family.

One run, the embedded tiny variants (SD 1.x `tiny`, `tiny-sdxl`, `tiny-flux` by default), 256 px,
CPU or GPU; for each family:

1. Throughput at saturation (relax jobs; classifier-free guidance where the family uses it):
   the engine against sequential calls of the family's own diffusers pipeline
   (StableDiffusion/StableDiffusionXL/Flux) on the same components and the same sampler,
   and against the raw batched denoiser+VAE compute at the engine's batch size.
2. Turbo latency (p50/p99, n probes) while a flood of >= 32 relax jobs is queued, against
   idle turbo latency plus one max-batch relax step (the target). Turbo probes arrive
   open-loop (fixed seeded schedule); the relax backlog is refilled as jobs finish.

For the first family (`--compare-policies`, SD 1.x by default) the flood also runs under
the two whole-job policies of the same engine, for the figures the worker has always
reported: whole-job FIFO (webui-style queue) and whole-job priority without preemption.

Latencies are measured in-process from submit to the job's completion (the HTTP layer
adds the same constant to every contender). Run it under the shared benchmark lock:

    flock /tmp/turbonode-bench.lock .venv/bin/python bench/worker_sched.py
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import sys
import threading
import time
from pathlib import Path

# Run from a checkout: this tree's packages win over an installed copy.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from render.cpu_threads import available_cpus, default_threads, wait_policy_default  # noqa: E402

WAIT_POLICY = wait_policy_default()  # as the worker daemon does, before torch (OpenMP) loads

import diffusers  # noqa: E402
import psutil  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

from render.batching import BatchPolicy  # noqa: E402
from render.engine.backends.onnx_export import example_inputs  # noqa: E402
from render.engine.backends.select import make_backend  # noqa: E402
from render.engine.encode_prompt import PromptEncoder  # noqa: E402
from render.engine.model import load_model  # noqa: E402
from render.engine.scheduler import Engine, EngineSettings  # noqa: E402
from render.gc_telemetry import GcMonitor, freeze_after_load  # noqa: E402
from render.jobs import JobRequest  # noqa: E402
from turbonode.stats import percentile  # noqa: E402

PROMPTS = [f"a watercolor of a lighthouse, variation {i}" for i in range(6)]
POLICIES = (BatchPolicy.STEP_PRIORITY, BatchPolicy.JOB_PRIORITY, BatchPolicy.JOB_FIFO)


class FamilyBench:
    """The contenders for one model: its pipeline, its raw denoiser+VAE, the engine."""

    def __init__(self, args, model: str):
        self.args = args
        self.family = load_model(model)
        self.backend = make_backend("torch", self.family, args.device)
        self.backend.prepare(args.size, args.size)  # as the worker does at start (its traced graphs)
        self.encoders: list[PromptEncoder] = []
        self.closers: list = []
        d = self.family.defaults
        # relax as the family renders it: its sampler and guidance (CFG on SD/SDXL; Flux-schnell: none)
        self.relax_sampler, self.relax_guidance = d.sampler["relax"], d.guidance["relax"]

    def describe(self) -> str:
        f, a = self.family, self.args
        cfg = f"cfg {self.relax_guidance}" if f.cfg_for(self.relax_guidance) else "no cfg"
        return (
            f"{f.model_id} ({f.pipeline_class}): relax {a.relax_steps} steps {self.relax_sampler} {cfg}, "
            f"turbo {a.turbo_steps} steps {f.defaults.sampler['turbo']} no cfg"
        )

    def engine(self, policy: BatchPolicy) -> Engine:
        a = self.args
        encoder = PromptEncoder(self.family, self.backend.device, self.backend.dtype)
        self.encoders.append(encoder)
        settings = EngineSettings(
            max_batch=a.max_batch,
            policy=policy,
            min_share=a.min_share,
            queue_limit={"turbo": 1000, "fast": 1000, "other": 1000, "relax": 100000},
        )
        return Engine(self.backend, encoder, self.family, settings)

    def relax(self, i: int) -> JobRequest:
        a = self.args
        return JobRequest(
            prompt=PROMPTS[i % len(PROMPTS)],
            tier="relax",
            steps=a.relax_steps,
            seed=i,
            guidance=self.relax_guidance,
            width=a.size,
            height=a.size,
        )

    def turbo(self, i: int) -> JobRequest:
        a = self.args
        return JobRequest(
            prompt=f"turbo probe {i % 3}",
            tier="turbo",
            steps=a.turbo_steps,
            seed=10_000 + i,
            guidance=0.0,
            width=a.size,
            height=a.size,
        )

    # ---- throughput ---------------------------------------------------------------------

    def pipeline_sequential(self):
        """A measurement of one diffusers pipeline call per image, same components and sampler."""
        f, a = self.family, self.args
        pipe = f.pipeline(f.make_scheduler(self.relax_sampler, a.relax_steps, a.size, a.size))
        pipe.to(self.backend.device)

        def run(n):
            for i in range(n):
                pipe(
                    PROMPTS[i % len(PROMPTS)],
                    height=a.size,
                    width=a.size,
                    num_inference_steps=a.relax_steps,
                    guidance_scale=self.relax_guidance,
                    generator=torch.Generator().manual_seed(i),
                    output_type="np",
                    **f.pipeline_call_kwargs(),
                )

        return run

    def engine_throughput(self):
        """A measurement of the engine thread rendering n relax jobs submitted at once."""
        engine = self.engine(BatchPolicy.STEP_PRIORITY).start()
        self.closers.append(engine.stop)

        def run(n):
            jobs = [engine.submit(self.relax(i)) for i in range(n)]
            for j in jobs:
                j.future.result(600)

        return run

    def raw_batched(self):
        """A measurement of the bare denoiser (its rows, CFG included) + VAE at the engine's batch size."""
        a, b, f = self.args, self.backend, self.family
        rows = a.max_batch * (2 if f.cfg_for(self.relax_guidance) else 1)
        inputs = dict(zip(f.input_names, example_inputs(f, rows, a.size, a.size, b.device, b.dtype), strict=True))
        latents = torch.randn(a.max_batch, f.latent_channels, *f.latent_size(a.size, a.size)).to(b.device)

        @torch.inference_mode()
        def run(n):
            for _ in range(max(1, n // a.max_batch)):
                for _ in range(a.relax_steps):
                    b.predict(inputs)
                b.decode(latents)

        return run

    def throughput(self) -> dict[str, float]:
        """Images/s of each contender: interleaved rounds, best round each (other load only slows)."""
        a = self.args
        runs = {"pipeline": self.pipeline_sequential(), "raw": self.raw_batched(), "engine": self.engine_throughput()}
        best = dict.fromkeys(runs, 0.0)
        for run in runs.values():
            run(a.max_batch)  # warm-up
        for _ in range(a.rounds):
            for name, run in runs.items():
                t0 = time.perf_counter()
                run(a.images)
                best[name] = max(best[name], a.images / (time.perf_counter() - t0))
        for close in self.closers:
            close()
        return best

    # ---- latency ------------------------------------------------------------------------

    def turbo_idle(self) -> list[float]:
        engine = self.engine(BatchPolicy.STEP_PRIORITY).start()
        try:
            engine.submit(self.turbo(0)).future.result(60)  # warm-up
            out = []
            for i in range(self.args.probes):
                t0 = time.perf_counter()
                engine.submit(self.turbo(i)).future.result(60)
                out.append(time.perf_counter() - t0)
                time.sleep(0.02)
            return out
        finally:
            engine.stop()

    def turbo_under_flood(self, policy: BatchPolicy, probes: int) -> dict:
        a = self.args
        engine = self.engine(policy)
        lock = threading.Lock()
        counter = iter(range(10**9))
        refill = threading.Event()
        refill.set()
        relax_jobs = []

        def submit_relax():
            job = engine.submit(self.relax(next(counter)))
            with lock:
                relax_jobs.append(job)
            job.future.add_done_callback(lambda _: refill.is_set() and submit_relax())

        def relax_progress():
            """Relax work done so far, in images (denoising steps and decode, pro rata)."""
            with lock:
                return sum(j.progress * j.request.n for j in relax_jobs)

        full_steps = []  # durations of full relax batches: the "one max-batch step" of the target

        def on_event(e):
            if e["kind"] == "step" and len(e["samples"]) == a.max_batch and all(s[1] == "relax" for s in e["samples"]):
                full_steps.append(e["seconds"])

        engine.on_event = on_event

        for _ in range(a.flood + a.max_batch):
            submit_relax()
        engine.start()
        rng = random.Random(7)
        latencies: list[float] = []
        waiting = []
        try:
            time.sleep(0.5)  # let the flood start denoising
            queued = engine.snapshot()["tiers"]["relax"]["queued"]
            t_start, progress_start = time.perf_counter(), relax_progress()
            for i in range(probes):
                t0 = time.perf_counter()
                job = engine.submit(self.turbo(i))
                job.future.add_done_callback(lambda f, t0=t0: latencies.append(time.perf_counter() - t0))
                waiting.append(job)
                time.sleep(a.probe_interval * rng.uniform(0.5, 1.5))
            for job in waiting:
                job.future.result(600)
            window = time.perf_counter() - t_start
            relax_rate = (relax_progress() - progress_start) / window
        finally:
            refill.clear()
            engine.close_intake()
            engine.fail_all("benchmark over")
            engine.stop()
        return {
            "latencies": latencies,
            "relax_queued_at_start": queued,
            "relax_images_per_s": relax_rate,
            "full_batch_step_s": percentile(full_steps, 50),
        }


def summarize(values):
    return {"p50": percentile(values, 50), "p99": percentile(values, 99), "n": len(values)}


def run_family(bench: FamilyBench, policies: tuple[BatchPolicy, ...]) -> dict:
    a = bench.args
    tp = bench.throughput()
    idle = summarize(bench.turbo_idle())
    floods = {
        p: bench.turbo_under_flood(p, a.probes if p is BatchPolicy.STEP_PRIORITY else a.policy_probes) for p in policies
    }
    step_s = floods[BatchPolicy.STEP_PRIORITY]["full_batch_step_s"] or 0.0
    flood = {
        p.value: {
            **summarize(r["latencies"]),
            "relax_images_per_s": r["relax_images_per_s"],
            "relax_queued_at_start": r["relax_queued_at_start"],
        }
        for p, r in floods.items()
    }
    target = idle["p99"] + step_s
    return {
        "family": bench.family.name,
        "throughput_images_per_s": {
            "pipeline_sequential": tp["pipeline"],
            "raw_batched": tp["raw"],
            "engine": tp["engine"],
        },
        "engine_over_pipeline": tp["engine"] / tp["pipeline"],
        "engine_of_raw": tp["engine"] / tp["raw"],
        "turbo_idle": idle,
        "turbo_under_flood": flood,
        "max_batch_step_s": step_s,
        "turbo_target_s": target,
        "turbo_target_met": flood[BatchPolicy.STEP_PRIORITY.value]["p99"] <= target,
    }


def report(results: dict[str, dict], a) -> None:
    names = list(results)
    w = max(14, *(len(n) + 2 for n in names))

    def row(label, cells):
        print(f"{label:<44}" + "".join(f"{c:>{w}}" for c in cells))

    print(f"\n== throughput at saturation (images/s, best of {a.rounds} interleaved rounds of {a.images}) ==")
    row("", names)
    tps = [results[n]["throughput_images_per_s"] for n in names]
    row("sequential diffusers pipeline (same components)", [f"{t['pipeline_sequential']:.2f}" for t in tps])
    row(f"raw batched denoiser+VAE (batch {a.max_batch})", [f"{t['raw_batched']:.2f}" for t in tps])
    row("worker engine (step priority)", [f"{t['engine']:.2f}" for t in tps])
    row("  engine / pipeline (target >= 1.5x)", [f"{results[n]['engine_over_pipeline']:.2f}x" for n in names])
    row("  engine / raw (target >= 90 %)", [f"{100 * results[n]['engine_of_raw']:.1f}%" for n in names])

    print(f"\n== turbo latency (s), open-loop probes ~{a.probe_interval:g} s apart, relax flood >= {a.flood} queued ==")
    row("", names)
    row("idle p50 / p99", [f"{r['turbo_idle']['p50']:.3f}/{r['turbo_idle']['p99']:.3f}" for r in results.values()])
    step = BatchPolicy.STEP_PRIORITY.value
    row(
        "under the flood, step priority: p50 / p99",
        [
            f"{r['turbo_under_flood'][step]['p50']:.3f}/{r['turbo_under_flood'][step]['p99']:.3f}"
            for r in results.values()
        ],
    )
    row("  n (idle / flood)", [f"{r['turbo_idle']['n']}/{r['turbo_under_flood'][step]['n']}" for r in results.values()])
    row(
        "  relax img/s meanwhile",
        [f"{r['turbo_under_flood'][step]['relax_images_per_s']:.2f}" for r in results.values()],
    )
    row("one max-batch relax step (median)", [f"{r['max_batch_step_s']:.3f}" for r in results.values()])
    row(
        "target: p99 <= idle p99 + one step",
        [f"{r['turbo_target_s']:.3f} {'met' if r['turbo_target_met'] else 'NOT'}" for r in results.values()],
    )
    for name, r in results.items():
        others = {p: v for p, v in r["turbo_under_flood"].items() if p != step}
        if others:
            print(f"\n{name}, the same flood under whole-job policies (n {a.policy_probes} probes each):")
            print(f"{'policy':<34} {'p50':>7} {'p99':>7} {'relax img/s':>12} {'relax queued':>13}")
            for p, v in r["turbo_under_flood"].items():
                print(
                    f"{p:<34} {v['p50']:7.3f} {v['p99']:7.3f} {v['relax_images_per_s']:12.2f} "
                    f"{v['relax_queued_at_start']:13d}"
                )


def verdicts(results: dict[str, dict]) -> list[dict]:
    """Per target, each family's figure and whether every family met it."""
    targets = (
        (
            "engine >= 1.5x the pipeline",
            lambda r: f"{r['engine_over_pipeline']:.2f}x",
            lambda r: r["engine_over_pipeline"] >= 1.5,
        ),
        ("engine >= 90 % of raw compute", lambda r: f"{r['engine_of_raw']:.1%}", lambda r: r["engine_of_raw"] >= 0.9),
        (
            "turbo p99 under a relax flood <= idle p99 + one max-batch step",
            lambda r: (
                f"{r['turbo_under_flood'][BatchPolicy.STEP_PRIORITY.value]['p99'] * 1000:.0f} ms vs "
                f"{r['turbo_target_s'] * 1000:.0f}"
            ),
            lambda r: r["turbo_target_met"],
        ),
    )
    return [
        {
            "target": target,
            "value": ", ".join(f"{name} {value(r)}" for name, r in results.items()),
            "met": all(ok(r) for r in results.values()),
        }
        for target, value, ok in targets
    ]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="tiny,tiny-sdxl,tiny-flux", help="comma-separated: a tiny name or a directory")
    p.add_argument("--compare-policies", default="tiny", help="the model whose flood also runs the whole-job policies")
    p.add_argument("--size", type=int, default=256)
    p.add_argument("--max-batch", type=int, default=4)
    p.add_argument("--relax-steps", type=int, default=10)
    p.add_argument("--turbo-steps", type=int, default=4)
    p.add_argument("--images", type=int, default=8, help="images per throughput measurement")
    p.add_argument("--rounds", type=int, default=2, help="interleaved throughput rounds (best is kept)")
    p.add_argument("--flood", type=int, default=32, help="relax jobs kept queued during the latency runs")
    p.add_argument("--probes", type=int, default=100, help="turbo jobs per latency measurement (p99 needs >= 100)")
    p.add_argument("--policy-probes", type=int, default=24, help="turbo jobs per whole-job policy run")
    p.add_argument("--probe-interval", type=float, default=1.0, help="mean seconds between turbo arrivals")
    p.add_argument("--min-share", type=float, default=0.1)
    p.add_argument("--device", default="cpu")
    p.add_argument(
        "--threads", type=int, default=default_threads(available_cpus()), help="torch threads (default: the worker's)"
    )
    p.add_argument("--json", dest="json_out", help="also write the figures to this JSON file")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    # the pipelines' notices (e.g. a prompt longer than the tiny T5's 32 tokens is truncated, as in the engine)
    # would bury the table
    diffusers.utils.logging.set_verbosity_error()
    transformers.utils.logging.set_verbosity_error()
    t_begin = time.perf_counter()
    benches = {name: FamilyBench(a, name) for name in a.models.split(",")}
    freeze_after_load()  # as the daemon does: the models' objects leave the GC's reach
    gc = GcMonitor().install()
    print(
        f"{a.size}px, max batch {a.max_batch} images (x2 rows with CFG), {a.threads} torch threads "
        f"(OMP_WAIT_POLICY={WAIT_POLICY}), "
        f"device {next(iter(benches.values())).backend.device}"
    )
    for b in benches.values():
        print("  " + b.describe())
    results = {}
    for name, bench in benches.items():
        policies = POLICIES if name == a.compare_policies else (BatchPolicy.STEP_PRIORITY,)
        started = time.perf_counter()
        results[name] = run_family(bench, policies)
        print(f"({name}: {time.perf_counter() - started:.0f} s)", flush=True)
    report(results, a)

    encoders = [e for b in benches.values() for e in b.encoders]
    hits, misses = sum(e.hits for e in encoders), sum(e.misses for e in encoders)
    rss = psutil.Process().memory_info().rss
    gc_max = max((p["pause_s"] for p in gc.pauses), default=0.0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(
        f"\nRSS {rss / 2**20:.0f} MiB (peak {peak / 2**20:.0f} MiB); text-cache hit rate "
        f"{100 * hits / max(1, hits + misses):.1f}% ({hits} hits, {misses} misses); "
        f"GC {gc.collections_total} collections, longest pause {gc_max * 1000:.1f} ms; "
        f"wall {time.perf_counter() - t_begin:.0f} s"
    )
    if a.json_out:
        Path(a.json_out).write_text(
            json.dumps(
                {
                    "args": vars(a),
                    "families": results,
                    "rss_bytes": rss,
                    "peak_rss_bytes": peak,
                    "text_cache": {"hits": hits, "misses": misses},
                    "gc": {"collections": gc.collections_total, "longest_pause_s": gc_max},
                },
                indent=2,
            )
        )
    from bench.record import flat, judged, record, variant_of

    found = verdicts(results)
    record(
        "worker_sched",
        # the threads default is the machine's: 1 on the 2-core VM, where the runs are compared
        variant=", ".join(
            x for x in (variant_of(p, a, ("threads",)), "" if a.threads == 1 else f"threads {a.threads}") if x
        ),
        n=a.probes,
        n_per="turbo probes per family, idle and under the flood",
        headline="; ".join(f"{v['target']}: {v['value']}" for v in found),
        figures=flat(results),
        **judged(found),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
