"""TensorRT backend: profile logic and backend selection everywhere; engines on a GPU only.

The GPU tests build real engines from the tiny model and compare them with the torch
backend; without an NVIDIA GPU and the tensorrt package they skip and say which is missing.
"""

from __future__ import annotations

import logging
import sys
import types

import pytest
import torch

from render.backends.select import make_backend
from render.backends.tensorrt import (
    TensorRTOptions,
    latent_profile,
    tensorrt_unavailable_reason,
    unet_profile,
    vae_profile,
)
from render.backends.torch_backend import TorchBackend
from render.model import load_components
from turbonode.config import BACKEND_NAMES, WorkerConfig
from turbonode.errors import BackendUnavailable, TurbonodeError

TRT_SKIP = tensorrt_unavailable_reason()


def needs_tensorrt(test):
    skip = pytest.mark.skipif(TRT_SKIP is not None, reason=f"needs an NVIDIA GPU and TensorRT: {TRT_SKIP}")
    return pytest.mark.gpu(skip(test))


@pytest.fixture(scope="module")
def components():
    return load_components("tiny")


# ---- profiles (pure) --------------------------------------------------------------------


def test_profile_spans_all_configured_sizes_with_first_as_opt(tmp_path):
    opts = TensorRTOptions(cache_dir=tmp_path, max_batch=8, sizes=((512, 512), (768, 512), (512, 384)))
    assert latent_profile(opts, 8) == ((64, 48), (64, 64), (96, 64))
    prof = unet_profile(opts, in_channels=4, text_len=77, embed_dim=768, scale=8)
    assert prof["sample"] == ((1, 4, 64, 48), (8, 4, 64, 64), (8, 4, 96, 64))
    assert prof["timestep"] == ((1,), (8,), (8,))
    assert prof["encoder_hidden_states"] == ((1, 77, 768), (8, 77, 768), (8, 77, 768))
    assert vae_profile(opts, latent_channels=4, scale=8) == {"latents": prof["sample"]}


def test_profile_rejects_sizes_the_vae_cannot_produce(tmp_path):
    with pytest.raises(ValueError, match="multiple of the VAE scale 8"):
        latent_profile(TensorRTOptions(cache_dir=tmp_path, sizes=((500, 512),)), 8)


@pytest.mark.parametrize("bad", [{"max_batch": 0}, {"sizes": ()}, {"precision": "int3"}])
def test_options_reject_bad_values(tmp_path, bad):
    with pytest.raises(ValueError):
        TensorRTOptions(cache_dir=tmp_path, **bad)


def test_options_from_worker_config():
    cfg = WorkerConfig(max_batch=6, size=768, engine_cache_dir="/tmp/engines")
    opts = TensorRTOptions.from_config(cfg)
    assert (opts.max_batch, opts.sizes, str(opts.cache_dir), opts.precision) == (
        6,
        ((768, 768),),
        "/tmp/engines",
        "fp16",
    )


# ---- availability and selection (this machine has no GPU; the GPU side is simulated) ------


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
def test_unavailable_reason_without_gpu():
    assert tensorrt_unavailable_reason() == "torch sees no CUDA GPU"


