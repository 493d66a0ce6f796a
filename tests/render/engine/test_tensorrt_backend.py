"""TensorRT backend: profile logic and backend selection everywhere; engines on a GPU only.

The GPU tests build real engines from the tiny variant of every family and compare them with
the torch backend; without an NVIDIA GPU and the tensorrt package they skip and say which is
missing.
"""

from __future__ import annotations

import logging
import sys
import types

import pytest
import torch

from render.engine.backends.select import make_backend
from render.engine.backends.tensorrt import (
    TensorRTOptions,
    decoder_profile,
    denoiser_profile,
    size_profile,
    tensorrt_unavailable_reason,
)
from render.engine.backends.torch_backend import TorchBackend
from tests.render.helpers import family, guidance_for, start
from turbonode.config import BACKEND_NAMES, WorkerConfig
from turbonode.errors import BackendUnavailable, TurbonodeError

TRT_SKIP = tensorrt_unavailable_reason()


def needs_tensorrt(test):
    skip = pytest.mark.skipif(TRT_SKIP is not None, reason=f"needs an NVIDIA GPU and TensorRT: {TRT_SKIP}")
    return pytest.mark.gpu(skip(test))


@pytest.fixture(scope="module")
def components():
    return family("tiny")


# ---- profiles (pure) --------------------------------------------------------------------


def test_profile_spans_all_configured_sizes_with_first_as_opt(tmp_path):
    opts = TensorRTOptions(cache_dir=tmp_path, max_batch=8, sizes=((512, 512), (768, 512), (512, 384)))
    assert size_profile(opts, 16) == ((512, 384), (512, 512), (768, 512))
    prof = denoiser_profile(opts, family("tiny"))
    assert prof["sample"] == ((1, 4, 64, 48), (8, 4, 64, 64), (8, 4, 96, 64))
    assert prof["timestep"] == ((1,), (8,), (8,))
    assert prof["encoder_hidden_states"] == ((1, 77, 32), (8, 77, 32), (8, 77, 32))
    assert decoder_profile(opts, family("tiny")) == {"latents": prof["sample"]}


def test_profiles_carry_each_familys_inputs(tmp_path):
    opts = TensorRTOptions(cache_dir=tmp_path, max_batch=4, sizes=((256, 256), (512, 256)))
    sdxl = denoiser_profile(opts, family("tiny-sdxl"))
    assert sdxl["text_embeds"] == ((1, 32), (4, 32), (4, 32)) and sdxl["time_ids"] == ((1, 6), (4, 6), (4, 6))
    flux = denoiser_profile(opts, family("tiny-flux"))
    # 2x2-packed tokens grow with the image; the ids have no batch axis
    assert flux["sample"] == ((1, 256, 64), (4, 256, 64), (4, 512, 64))
    assert flux["img_ids"] == ((256, 3), (256, 3), (512, 3)) and flux["txt_ids"] == ((32, 3),) * 3
    assert decoder_profile(opts, family("tiny-flux"))["latents"] == ((1, 16, 32, 32), (4, 16, 32, 32), (4, 16, 64, 32))
    assert set(denoiser_profile(opts, family("tiny-sd3"))) == set(family("tiny-sd3").input_names)


def test_profile_rejects_sizes_the_model_cannot_render(tmp_path):
    with pytest.raises(ValueError, match="not a multiple of 16"):
        size_profile(TensorRTOptions(cache_dir=tmp_path, sizes=((504, 512),)), 16)


@pytest.mark.parametrize("bad", [{"max_batch": 0}, {"sizes": ()}, {"precision": "int3"}])
def test_options_reject_bad_values(tmp_path, bad):
    with pytest.raises(ValueError):
        TensorRTOptions(cache_dir=tmp_path, **bad)


