"""`python -m tp_train.tools.planning_table`: docs/cluster.md's planning table, predicted per-GPU memory of training
Llama-2 7B, 13B and 70B shapes with AdamW at tp=8 x dp in {1, 8, 64}, DDP against FSDP2, by `estimate_memory`;
`--cp` sets the context-parallel size, and the last column is the longest sequence that fits one GPU at cp 1, 2, 4
and 8 (each rank holding 1/cp of its tokens). `--pipeline` prints instead Llama-3 70B and 405B shapes at tp=8 x pp x
dp (the pipeline rank holding the most, 1F1B with 2 microbatches per stage, sequence parallelism and activation
checkpointing as such models train), nodes of 8 GPUs: tp within a node, pp and dp across nodes.
"""

from __future__ import annotations

import argparse

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from tp_train.parallel.dims import ParallelDims
from tp_train.tools.hardware import GIB
from tp_train.tools.memory import estimate_memory

# Each shape's LlamaConfig fields; vocabulary 32000, context 4096 for all three.
FIELDS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "intermediate_size")
LLAMA_2 = {
    "Llama-2-7B": (4096, 32, 32, 32, 11008),
    "Llama-2-13B": (5120, 40, 40, 40, 13824),
    "Llama-2-70B": (8192, 80, 64, 8, 28672),
}


# Llama-3's shapes: vocabulary 128256, context 8192.
LLAMA_3 = {
    "Llama-3-70B": (8192, 80, 64, 8, 28672),
    "Llama-3.1-405B": (16384, 126, 128, 8, 53248),
}
PIPELINE_SIZES = (1, 2, 4, 8)


def llama(name: str) -> torch.nn.Module:
    vocab, context = (32000, 4096) if name in LLAMA_2 else (128256, 8192)
    shape = dict(zip(FIELDS, (LLAMA_2 | LLAMA_3)[name], strict=True))
    config = LlamaConfig(vocab_size=vocab, max_position_embeddings=context, **shape)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


CONTEXT_PARALLEL_SIZES = (1, 2, 4, 8)


def longest_sequence(estimate, gpu_gib: float, cp: int, step: int = 1024) -> int:
    """The longest sequence (a multiple of `step`) that fits `gpu_gib` at `cp`: the model states do not depend on
    the sequence and the activations grow with each rank's tokens (seq / cp), so one estimate gives it."""
    probe = 8 * step * cp
    at = estimate(probe, cp)
    fixed = at.parameters + at.optimizer_states + at.gradient_buckets + at.gathered_parameters
    room = gpu_gib * GIB - fixed
    if room < at.gradients:
        return 0
    per_local_token = at.activations / (probe // cp)
    return int(room / per_local_token) * cp // step * step


def table(tp: int, dps: list[int], seq_len: int, micro_batch: int, precision: str, gpu_gib: float, cp: int = 1) -> str:
    lines = [
        "| model | dp | mode | params | grads | AdamW | buckets / gathered | activations | peak | fits "
        "| longest sequence that fits, cp=1/2/4/8 |",
        "|---|--:|---|--:|--:|--:|--:|--:|--:|---|--:|",
    ]
    for name in LLAMA_2:
        model = llama(name)
        for dp in dps:
            for mode in ("ddp", "fsdp"):

                def estimate_at(length, context, model=model, dp=dp, mode=mode):
                    return estimate_memory(  # the app's default loss: vocabulary-parallel, logits never gathered
                        model, micro_batch, length, tp=tp, dp=dp, cp=context, precision=precision,
                        data_parallel=mode, loss_parallel=True,
                    )  # fmt: skip

                estimate = estimate_at(seq_len, cp)
                longest = " / ".join(
                    f"{longest_sequence(estimate_at, gpu_gib, size) // 1024}k" for size in CONTEXT_PARALLEL_SIZES
                )
                cells = [estimate.parameters, estimate.gradients, estimate.optimizer_states]
                cells += [estimate.gradient_buckets + estimate.gathered_parameters, estimate.activations]
                cells.append(estimate.total)
                fits = "yes" if estimate.total <= gpu_gib * GIB else "no"
                numbers = " | ".join(f"{value / GIB:.1f}" for value in cells)
                lines.append(f"| {name} | {dp} | {mode} | {numbers} | {fits} | {longest} |")
    return "\n".join(lines)


def pipeline_table(dps: list[int], seq_len: int, micro_batch: int, precision: str, gpu_gib: float) -> str:
    """Llama-3 shapes at tp=8 x pp x dp, FSDP2 over dp, sequence parallelism and activation checkpointing: GiB on
    the pipeline rank holding the most, with 1F1B over 2 pp microbatches of `micro_batch` sequences each (the rank's
    batch is 2 pp x `micro_batch`)."""
    lines = [
        "| model | pp | dp | GPUs | nodes | params | grads | AdamW | gathered | activations | peak | fits |",
        "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|---|",
    ]
    for name in LLAMA_3:
        model = llama(name)
        for pp in PIPELINE_SIZES:
            for dp in dps:
                estimate = estimate_memory(
                    model, 2 * pp * micro_batch, seq_len, tp=8, dp=dp, precision=precision, data_parallel="fsdp",
                    loss_parallel=True, sequence_parallel=True, activation_checkpointing=True, pp=pp,
                    pipeline_microbatches=2 * pp,
                )  # fmt: skip
                cells = [estimate.parameters, estimate.gradients, estimate.optimizer_states]
                cells += [estimate.gathered_parameters, estimate.activations, estimate.total]
                numbers = " | ".join(f"{value / GIB:.1f}" for value in cells)
                fits = "yes" if estimate.total <= gpu_gib * GIB else "no"
                gpus = ParallelDims.devices_for(dp=dp, tp=8, pp=pp)
                lines.append(f"| {name} | {pp} | {dp} | {gpus} | {gpus // 8} | {numbers} | {fits} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tp_train.tools.planning_table", description=__doc__)
    parser.add_argument("--tp", type=int, default=8)
    parser.add_argument("--dp", default="1,8,64", help="data-parallel sizes, comma-separated")
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--micro-batch", type=int, default=1)
    parser.add_argument("--precision", default="bf16-mixed")
    parser.add_argument("--gpu-gib", type=float, default=80.0, help="memory per GPU, GiB")
    parser.add_argument("--cp", type=int, default=1, help="context-parallel size of the memory columns")
    parser.add_argument("--pipeline", action="store_true", help="Llama-3 70B and 405B at tp=8 x pp x dp instead")
    args = parser.parse_args(argv)
    dps = [int(dp) for dp in args.dp.split(",")]
    if args.pipeline:
        print(f"GiB per GPU: tp=8, 1F1B, FSDP2 over dp, {args.precision}, {args.seq_len}-token sequences")
        print(pipeline_table(dps, args.seq_len, args.micro_batch, args.precision, args.gpu_gib))
        return
    print(
        f"GiB per GPU: tp={args.tp}, cp={args.cp}, {args.precision}, micro-batch {args.micro_batch} x {args.seq_len} "
        f"tokens"
    )
    print(table(args.tp, dps, args.seq_len, args.micro_batch, args.precision, args.gpu_gib, args.cp))


if __name__ == "__main__":
    main()
