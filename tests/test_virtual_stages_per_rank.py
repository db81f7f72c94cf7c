"""--num-virtual-stages-per-pipeline-rank: Megatron-Core's newer spelling of the virtual
pipeline size (Megatron-LM's arguments.py: it is the virtual size itself, exclusive with
--num-layers-per-virtual-pipeline-stage, allowed with uneven first/last stages, 1 = not
interleaved; get_num_layers_to_build: each stage's layers divided by it)."""
import pytest

from gigatron.parallel.pipeline.partition import partition_layers

FLAGS = ("--num-layers 8 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
         "--micro-batch-size 1 --global-batch-size 4 --train-iters 4 --lr 1e-3 --mock-data "
         "--vocab-size 64 --pipeline-model-parallel-size 2").split()


def test_it_is_the_number_of_chunks_the_layers_per_chunk_flag_derives():
    assert partition_layers(8, 2, virtual_stages_per_rank=2) == \
        partition_layers(8, 2, num_layers_per_virtual_stage=2)
    assert partition_layers(8, 2, virtual_stages_per_rank=1) == partition_layers(8, 2)


def test_uneven_first_and_last_stages_split_into_the_same_number_of_chunks():
    part = partition_layers(12, 4, first_stage_layers=2, last_stage_layers=2,
                            virtual_stages_per_rank=2)
    assert part.virtual_chunks == 2
    assert [[len(r) for r in chunks] for chunks in part.layers] == [[1, 1], [2, 2], [2, 2],
                                                                    [1, 1]]
    assert part.layer_range(0, 0) == range(0, 1) and part.layer_range(0, 1) == range(6, 7)
    assert part.layer_range(3, 1) == range(11, 12)


@pytest.mark.parametrize("kwargs, message", [
    (dict(num_layers_per_virtual_stage=2, virtual_stages_per_rank=2), "are exclusive"),
    (dict(first_stage_layers=3, virtual_stages_per_rank=2), "stage 0 has 3 layers"),
    (dict(virtual_stages_per_rank=0), "must be a positive integer")])
def test_what_megatron_refuses_is_one_line_naming_the_flag(kwargs, message):
    with pytest.raises(ValueError, match=message) as err:
        partition_layers(9 if "first_stage_layers" in kwargs else 8, 2, **kwargs)
    assert "--num-virtual-stages-per-pipeline-rank" in str(err.value)
    with pytest.raises(ValueError, match="needs --pipeline-model-parallel-size > 1"):
        partition_layers(8, 1, virtual_stages_per_rank=2)


def test_the_flag_reaches_the_run_s_partition():
    from gigatron.training.config.arguments import parse_args
    from gigatron.training.run.builders import partition

    run = parse_args(FLAGS + ["--num-virtual-stages-per-pipeline-rank", "2"], 2)
    assert run.parallel.num_virtual_stages_per_pipeline_rank == 2
    assert partition(run) == partition_layers(8, 2, num_layers_per_virtual_stage=2)
