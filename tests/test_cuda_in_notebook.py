"""The notebook's CUDA rules, checked where no GPU is (CI): a tensor the notebook holds on its
GPU is named before launch and travels device-neutral, landing on each rank's own GPU or
refused there with what to do. The factory's half (never initialise CUDA before forking) is
in test_rank_factory.py; the GPU's half (the tensor lands on cuda:<local_rank>) in
test_cuda_plane.py."""

import cloudpickle
import pytest
import torch

from ddl_magic.driver.capture import capture_cell, capture_function


class PretendCuda(torch.Tensor):
    """A host tensor that says it lives on the notebook's GPU, as a CUDA tensor would."""

    is_cuda = property(lambda self: True)
    device = property(lambda self: torch.device("cuda", 0))


def on_the_notebooks_gpu(*shape) -> torch.Tensor:
    return torch.ones(*shape).as_subclass(PretendCuda)


def test_a_captured_cuda_tensor_is_named_before_launch():
    model = torch.nn.Linear(2, 2)
    model.weight = torch.nn.Parameter(on_the_notebooks_gpu(2, 2))
    captured = capture_cell("y = (x + model(x)).sum() * lr",
                            {"x": on_the_notebooks_gpu(2), "model": model, "lr": 0.1})
    assert captured.on_gpu == ["x", "model"]
    note = captured.report().splitlines()[1]
    assert note.startswith("ddl_magic note: x, model hold tensors on the notebook's GPU: each rank "
                           "gets a copy on its own GPU (cuda:<local_rank>)")


def test_on_a_rank_without_a_gpu_it_is_refused_with_what_to_do():
    captured = capture_cell("y = x * 2", {"x": on_the_notebooks_gpu(3)})
    with pytest.raises(RuntimeError, match=r"holds on its GPU \(cuda:0\), but this rank sees no "
                                           r"GPU\. Move it to the CPU in the notebook \(`x = x.cpu\(\)`\)"):
        cloudpickle.loads(captured.payload)  # as a rank does


def test_host_tensors_travel_as_they_are():
    captured = capture_cell("y = x * 2", {"x": torch.arange(3)})
    assert captured.on_gpu == [] and len(captured.report().splitlines()) == 1
    assert torch.equal(cloudpickle.loads(captured.payload).namespace["x"], torch.arange(3))


def test_horovod_runner_arguments_are_named_too(capsys):
    capture_function(lambda data: data, {"data": on_the_notebooks_gpu(2)})
    assert "ddl_magic note: argument data holds tensors on the notebook's GPU" in capsys.readouterr().out
