"""Benchmark the worker's step-level scheduler against the alternatives, side by side.

One run, the embedded tiny model, 256 px, CPU or GPU:

1. Throughput at saturation (relax jobs, classifier-free guidance): the engine against
   sequential StableDiffusionPipeline calls on the same components and the same sampler,
   and against the raw batched UNet+VAE compute at the engine's batch size.
2. Turbo latency (p50/p99) while a flood of >= 32 relax jobs is queued, against idle turbo
   latency, for three policies of the same engine: step-level priority (the worker's),
   whole-job FIFO (webui-style queue) and whole-job priority without preemption.
   Turbo probes arrive open-loop (fixed seeded schedule); the relax backlog is refilled as
   jobs finish so it stays >= the flood size.

Latencies are measured in-process from submit to the job's completion (the HTTP layer
adds the same constant to every policy). Run it under the shared benchmark lock:

    flock /tmp/turbonode-bench.lock .venv/bin/python bench/worker_sched.py
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import sys
import threading
import time
from pathlib import Path

# Run from a checkout: this tree's packages win over an installed copy.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import psutil  # noqa: E402
import torch  # noqa: E402

from render.backends.select import make_backend  # noqa: E402
from render.batching import BatchPolicy  # noqa: E402
from render.encode_prompt import PromptEncoder  # noqa: E402
from render.engine import Engine, EngineSettings  # noqa: E402
from render.gc_telemetry import GcMonitor, freeze_after_load  # noqa: E402
from render.jobs import JobRequest  # noqa: E402
from render.model import load_components  # noqa: E402
from turbonode.stats import percentile  # noqa: E402

PROMPTS = [f"a watercolor of a lighthouse, variation {i}" for i in range(6)]
RELAX_GUIDANCE = 7.5


class Bench:
    def __init__(self, args):
        self.args = args
        self.components = load_components("tiny")
        self.backend = make_backend("torch", self.components, args.device)
        freeze_after_load()  # as the daemon does: the model's objects leave the GC's reach
        self.gc = GcMonitor().install()
        self.encoders: list[PromptEncoder] = []
        self.closers: list = []

    def engine(self, policy: BatchPolicy) -> Engine:
        a = self.args
        encoder = PromptEncoder(self.components, self.backend.device, self.backend.dtype)
        self.encoders.append(encoder)
        settings = EngineSettings(
            max_batch=a.max_batch,
            policy=policy,
            min_share=a.min_share,
            queue_limit={"turbo": 1000, "fast": 1000, "other": 1000, "relax": 100000},
        )
        return Engine(self.backend, encoder, self.components, settings)

    def relax(self, i: int) -> JobRequest:
        a = self.args
        return JobRequest(
            prompt=PROMPTS[i % len(PROMPTS)],
            tier="relax",
            steps=a.relax_steps,
            seed=i,
            guidance=RELAX_GUIDANCE,
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
        """A measurement of one StableDiffusionPipeline call per image, same components and sampler."""
        from diffusers import DPMSolverMultistepScheduler, StableDiffusionPipeline

        c, a = self.components, self.args
        pipe = StableDiffusionPipeline(
            vae=c.vae,
            text_encoder=c.text_encoder,
            tokenizer=c.tokenizer,
            unet=c.unet,
            scheduler=DPMSolverMultistepScheduler.from_config(c.scheduler_config),
            safety_checker=None,
            feature_extractor=None,
            requires_safety_checker=False,
        )
        pipe.set_progress_bar_config(disable=True)
        pipe.to(self.backend.device)

        def run(n):
            for i in range(n):
                pipe(
                    PROMPTS[i % len(PROMPTS)],
                    height=a.size,
                    width=a.size,
                    num_inference_steps=a.relax_steps,
                    guidance_scale=RELAX_GUIDANCE,
                    generator=torch.Generator().manual_seed(i),
                    output_type="np",
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
        """A measurement of the bare UNet (CFG rows) + VAE at the engine's batch size, nothing else."""
        a, b = self.args, self.backend
        rows = 2 * a.max_batch
        lat = a.size // self.components.vae_scale_factor
        x = torch.randn(rows, 4, lat, lat, generator=torch.Generator().manual_seed(0)).to(b.device)
        emb = torch.randn(
            rows, self.components.tokenizer.model_max_length, self.components.unet.config.cross_attention_dim
        ).to(b.device)
        ts = torch.linspace(999, 0, a.relax_steps)

        @torch.inference_mode()
        def run(n):
            for _ in range(max(1, n // a.max_batch)):
                for t in ts:
                    b.predict_noise(x, torch.full((rows,), float(t)), emb)
                b.decode(x[: a.max_batch])

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

    def turbo_under_flood(self, policy: BatchPolicy) -> dict:
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
            for i in range(a.probes):
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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", type=int, default=256)
    p.add_argument("--max-batch", type=int, default=4)
    p.add_argument("--relax-steps", type=int, default=10)
    p.add_argument("--turbo-steps", type=int, default=4)
    p.add_argument("--images", type=int, default=8, help="images per throughput measurement")
    p.add_argument("--rounds", type=int, default=2, help="interleaved throughput rounds (best is kept)")
    p.add_argument("--flood", type=int, default=32, help="relax jobs kept queued during the latency runs")
    p.add_argument("--probes", type=int, default=24, help="turbo jobs per latency measurement")
    p.add_argument("--probe-interval", type=float, default=1.0, help="mean seconds between turbo arrivals")
    p.add_argument("--min-share", type=float, default=0.1)
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--json", dest="json_out", help="also write the figures to this JSON file")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    t_begin = time.perf_counter()
    bench = Bench(a)
    print(
        f"tiny model, {a.size}px, max batch {a.max_batch} images (x2 rows with CFG), relax {a.relax_steps} "
        f"steps dpmpp_2m cfg {RELAX_GUIDANCE}, turbo {a.turbo_steps} steps euler_a no cfg, "
        f"{a.threads} torch threads, device {bench.backend.device}"
    )

    tp = bench.throughput()
    seq, raw, eng = tp["pipeline"], tp["raw"], tp["engine"]
    print(f"\n== throughput at saturation (images/s, best of {a.rounds} interleaved rounds of {a.images}) ==")
    print(f"{'sequential StableDiffusionPipeline':<38} {seq:8.2f}")
    print(f"{'raw batched UNet+VAE (batch ' + str(a.max_batch) + ')':<38} {raw:8.2f}")
    print(
        f"{'worker engine (step priority)':<38} {eng:8.2f}   {eng / seq:5.2f}x pipeline   "
        f"{100 * eng / raw:5.1f}% of raw"
    )

    idle = bench.turbo_idle()
    runs = {
        policy: bench.turbo_under_flood(policy)
        for policy in (BatchPolicy.STEP_PRIORITY, BatchPolicy.JOB_PRIORITY, BatchPolicy.JOB_FIFO)
    }
    idle_s = summarize(idle)
    step_s = runs[BatchPolicy.STEP_PRIORITY]["full_batch_step_s"]
    print(f"\n== turbo latency, {a.probes} open-loop probes, relax flood >= {a.flood} queued (seconds) ==")
    print(
        f"{'policy':<34} {'p50':>7} {'p99':>7} {'relax img/s':>12} {'relax queued':>13}"
        "   (relax img/s: work done meanwhile)"
    )
    print(f"{'idle (no load)':<34} {idle_s['p50']:7.3f} {idle_s['p99']:7.3f}")
    figures = {}
    for policy, run in runs.items():
        s = summarize(run["latencies"])
        figures[policy.value] = {
            **s,
            "relax_images_per_s": run["relax_images_per_s"],
            "relax_queued_at_start": run["relax_queued_at_start"],
        }
        print(
            f"{policy.value:<34} {s['p50']:7.3f} {s['p99']:7.3f} {run['relax_images_per_s']:12.2f} "
            f"{run['relax_queued_at_start']:13d}"
        )
    target = idle_s["p99"] + (step_s or 0)
    got = figures[BatchPolicy.STEP_PRIORITY.value]["p99"]
    print(
        f"target: step-priority p99 <= idle p99 + one max-batch step (median) = {idle_s['p99']:.3f} "
        f"+ {step_s or 0:.3f} = {target:.3f} s -> {got:.3f} s ({'met' if got <= target else 'NOT met'})"
    )

    hits = sum(e.hits for e in bench.encoders)
    misses = sum(e.misses for e in bench.encoders)
    rss = psutil.Process().memory_info().rss
    gc_max = max((p["pause_s"] for p in bench.gc.pauses), default=0.0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(
        f"\nRSS {rss / 2**20:.0f} MiB (peak {peak / 2**20:.0f} MiB); text-cache hit rate "
        f"{100 * hits / max(1, hits + misses):.1f}% ({hits} hits, {misses} misses); "
        f"GC {bench.gc.collections_total} collections, longest pause {gc_max * 1000:.1f} ms; "
        f"wall {time.perf_counter() - t_begin:.0f} s"
    )
    if a.json_out:
        Path(a.json_out).write_text(
            json.dumps(
                {
                    "args": vars(a),
                    "throughput_images_per_s": {"pipeline_sequential": seq, "raw_batched": raw, "engine": eng},
                    "turbo_idle": idle_s,
                    "turbo_under_flood": figures,
                    "max_batch_step_s": step_s,
                    "rss_bytes": rss,
                    "peak_rss_bytes": peak,
                    "text_cache": {"hits": hits, "misses": misses},
                    "gc": {"collections": bench.gc.collections_total, "longest_pause_s": gc_max},
                },
                indent=2,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