@pytest.fixture
def gpu_claimed(monkeypatch):
    """Pretend torch sees a GPU, to reach the package checks that follow it."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    return monkeypatch


def test_unavailable_reason_names_missing_package(gpu_claimed):
    gpu_claimed.setitem(sys.modules, "tensorrt", None)  # import raises ImportError
    reason = tensorrt_unavailable_reason()
    assert "tensorrt package is not importable" in reason and "turbonode[tensorrt]" in reason


def test_unavailable_reason_names_old_version(gpu_claimed):
    gpu_claimed.setitem(sys.modules, "tensorrt", types.SimpleNamespace(__version__="8.6.1"))
    assert tensorrt_unavailable_reason() == "tensorrt 8.6.1 is too old (need 10.x or newer)"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
def test_tensorrt_without_gpu_is_a_clear_error(components):
    with pytest.raises(BackendUnavailable, match="tensorrt backend unavailable: torch sees no CUDA GPU"):
        make_backend("tensorrt", components, "auto")
    assert issubclass(BackendUnavailable, TurbonodeError)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
def test_auto_without_gpu_falls_back_to_torch_and_says_why(components, caplog):
    with caplog.at_level(logging.WARNING, logger="render.backends.select"):
        backend = make_backend("auto", components, "auto")
    assert isinstance(backend, TorchBackend) and backend.device.type == "cpu"
    assert any("backend auto: using torch on cpu" in r.message and "no CUDA GPU" in r.message for r in caplog.records)


def test_auto_with_tensorrt_but_a_cpu_device_falls_back(components, gpu_claimed, caplog):
    gpu_claimed.setitem(sys.modules, "tensorrt", types.SimpleNamespace(__version__="11.4.0.106"))
    with caplog.at_level(logging.WARNING, logger="render.backends.select"):
        backend = make_backend("auto", components, "cpu")
    assert isinstance(backend, TorchBackend)
    assert any("device cpu is not a CUDA GPU" in r.message for r in caplog.records)
    with pytest.raises(BackendUnavailable, match="device cpu is not a CUDA GPU"):
        make_backend("tensorrt", components, "cpu")


def test_engine_build_failure_is_clear_and_auto_falls_back(components, monkeypatch, caplog):
    import render.backends.tensorrt as trt_backend

    def broken(*args, **kwargs):
        raise RuntimeError("CUDA error: out of memory during ONNX export")

    monkeypatch.setattr(trt_backend, "TensorRTBackend", broken)
    with pytest.raises(BackendUnavailable, match="failed to start: RuntimeError: CUDA error: out of memory"):
        make_backend("tensorrt", components, "cpu")
    with caplog.at_level(logging.WARNING, logger="render.backends.select"):
        assert isinstance(make_backend("auto", components, "cpu"), TorchBackend)
    assert any("out of memory during ONNX export" in r.message for r in caplog.records)


def test_unknown_backend_is_named(components):
    with pytest.raises(BackendUnavailable, match="unknown backend 'onnx'"):
        make_backend("onnx", components, "cpu")
    assert BACKEND_NAMES == ("auto", "torch", "tensorrt")


# ---- real engines (GPU) ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    from render.backends.tensorrt import TensorRTBackend

    comps = load_components("tiny")
    opts = TensorRTOptions(cache_dir=tmp_path_factory.mktemp("engines"), max_batch=4, sizes=((256, 256), (192, 320)))
    trt_backend = TensorRTBackend(comps, torch.device("cuda"), opts)
    return comps, opts, trt_backend, TorchBackend(comps, torch.device("cuda"))


def _inputs(batch, hw, embed_dim, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    latents = torch.randn(batch, 4, *hw, generator=gen, device="cuda", dtype=torch.float16)
    timesteps = torch.tensor([999, 1, 500, 250, 750, 20][:batch], device="cuda")
    ehs = torch.randn(batch, 77, embed_dim, generator=gen, device="cuda", dtype=torch.float16)
    return latents, timesteps, ehs


@needs_tensorrt
@pytest.mark.parametrize("batch,hw", [(1, (32, 32)), (4, (32, 32)), (3, (24, 40)), (6, (32, 32))])
def test_gpu_unet_engine_matches_torch(engines, batch, hw):
    comps, _, trt_backend, torch_backend = engines
    latents, timesteps, ehs = _inputs(batch, hw, comps.unet.config.cross_attention_dim, seed=batch)
    got = trt_backend.predict_noise(latents, timesteps, ehs)
    want = torch_backend.predict_noise(latents, timesteps, ehs)
    assert got.device.type == "cuda" and got.shape == want.shape
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


@needs_tensorrt
def test_gpu_vae_engine_matches_torch(engines):
    _, _, trt_backend, torch_backend = engines
    latents, _, _ = _inputs(2, (32, 32), 32, seed=9)
    got, want = trt_backend.decode(latents), torch_backend.decode(latents)
    assert got.shape == (2, 3, 256, 256)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


@needs_tensorrt
def test_gpu_size_outside_profile_is_a_clear_error(engines):
    comps, _, trt_backend, _ = engines
    latents, timesteps, ehs = _inputs(1, (64, 64), comps.unet.config.cross_attention_dim)
    with pytest.raises(BackendUnavailable, match="outside what this node's TensorRT engines were built for"):
        trt_backend.predict_noise(latents, timesteps, ehs)


@needs_tensorrt
def test_gpu_second_start_loads_from_cache_and_corrupt_engine_is_rebuilt(engines, caplog):
    from render.backends.tensorrt import TensorRTBackend

    comps, opts, first, _ = engines
    with caplog.at_level(logging.INFO, logger="render.backends.engine_cache"):
        TensorRTBackend(comps, torch.device("cuda"), opts)
    assert sum("engine cache hit" in r.message for r in caplog.records) == 2
    caplog.clear()
    unet_engine = opts.cache_dir / first.engines.key("unet", comps.fingerprint).filename()
    unet_engine.write_bytes(b"\0" * 64)
    with caplog.at_level(logging.INFO, logger="render.backends.engine_cache"):
        again = TensorRTBackend(comps, torch.device("cuda"), opts)
    assert any("rebuilding" in r.message for r in caplog.records)
    assert unet_engine.stat().st_size > 64 and again.describe()["name"] == "tensorrt"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
def test_cli_worker_run_backend_tensorrt_without_gpu_is_a_click_error(tmp_path):
    from click.testing import CliRunner

    from turboctl import main

    result = CliRunner().invoke(
        main,
        [
            "worker",
            "run",
            "--backend",
            "tensorrt",
            "--model",
            "tiny",
            "--listen",
            "127.0.0.1:0",
            "--control",
            str(tmp_path / "w.sock"),
        ],
    )
    assert result.exit_code == 1, result.output
    assert "Error: tensorrt backend unavailable: torch sees no CUDA GPU" in result.output
    assert "Traceback" not in result.output


# ---- engine-build glue, with TensorRT faked (it cannot exist without a GPU) ---------------


class FakeTRT:
    """Just the TensorRT surface build_serialized_engine touches, recording what it is told."""

    NetworkDefinitionCreationFlag = types.SimpleNamespace(STRONGLY_TYPED=5)

    class IProgressMonitor:
        def __init__(self):
            pass

    def __init__(self, parses=True, plan=b"PLAN"):
        self.parses, self.plan, self.seen = parses, plan, {}
        fake = self

        class Builder:
            def __init__(self, logger):
                pass

            def create_network(self, flags):
                fake.seen["flags"] = flags
                return "network"

            def create_builder_config(self):
                config = types.SimpleNamespace()
                config.add_optimization_profile = lambda prof: fake.seen.setdefault("profiles", []).append(prof)
                return config

            def create_optimization_profile(self):
                shapes = fake.seen.setdefault("shapes", {})
                return types.SimpleNamespace(set_shape=lambda name, lo, opt, hi: shapes.update({name: (lo, opt, hi)}))

            def build_serialized_network(self, network, config):
                fake.seen["config"] = config
                mon = config.progress_monitor
                mon.phase_start("Building engine", None, 8)
                mon.phase_start("Timing conv_17", "Building engine", 300)
                for step in range(8):
                    assert mon.step_complete("Building engine", step) is True
                mon.phase_finish("Timing conv_17")
                mon.phase_finish("Building engine")
                return fake.plan

        class OnnxParser:
            num_errors = 0 if parses else 2

            def __init__(self, network, logger):
                pass

            def parse_from_file(self, path):
                return fake.parses

            def get_error(self, i):
                return f"node {i}: unsupported operator"

        self.Builder, self.OnnxParser = Builder, OnnxParser


def test_build_uses_a_strongly_typed_network_and_the_profile(tmp_path, caplog):
    from render.backends.tensorrt import build_serialized_engine

    fake = FakeTRT()
    opts = TensorRTOptions(cache_dir=tmp_path, max_batch=8, optimization_level=2)
    profile = unet_profile(opts, in_channels=4, text_len=77, embed_dim=768, scale=8)
    with caplog.at_level(logging.INFO, logger="render.backends.tensorrt"):
        assert build_serialized_engine(fake, tmp_path / "unet.onnx", profile, opts, None) == b"PLAN"
    assert fake.seen["flags"] == 1 << 5
    assert fake.seen["shapes"] == profile and len(fake.seen["profiles"]) == 1
    assert fake.seen["config"].builder_optimization_level == 2
    messages = [r.getMessage() for r in caplog.records]
    assert "tensorrt build: Building engine (8 steps)" in messages
    assert "tensorrt build: Building engine 4/8" in messages and "tensorrt build: Building engine 8/8" in messages
    assert any(m.startswith("tensorrt build: Building engine done in") for m in messages)
    assert not any("conv_17" in m for m in messages)  # nested phases stay out of the log


def test_build_reports_parser_errors_and_empty_plans(tmp_path):
    from render.backends.tensorrt import build_serialized_engine

    opts = TensorRTOptions(cache_dir=tmp_path)
    with pytest.raises(BackendUnavailable, match="cannot parse unet.onnx: node 0: unsupported operator; node 1"):
        build_serialized_engine(FakeTRT(parses=False), tmp_path / "unet.onnx", {}, opts, None)
    assert build_serialized_engine(FakeTRT(plan=None), tmp_path / "unet.onnx", {}, opts, None) == b""


def test_sizes_outside_the_engines_are_a_400_before_queueing(tmp_path):
    """The TensorRT backend's size limits reach the HTTP API's validation (no failed job, no 5xx)."""
    from render.backends.tensorrt import TensorRTBackend
    from render.http_api import BadRequest, RequestDefaults, parse_generation

    opts = TensorRTOptions(cache_dir=tmp_path, sizes=((512, 512), (512, 768)))  # (height, width)
    backend = types.SimpleNamespace(options=opts, scale=8)  # what unsupported_size reads; no GPU needed
    check = TensorRTBackend.unsupported_size.__get__(backend)
    assert check(512, 512) is None and check(512, 640) is None and check(512, 768) is None
    assert check(768, 512) == (
        "512x768 is outside what this node's TensorRT engines were built for (512x512 to 768x512; worker.size sets it)"
    )
    defaults = RequestDefaults(512, 8, {"turbo": 4}, {"turbo": 0.0}, size_check=check)
    request, _ = parse_generation({"prompt": "a cat", "size": "768x512", "tier": "turbo"}, None, defaults)
    assert (request.width, request.height) == (768, 512)
    with pytest.raises(BadRequest) as err:
        parse_generation({"prompt": "a cat", "size": "512x1024", "tier": "turbo"}, None, defaults)
    assert err.value.status == 400 and err.value.param == "size" and "TensorRT engines" in err.value.message