def test_options_from_worker_config():
    cfg = WorkerConfig(max_batch=6, size=768, engine_cache_dir="/tmp/engines")
    opts = TensorRTOptions.from_config(cfg, native_size=1024)
    # precision None: the family's half precision (fp16; bf16 for SD3 and Flux)
    assert (opts.max_batch, opts.sizes, str(opts.cache_dir), opts.precision) == (6, ((768, 768),), "/tmp/engines", None)
    assert TensorRTOptions.from_config(WorkerConfig(), native_size=1024).sizes == ((1024, 1024),)  # size 0: native


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
    with caplog.at_level(logging.WARNING, logger="render.engine.backends.select"):
        backend = make_backend("auto", components, "auto")
    assert isinstance(backend, TorchBackend) and backend.device.type == "cpu"
    assert any("backend auto: using torch on cpu" in r.message and "no CUDA GPU" in r.message for r in caplog.records)


def test_auto_with_tensorrt_but_a_cpu_device_falls_back(components, gpu_claimed, caplog):
    gpu_claimed.setitem(sys.modules, "tensorrt", types.SimpleNamespace(__version__="11.4.0.106"))
    with caplog.at_level(logging.WARNING, logger="render.engine.backends.select"):
        backend = make_backend("auto", components, "cpu")
    assert isinstance(backend, TorchBackend)
    assert any("device cpu is not a CUDA GPU" in r.message for r in caplog.records)
    with pytest.raises(BackendUnavailable, match="device cpu is not a CUDA GPU"):
        make_backend("tensorrt", components, "cpu")


def test_engine_build_failure_is_clear_and_auto_falls_back(components, monkeypatch, caplog):
    import render.engine.backends.tensorrt as trt_backend

    def broken(*args, **kwargs):
        raise RuntimeError("CUDA error: out of memory during ONNX export")

    monkeypatch.setattr(trt_backend, "TensorRTBackend", broken)
    with pytest.raises(BackendUnavailable, match="failed to start: RuntimeError: CUDA error: out of memory"):
        make_backend("tensorrt", components, "cpu")
    with caplog.at_level(logging.WARNING, logger="render.engine.backends.select"):
        assert isinstance(make_backend("auto", components, "cpu"), TorchBackend)
    assert any("out of memory during ONNX export" in r.message for r in caplog.records)


def test_unknown_backend_is_named(components):
    with pytest.raises(BackendUnavailable, match="unknown backend 'onnx'"):
        make_backend("onnx", components, "cpu")
    assert BACKEND_NAMES == ("auto", "torch", "tensorrt")


# ---- real engines (GPU) ---------------------------------------------------------------------


GPU_SIZES = ((256, 256), (192, 320))


@pytest.fixture(scope="module", params=["tiny", "tiny-sdxl", "tiny-sd3", "tiny-flux"])
def engines(request, tmp_path_factory):
    from render.engine.backends.tensorrt import TensorRTBackend
    from render.engine.model import load_model

    fam = load_model(request.param)  # its own copy: the backends move modules to the GPU in place
    opts = TensorRTOptions(cache_dir=tmp_path_factory.mktemp("engines"), max_batch=4, sizes=GPU_SIZES)
    trt_backend = TensorRTBackend(fam, torch.device("cuda"), opts)
    return fam, opts, trt_backend, TorchBackend(fam, torch.device("cuda"))


def _inputs(fam, images, height, width):
    """The family's real batched inputs for `images` images at mixed steps, prompts and guidance."""
    g = guidance_for(fam)
    batch = [
        start(fam, f"prompt {i}", seed=i, steps=4, guidance=g if i % 2 else 0.0, size=width, height=height)
        for i in range(images)
    ]
    for i, d in enumerate(batch):
        d.step = i % 4  # every image at its own timestep
    return fam.denoiser_inputs(batch)


