"""device=cuda is honest: the probes run on the device they name, and the recorder proves it.

There is no GPU here, so the plumbing is tested on a simulated second device: tensors that report
`lazy` (a device type torch knows and autograd runs on, otherwise unused here) and keep their data
in a CPU tensor, run by the same CPU kernels. Like CUDA, it refuses an op that mixes its tensors
with a non-scalar CPU tensor, and `.numpy()` of its tensors. The recorder's own `on_device`
(placement + DeviceAudit) runs real probes on it: a tensor that a probe or a torch source makes
without the device is a CPU tensor, and the first op on it is caught.
"""
from __future__ import annotations

import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map

from catalog.tasks import compose_task, known_tasks
from recorder.device import DeviceAudit, DEVICES, ENTRY_POINTS, host_staging, on_device, placed_on, record_on
from recorder.probes import serving, training

ROOT = Path(__file__).resolve().parents[2]
SIM = torch.device("lazy")
aten = torch.ops.aten
# cheap probes that between them reach every entry point: module builds and checkpoint loads, numpy
# inputs, factories in the sources (RoPE, masks, LoRA, KV cache), the collator, backward and AdamW
# steps, the sampler's noise, list indexing, the engine loop and `.numpy()` inside the runner
TRAINING = ("rms_norm", "rope", "attention_core", "lora_linear", "collate", "decoder_layer", "logits_b2_t16_pad",
            "loss_step0", "lora_grads_step0")
SERVING = ("paged_attention_window_softcap", "sampler_penalties", "sampler_pipeline", "decoder_layer_paged",
           "prefill_t5", "cache_state", "sampled_sequences")


# ---- the simulated device ------------------------------------------------------------------------------

class SimTensor(torch.Tensor):
    """A tensor on SIM whose data is the CPU tensor `elem`."""

    @staticmethod
    def __new__(cls, elem):
        r = torch.Tensor._make_wrapper_subclass(cls, elem.size(), strides=elem.stride(),
                                                storage_offset=elem.storage_offset(), dtype=elem.dtype,
                                                layout=elem.layout, device=SIM, requires_grad=elem.requires_grad)
        r.elem = elem.detach()
        return r

    def __repr__(self):
        return f"SimTensor({self.elem!r})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is aten._to_copy.default and _is_cpu(kwargs.get("device")):
            return func(args[0].elem, **kwargs)  # back to the host: a plain CPU tensor
        if func not in (aten.copy_.default, aten.index.Tensor, aten.index_put_.default, aten.index_put.default,
                        aten._index_put_impl_.default):
            host = [x for x in tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)
                    and not isinstance(x, SimTensor) and not (x.dim() == 0 and x.device.type == "cpu")]
            if host:  # what CUDA says
                raise RuntimeError(f"Expected all tensors to be on the same device, but found at least two "
                                   f"devices, {SIM} and {host[0].device}! ({func})")
        kw = tree_map(_unwrap, kwargs)
        if "device" in kw:
            kw["device"] = torch.device("cpu")
        out = func(*tree_map(_unwrap, args), **kw)
        if func._schema.is_mutable and isinstance(args[0], torch.Tensor):
            return args[0]  # in place: its elem changed under it
        return tree_map(_wrap, out)


def _unwrap(x):
    return x.elem if isinstance(x, SimTensor) else x


def _wrap(x):
    return SimTensor(x) if isinstance(x, torch.Tensor) else x


def _is_cpu(device) -> bool:
    return device is not None and torch.device(device).type == "cpu"


def _is_sim(device) -> bool:
    return device is not None and torch.device(device).type == SIM.type


