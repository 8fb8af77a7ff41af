"""CUDA tensors the notebook captured travel through host memory and land on each rank's own GPU.

Pickled as it is, a CUDA tensor comes back on the device it left from: every rank would put
the notebook's `cuda:0` tensor on `cuda:0` (all ranks of a host on one GPU, whatever `--gpu`
pinned), and a rank without a GPU could not load the cell at all. So the capture
(`driver/capture.py`) pickles each CUDA tensor as its host copy and this module's
`on_this_ranks_gpu`, which puts it on the rank's own GPU, `cuda:<LOCAL_RANK>` (the device
`--gpu` pins), or refuses with what to do where the rank has none. The capture says so
before launch, naming the variables.

Kept free of a torch import at module level: the driver imports it to capture, and the
notebook need not have torch loaded (then it holds no CUDA tensor either).
"""

from __future__ import annotations

import os
import sys


def is_cuda_tensor(value: object) -> bool:
    """Whether `value` is a torch tensor in GPU memory (False wherever torch is not loaded)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor) and value.is_cuda


def holds_cuda_tensors(value: object) -> bool:
    """Whether `value` is a CUDA tensor, or a module with parameters or buffers on a GPU."""
    if is_cuda_tensor(value):
        return True
    torch = sys.modules.get("torch")
    if torch is None or not isinstance(value, torch.nn.Module):
        return False
    return any(t.is_cuda for t in (*value.parameters(), *value.buffers()))


def device_neutral(tensor) -> tuple:
    """The pickle reduction of a CUDA `tensor`: its host copy, rebuilt on the rank's GPU."""
    import torch

    host = tensor.detach().cpu().as_subclass(torch.Tensor)
    return on_this_ranks_gpu, (host, isinstance(tensor, torch.nn.Parameter), tensor.requires_grad,
                               str(tensor.device))


def on_this_ranks_gpu(host, parameter: bool, requires_grad: bool, was_on: str):
    """Unpickling on a rank: the captured tensor, on this rank's own GPU."""
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError(
            f"the cell captured a tensor the notebook holds on its GPU ({was_on}), but this rank "
            "sees no GPU. Move it to the CPU in the notebook (`x = x.cpu()`), or create it "
            "inside the cell, where each rank makes its own.")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    tensor = host.to(device)
    if parameter:
        return torch.nn.Parameter(tensor, requires_grad)
    return tensor.requires_grad_(requires_grad)
