"""The start-up banner's "parallel:" line names the pipeline schedule the run executes and
every parallel choice that is not the default (pure: built from a RunConfig, no processes)."""
import pytest

from gigatron.training.config.arguments import parse_args
from gigatron.training.run.banner import parallel_line
from gigatron.training.run.builders import partition

BASE = ("--num-layers 4 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
        "--micro-batch-size 2 --global-batch-size 8 --train-iters 10 --lr 1e-3 "
        "--mock-data --vocab-size 100")


def line(extra: str, world: int) -> str:
    run = parse_args((BASE + " " + extra).split(), world)
    return parallel_line(run, partition(run).virtual_chunks)


@pytest.mark.parametrize("extra, world, expected", [
    ("", 1, "parallel: schedule none (pp=1: no pipelining), 4 micro-batches"),
    ("--pipeline-model-parallel-size 2", 2, "parallel: schedule 1F1B, 2 stages x 4 micro-batches"),
    ("--pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 1", 2,
     "parallel: schedule interleaved 1F1B (2 virtual stages per rank), 2 stages x 4 "
     "micro-batches"),
    ("--pipeline-model-parallel-size 2 --pipeline-schedule zb-h1", 2,
     "parallel: schedule zb-h1 (zero bubble H1, split backward), 2 stages x 4 micro-batches"),
    ("--pipeline-model-parallel-size 2 --pipeline-schedule zbv "
     "--num-layers-per-virtual-pipeline-stage 1 --untie-embeddings-and-output-weights", 2,
     "parallel: schedule zbv (zero bubble V, 2 chunks per rank), 2 stages x 4 micro-batches"),
], ids=["none", "1f1b", "interleaved", "zb-h1", "zbv"])
def test_banner_names_the_schedule_that_runs(extra, world, expected):
    assert line(extra, world) == expected


def test_banner_names_every_non_default_parallel_choice():
    text = line("--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 "
                "--sequence-parallel --use-distributed-optimizer --recompute-granularity full "
                "--recompute-method block --recompute-num-layers 2", 8)
    assert text.endswith("; sequence parallel; ZeRO stage 1 (--use-distributed-optimizer); "
                         "recompute full (block, 2 layer(s))"), text
    text = line("--zero-stage 2 --optimizer-cpu-offload --context-parallel-size 2 "
                "--cp-comm-type a2a --attention-dropout 0 --recompute-granularity selective", 4)
    for part in ("context parallel 2 (a2a)", "ZeRO stage 2;", "optimizer state offloaded to cpu",
                 "recompute selective"):
        assert part in text, (part, text)
    text = line("--num-experts 4 --expert-model-parallel-size 2 --tensor-model-parallel-size 2 "
                "--expert-tensor-parallel-size 1 --sequence-parallel", 4)
    assert "expert parallel ep=2 etp=1" in text, text
    assert line("--pipeline-model-parallel-size 2 --pipeline-schedule zb-h1 "
                "--delay-wgrad-compute", 2).count("weight gradients delayed") == 1


def test_architecture_line_of_multi_latent_attention_names_its_head_sizes_and_latents():
    from gigatron.training.run.pretrain import _architecture

    dense = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 16 "
             "--micro-batch-size 2 --train-iters 2 --lr 1e-3 --mock-data --vocab-size 128 "
             "--normalization RMSNorm --position-embedding-type rope").split()
    mla = dense + ("--multi-latent-attention --kv-lora-rank 16 --qk-head-dim 16 "
                   "--qk-pos-emb-head-dim 8 --v-head-dim 12").split()
    line = _architecture(parse_args(mla, 1).model)
    assert line.endswith("multi-latent attention, 4 heads x q/k 16+8 / v 12 (key/value "
                         "latent 16)"), line
    assert _architecture(parse_args(dense, 1).model).endswith("4 heads x 16 (4 kv groups)")
