"""Stage 1, encode prompt: each new job's text embeddings, through a bounded LRU cache keyed by
model and prompt (diffusers' `encode_prompt`).

Image nodes see the same prompts again and again (retries, n>1, templated prompts); the
CLIP encoder then runs once per distinct prompt. The key includes the model fingerprint so
a model swap can never serve stale embeddings. With classifier-free guidance a job carries
two rows, (negative prompt, prompt); without, one.
"""

from __future__ import annotations

import collections
import threading

import torch

from .jobs import Job


class PromptEncoder:
    def __init__(self, components, device: torch.device, dtype: torch.dtype, capacity: int = 256):
        self.tokenizer = components.tokenizer
        self.text_encoder = components.text_encoder.to(device)
        self.fingerprint = components.fingerprint
        self.device, self.dtype = torch.device(device), dtype
        self.capacity = capacity
        self._cache: collections.OrderedDict = collections.OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    @property
    def hit_ratio(self) -> float | None:
        total = self.hits + self.misses
        return self.hits / total if total else None

    def __len__(self) -> int:
        return len(self._cache)

    def _lookup(self, prompt: str):
        key = (self.fingerprint, prompt)
        with self._lock:
            emb = self._cache.get(key)
            if emb is None:
                self.misses += 1
            else:
                self.hits += 1
                self._cache.move_to_end(key)
            return emb

    def _store(self, prompt: str, emb: torch.Tensor) -> None:
        with self._lock:
            self._cache[(self.fingerprint, prompt)] = emb
            self._cache.move_to_end((self.fingerprint, prompt))
            while len(self._cache) > self.capacity:
                self._cache.popitem(last=False)

    @torch.inference_mode()
    def _encode(self, prompts: list[str]) -> torch.Tensor:
        ids = self.tokenizer(
            prompts,
            padding="max_length",
            max_length=self.tokenizer.model_max_length,
            truncation=True,
            return_tensors="pt",
        ).input_ids
        out = self.text_encoder(ids.to(self.device), return_dict=False)[0]
        return out.to(self.dtype)

    def encode(self, prompts: list[str]) -> list[torch.Tensor]:
        """One embedding [L, D] per prompt; misses are encoded together in one call."""
        found: dict = {}
        for p in prompts:
            if p in found:  # a repeat within this call is served by the same lookup or encode
                with self._lock:
                    self.hits += 1
            else:
                found[p] = self._lookup(p)
        missing = [p for p, emb in found.items() if emb is None]
        if missing:
            for p, emb in zip(missing, self._encode(missing)):
                found[p] = emb
                self._store(p, emb)
        return [found[p] for p in prompts]

    def encode_jobs(self, jobs: list[Job]) -> None:
        """Set every job's `embeddings` [rows, L, D]: one encoder call for all prompts not cached.
        Raises what the encoder raised; the caller fails these jobs."""
        prompts = []
        for job in jobs:
            if job.request.cfg:
                prompts.append(job.request.negative_prompt)
            prompts.append(job.request.prompt)
        embs = iter(self.encode(prompts))
        for job in jobs:
            job.embeddings = torch.stack([next(embs) for _ in range(2 if job.request.cfg else 1)])
