"""Stage 1, encode prompt: each new job's conditioning, through a bounded LRU cache keyed by
model and prompt (diffusers' `encode_prompt`).

Image nodes see the same prompts again and again (retries, n>1, templated prompts); the text
encoders then run once per distinct prompt. What is cached is every encoder's output for the
prompt, pooled ones too (render/engine/families: a `Conditioning`), so an entry serves any family's
denoiser whole. The key includes the model fingerprint so a model swap can never serve stale
embeddings. With classifier-free guidance (where the family uses it) a job also carries its
negative prompt's conditioning.
"""

from __future__ import annotations

import collections
import threading

import torch

from .families.base import Conditioning, Family
from .job import Job


class PromptEncoder:
    def __init__(self, family: Family, device: torch.device, dtype: torch.dtype, capacity: int = 256):
        self.family = family
        for encoder in family.text_encoders:
            encoder.to(device)
        self.fingerprint = family.fingerprint
        self.device, self.dtype = torch.device(device), dtype
        self.capacity = capacity
        self._cache: collections.OrderedDict[tuple[str, str], Conditioning] = collections.OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    @property
    def hit_ratio(self) -> float | None:
        total = self.hits + self.misses
        return self.hits / total if total else None

    def __len__(self) -> int:
        return len(self._cache)

    def _lookup(self, prompt: str) -> Conditioning | None:
        key = (self.fingerprint, prompt)
        with self._lock:
            cond = self._cache.get(key)
            if cond is None:
                self.misses += 1
            else:
                self.hits += 1
                self._cache.move_to_end(key)
            return cond

    def _store(self, prompt: str, cond: Conditioning) -> None:
        with self._lock:
            self._cache[(self.fingerprint, prompt)] = cond
            self._cache.move_to_end((self.fingerprint, prompt))
            while len(self._cache) > self.capacity:
                self._cache.popitem(last=False)

    def encode(self, prompts: list[str]) -> list[Conditioning]:
        """One Conditioning per prompt; misses are encoded together in one call per encoder."""
        found: dict[str, Conditioning | None] = {}
        for p in prompts:
            if p in found:  # a repeat within this call is served by the same lookup or encode
                with self._lock:
                    self.hits += 1
            else:
                found[p] = self._lookup(p)
        missing = [p for p, cond in found.items() if cond is None]
        if missing:
            for p, cond in zip(missing, self.family.encode_prompts(missing), strict=True):
                cond = {name: t.to(self.device, self.dtype) for name, t in cond.items()}
                found[p] = cond
                self._store(p, cond)
        return [found[p] for p in prompts]  # type: ignore[misc]

    def encode_jobs(self, jobs: list[Job]) -> None:
        """Set every job's `cond` (and `uncond` with CFG): one encoder call for all prompts not cached.
        Raises what the encoder raised; the caller fails these jobs."""
        cfg = [self.family.cfg_for(job.request.guidance) for job in jobs]
        prompts = []
        for job, with_cfg in zip(jobs, cfg, strict=True):
            prompts += [job.request.negative_prompt, job.request.prompt] if with_cfg else [job.request.prompt]
        conds = iter(self.encode(prompts))
        for job, with_cfg in zip(jobs, cfg, strict=True):
            job.uncond = next(conds) if with_cfg else None
            job.cond = next(conds)
