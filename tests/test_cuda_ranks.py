"""The CUDA path at tp=2 on one GPU: two ranks share it over gloo with CUDA tensors (NCCL cannot put two ranks on
one device). The sharded model on the GPU computes the unsharded model's function on the GPU (fp32, 1e-5) with and
without backward overlap (whose collectives then run beside the weight gradients, on gloo's own CUDA stream), with
sequence parallelism and through Hugging Face's Llama; the CUDA RNG tracker gives sharded regions their own dropout
masks and replicated regions the same; `parallelize(compile=True)` compiles with inductor (Triton kernels) without
a graph break and keeps the numbers; the context-parallel attention op at cp=2 equals SDPA on the GPU. The same rank
functions as the CPU tests, on `device="cuda"`.

Marked `cuda` and skipped without a GPU: scripts/gpu_check.sh runs them on a GPU machine."""

from __future__ import annotations

import pytest
import torch

from tests.distributed import run_on_ranks
from tests.parity import assert_parity, parity_errors
from tests.test_compile import _parity as _compiled_parity
from tests.test_context_parallel_attention import check_cp_attention
from tests.test_context_parallel_bf16 import check_bf16
from tests.test_dropout_rng import _train_with_dropout, check_dropout_streams
from tests.test_overlap import VARIANTS, VOCAB

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (scripts/gpu_check.sh runs it on one)"),
]


def _parity_on_cuda(rank, world_size, variant, overlap):
    build, forward, kwargs = VARIANTS[variant]
    torch.manual_seed(0)
    errors = parity_errors(build(), forward, VOCAB, parallelize_kwargs=dict(overlap=overlap, **kwargs), device="cuda")
    return errors, torch.cuda.max_memory_allocated() > 0  # the work was on the GPU


CASES = [(1, "gpt", True), (2, "gpt", False), *((2, variant, True) for variant in VARIANTS)]


@pytest.mark.parametrize(
    "tp,variant,overlap", CASES, ids=[f"tp{tp}-{v}-{'overlap' if o else 'no_overlap'}" for tp, v, o in CASES]
)
def test_sharded_model_on_the_gpu_matches_the_unsharded_one(tp, variant, overlap):
    for rank, (errors, on_gpu) in enumerate(run_on_ranks(_parity_on_cuda, tp, variant, overlap, timeout=300)):
        assert on_gpu
        assert_parity(errors, tp, rank)


def test_cuda_dropout_streams_differ_in_sharded_regions_and_agree_in_replicated_ones():
    check_dropout_streams(run_on_ranks(_train_with_dropout, 2, 10, "cuda", timeout=300))


# Seen on an H100 (torch 2.11.0+cu130, 2026-11-26, scripts/gpu_check.sh): at tp=2 both ranks die with SIGSEGV inside
# the compiled graph, in our collective op on gloo with CUDA tensors (faulthandler's stack: the inductor module ->
# torch/_library/autograd.py forward_no_grad -> redispatch); the eager CUDA + gloo parity cases above pass, and so
# does the compiled tp=1 case. Two ranks on one GPU can only use gloo; NCCL needs two GPUs. Strict: it is reported
# the day it passes.
GLOO_CUDA_COMPILE = pytest.mark.xfail(
    raises=RuntimeError, strict=True, reason="compiled collectives on gloo with CUDA tensors segfault (torch 2.11)"
)


@pytest.mark.parametrize("tp", [1, pytest.param(2, marks=GLOO_CUDA_COMPILE)])
def test_parallelize_compile_with_inductor_on_the_gpu_has_no_graph_break(tp):
    results = run_on_ranks(_compiled_parity, tp, "gpt", None, {"compile": True}, "cuda", timeout=600)
    for rank, (errors, graph_breaks, graphs) in enumerate(results):
        assert graphs >= 1 and graph_breaks == 0, (graphs, graph_breaks)
        assert_parity(errors, tp, rank)


def test_context_parallel_attention_on_the_gpu_equals_sdpa():
    """cp=2 on one GPU (gloo with CUDA tensors): the ring and all-gather rotations, causal, GQA and packed documents,
    forward and backward against one process's SDPA on the GPU."""
    check_cp_attention(2, "cuda")


def test_context_parallel_attention_in_bf16_on_the_gpu_is_as_close_as_bf16_sdpa():
    """bf16 through the CUDA kernels (memory-efficient attention, blocks merged in fp32) at cp=2 on one GPU."""
    check_bf16("cuda")