@needs_tensorrt
@pytest.mark.parametrize("images,hw", [(1, (256, 256)), (3, (256, 256)), (2, (192, 320)), (5, (256, 256))])
def test_gpu_denoiser_engine_matches_torch(engines, images, hw):
    fam, _, trt_backend, torch_backend = engines
    inputs = _inputs(fam, images, *hw)  # more rows than max_batch: the backend runs the engine in chunks
    got, want = trt_backend.predict(inputs), torch_backend.predict(inputs)
    assert got.device.type == "cuda" and got.shape == want.shape == inputs["sample"].shape
    torch.testing.assert_close(got.float(), want.float(), atol=3e-2, rtol=3e-2)


@needs_tensorrt
def test_gpu_decoder_engine_matches_torch(engines):
    fam, _, trt_backend, torch_backend = engines
    latents = torch.randn(2, fam.latent_channels, 32, 32, generator=torch.Generator().manual_seed(9))
    got, want = trt_backend.decode(latents), torch_backend.decode(latents)
    assert got.shape == (2, 3, 256, 256)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


@needs_tensorrt
def test_gpu_size_outside_profile_is_a_clear_error(engines):
    fam, _, trt_backend, _ = engines
    with pytest.raises(BackendUnavailable, match="outside what this node's TensorRT engines were built for"):
        trt_backend.decode(torch.zeros(1, fam.latent_channels, 64, 64))
    with pytest.raises(BackendUnavailable, match="outside the engine's profile"):
        trt_backend.predict(_inputs(fam, 1, 512, 512))


@needs_tensorrt
def test_gpu_second_start_loads_from_cache_and_corrupt_engine_is_rebuilt(engines, caplog):
    from render.engine.backends.tensorrt import TensorRTBackend

    fam, opts, first, _ = engines
    with caplog.at_level(logging.INFO, logger="render.engine.backends.engine_cache"):
        TensorRTBackend(fam, torch.device("cuda"), opts)
    assert sum("engine cache hit" in r.message for r in caplog.records) == 2
    caplog.clear()
    precision = {torch.float16: "fp16", torch.bfloat16: "bf16"}[first.dtype]
    denoiser_engine = opts.cache_dir / first.engines.key("denoiser", fam, precision).filename()
    assert denoiser_engine.name.startswith(f"{fam.name}-denoiser-")  # the family is part of the key
    denoiser_engine.write_bytes(b"\0" * 64)
    with caplog.at_level(logging.INFO, logger="render.engine.backends.engine_cache"):
        again = TensorRTBackend(fam, torch.device("cuda"), opts)
    assert any("rebuilding" in r.message for r in caplog.records)
    assert denoiser_engine.stat().st_size > 64 and again.describe()["name"] == "tensorrt"


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
    from render.engine.backends.tensorrt import build_serialized_engine

    fake = FakeTRT()
    opts = TensorRTOptions(cache_dir=tmp_path, max_batch=8, optimization_level=2)
    profile = denoiser_profile(opts, family("tiny-sdxl"))
    with caplog.at_level(logging.INFO, logger="render.engine.backends.tensorrt"):
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
    from render.engine.backends.tensorrt import build_serialized_engine

    opts = TensorRTOptions(cache_dir=tmp_path)
    with pytest.raises(BackendUnavailable, match="cannot parse unet.onnx: node 0: unsupported operator; node 1"):
        build_serialized_engine(FakeTRT(parses=False), tmp_path / "unet.onnx", {}, opts, None)
    assert build_serialized_engine(FakeTRT(plan=None), tmp_path / "unet.onnx", {}, opts, None) == b""


def test_sizes_outside_the_engines_are_a_400_before_queueing(tmp_path):
    """The TensorRT backend's size limits reach the HTTP API's validation (no failed job, no 5xx)."""
    from render.engine.backends.tensorrt import TensorRTBackend
    from render.front.http_api import BadRequest, parse_generation
    from render.jobs import RequestDefaults

    opts = TensorRTOptions(cache_dir=tmp_path, sizes=((512, 512), (512, 768)))  # (height, width)
    backend = types.SimpleNamespace(options=opts, family=family("tiny"))  # what sizes() reads; no GPU
    check = TensorRTBackend.sizes.__get__(backend)().unsupported
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