class _SimFactories(TorchDispatchMode):
    """Factories asked for SIM (`zeros`, `arange`, `empty`, copies `.to(SIM)`) make SimTensors."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _is_sim(kwargs.get("device")) and not any(isinstance(x, SimTensor) for x in tree_leaves(args)):
            return tree_map(_wrap, func(*args, **{**kwargs, "device": torch.device("cpu")}))
        return func(*args, **kwargs)


class _SimData(TorchFunctionMode):
    """What C++ does for a real device below the dispatcher's Python modes, done here above them:
    `torch.tensor(data)` and kin (built on the host, then copied), `x[[3, 5]]` (a host index tensor,
    which CUDA takes too) and `tolist` (a copy to the host)."""
    DATA = (torch.tensor, torch.as_tensor, torch.asarray)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.tolist and isinstance(args[0], SimTensor):
            return args[0].cpu().tolist()
        if func in (torch.Tensor.__getitem__, torch.Tensor.__setitem__) and isinstance(args[0], SimTensor):
            args = (args[0], _host_index(args[1]), *args[2:])
        if func in self.DATA and not isinstance(args[0], torch.Tensor) \
                and _is_sim(kwargs.get("device") or torch.get_default_device()):
            with host_staging():
                host = func(*args, **{**kwargs, "device": "cpu"})
            return host.to(SIM)
        return func(*args, **kwargs)


def _host_index(index):
    if isinstance(index, tuple):
        return tuple(_host_index(i) for i in index)
    if isinstance(index, list):
        with host_staging():
            return torch.tensor(index, device="cpu")
    return index


@contextmanager
def simulated_device():
    with _SimFactories(), _SimData():
        yield


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def cfgs():
    return {"training": compose_task("llama3-sft"), "serving": compose_task("llama3-core")}


def _run(module, cfg, names):
    ctx = module.Ctx(cfg)
    return ctx, {name: module.PROBES[name](ctx)[1] for name in names}


@pytest.fixture(scope="module")
def on_cpu(cfgs):
    return {"training": _run(training, cfgs["training"], TRAINING)[1],
            "serving": _run(serving, cfgs["serving"], SERVING)[1]}


# ---- placement ----------------------------------------------------------------------------------------

def test_the_simulated_device_behaves_like_a_device():
    with simulated_device():
        x = torch.ones(3, device=SIM)
        assert isinstance(x, SimTensor) and x.device == SIM and (x * 2).sum().item() == 6.0
        with pytest.raises(RuntimeError, match="same device"):
            x + torch.ones(3)
        assert (x + torch.tensor(1.0)).device == SIM  # a CPU scalar is a number, as on CUDA
        with pytest.raises(Exception):
            x.numpy()


def test_probes_make_every_tensor_on_the_device(cfgs, on_cpu):
    """Real probes of llama3-sft and llama3-core on SIM: every op on SIM, results equal to the CPU's."""
    with simulated_device(), on_device(SIM) as audit:
        ctx_t, got_t = _run(training, cfgs["training"], TRAINING)
        ctx_s, got_s = _run(serving, cfgs["serving"], SERVING)
    assert audit.num_violations == 0, "\n".join(audit.violations)
    audit.verify()
    # nothing but results going back (and AdamW's host step count) left the device
    assert set(audit.outputs) == {"lazy", "cpu"}
    assert audit.outputs["cpu"] == audit.to_host + audit.host_scalars and audit.to_host > 50
    assert audit.outputs["lazy"] > 10_000
    params = [*ctx_t.model.parameters(), *ctx_s.runner.model.parameters()]
    assert params and all(p.device == SIM for p in params)
    assert all(k.device == SIM for k in ctx_s.runner.kv_cache.k if k is not None)
    for got, want in ((got_t, on_cpu["training"]), (got_s, on_cpu["serving"])):
        for name in want:
            assert got[name].keys() == want[name].keys()
            for k in want[name]:
                a, b = np.asarray(got[name][k]), np.asarray(want[name][k])
                assert type(got[name][k]) is type(want[name][k]) and a.dtype == b.dtype, (name, k)
                np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=f"{name}/{k}")


def _broken_host_input(ctx):
    """A probe that forgets the device for one input."""
    x = training.t(np.ones((2, 3, ctx.config.hidden_size), np.float32))
    w = torch.ones(ctx.config.hidden_size, device="cpu")
    return {}, {"y": training.n(ctx.family.rms_norm(x, w, 1e-5))}


def _broken_host_computation(ctx):
    """A probe whose inputs come through a constructor the plumbing does not know: it silently computes
    on the host, which no op-level error would catch on a real GPU either."""
    x = torch.frombuffer(bytearray(np.ones(2 * ctx.config.hidden_size, np.float32).tobytes()), dtype=torch.float32)
    w = torch.frombuffer(bytearray(np.ones(ctx.config.hidden_size, np.float32).tobytes()), dtype=torch.float32)
    return {}, {"y": training.n(ctx.family.rms_norm(x.view(2, -1), w, 1e-5))}


@pytest.mark.parametrize("probe", [_broken_host_input, _broken_host_computation])
def test_the_audit_catches_a_probe_that_forgets_the_device(cfgs, probe):
    with simulated_device(), on_device(SIM) as audit:
        ctx = training.Ctx(cfgs["training"])
        try:
            probe(ctx)
        except RuntimeError as e:
            assert "same device" in str(e)  # the simulated device refuses mixed inputs, as CUDA does
    assert audit.num_violations > 0
    assert "rms_norm" in "\n".join(audit.violations)  # the violation names where it happened
    with pytest.raises(RuntimeError, match="computed off lazy"):
        audit.verify()


@pytest.mark.parametrize("skip", ENTRY_POINTS)
def test_each_entry_point_is_needed(cfgs, skip):
    """Without any one of the four entry points the probes compute off the device, or fail."""
    failed = None
    with simulated_device(), placed_on(SIM, skip=(skip,)), DeviceAudit(SIM) as audit:
        try:
            _run(training, cfgs["training"], ("rope", "decoder_layer", "loss_step0"))
        except (RuntimeError, TypeError) as e:
            failed = e
    if skip == "numpy":  # a device tensor cannot become numpy in place (CUDA: TypeError)
        assert failed is not None and "numpy" in str(failed)
    else:  # host tensors: the audit names the first ops on them
        assert audit.num_violations > 0 and "cpu" in audit.violations[0], (failed, audit.violations)


def _fake_task(host_in_pass: int = 0, drift_in_pass: int = 0):
    """A task of one check; the pass numbered host_in_pass computes on the host, drift_in_pass drifts."""
    from catalog.h5schema import CheckRecord
    passes = []

    def run():
        passes.append(len(passes) + 1)
        a = np.linspace(0, 1, 8, dtype=np.float32)
        x = torch.frombuffer(bytearray(a.tobytes()), dtype=torch.float32) if passes[-1] == host_in_pass \
            else torch.from_numpy(a)
        y = (x * 2).sum() + (1e-3 if passes[-1] == drift_in_pass else 0.0)
        return [CheckRecord("L1", "fake", "numeric", "tensor", {"x": a}, {"y": training.n(y)})], None, float(passes[-1])
    return run, passes


def test_record_on_audits_a_pass_then_records_one_that_reproduces_it():
    said = []
    run, passes = _fake_task()
    with simulated_device():
        records, band, wall = record_on(SIM, run, said.append)
    assert passes == [1, 2] and wall == 2.0  # the reference and its wall-clock come from the unaudited pass
    assert any("aten ops checked" in m for m in said) and any("reproduces" in m for m in said)
    run, passes = _fake_task()
    record_on(torch.device("cpu"), run, said.append)
    assert passes == [1]  # the CPU: one pass, no audit


@pytest.mark.parametrize("fault", ["host_in_pass", "drift_in_pass"])
def test_record_on_refuses(fault):
    run, passes = _fake_task(**{fault: 1 if fault == "host_in_pass" else 2})
    with simulated_device(), pytest.raises(RuntimeError, match="computed off" if fault == "host_in_pass"
                                           else "does not reproduce"):
        record_on(SIM, run, lambda _: None)


@pytest.mark.slow
@pytest.mark.parametrize("task", known_tasks())
def test_every_task_records_on_the_simulated_device(task):
    """The recorder's own path (record_on around the task's record_task), every probe, on SIM."""
    from rich.console import Console
    cfg = compose_task(task)
    probes = training if "method" in cfg else serving
    with simulated_device():
        records, _, _ = record_on(SIM, lambda: probes.record_task(cfg, SIM, Console(quiet=True)), lambda _: None)
    assert len(records) > 20


def test_the_cpu_is_untouched():
    """device=cpu: placement changes nothing and no audit runs."""
    a = np.arange(6, dtype=np.float32)
    with on_device(torch.device("cpu")) as audit:
        x = torch.from_numpy(a)
        assert audit is None and x.device.type == "cpu" and np.shares_memory(x.numpy(), a)


# ---- configuration errors -----------------------------------------------------------------------------

def _recorder(*args):
    return subprocess.run([sys.executable, "-m", "recorder", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)


def test_devices_are_the_configured_ones():
    assert sorted(DEVICES) == sorted(p.stem for p in (ROOT / "configs/device").glob("*.yaml"))


def test_an_unknown_device_lists_the_valid_ones(tmp_path):
    for arg in ("device=tpu", "device.name=tpu"):
        r = _recorder("task=llama3-core", arg, f"out_dir={tmp_path}/refs")
        err = " ".join(r.stderr.split())
        assert r.returncode != 0 and "tpu" in err
        assert all(name in err for name in DEVICES), err
        assert not (tmp_path / "refs").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_cuda_without_a_gpu_refuses_before_anything_runs(tmp_path):
    # a missing checkpoint and an output directory still to make: the device is refused first
    r = _recorder("task=llama3-sft", "device=cuda", f"out_dir={tmp_path}/refs", f"family.checkpoint={tmp_path}/none")
    err = " ".join(r.stderr.split())  # rich wraps long lines
    assert r.returncode == 1
    assert "no CUDA device" in err and "device=cpu" in err, err
    assert "config.json" not in err and not (tmp_path / "refs").exists()


# ---- on a GPU -----------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_recording_runs_on_the_gpu(tmp_path, cfgs, on_cpu):
    import h5py

    from recorder.device import cuda_evidence, setup_device

    dev = setup_device("cuda")
    try:
        with on_device(dev) as audit:
            ctx_t, got_t = _run(training, cfgs["training"], TRAINING)
            ctx_s, got_s = _run(serving, cfgs["serving"], SERVING)
    finally:
        torch.use_deterministic_algorithms(False)
    audit.verify()
    assert audit.outputs[str(dev)] > 10_000 and "peak" in cuda_evidence(dev)
    assert all(p.is_cuda for p in [*ctx_t.model.parameters(), *ctx_s.runner.model.parameters()])
    for got, want in ((got_t, on_cpu["training"]), (got_s, on_cpu["serving"])):
        for name in want:  # true fp32 on another device: close to the CPU, not equal
            for k in want[name]:
                a, b = np.asarray(got[name][k]), np.asarray(want[name][k])
                if a.dtype.kind == "f":
                    np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-4, err_msg=f"{name}/{k}")
    r = _recorder("task=llama3-core", "device=cuda", f"out_dir={tmp_path}")
    err = " ".join(r.stderr.split())
    assert r.returncode == 0 and "aten ops checked" in err and "reproduces the audited one" in err, err[-2000:]
    assert "MiB allocated on" in err
    with h5py.File(tmp_path / "llama3-core.h5") as f:
        assert str(f.attrs["device"]).startswith("cuda:")
