"""Layer partitioning over pipeline stages and virtual chunks (pure)."""
import pytest

from gigatron.parallel.pipeline.partition import partition_layers, stage_layer_counts


def test_uniform_split_covers_every_layer_once_in_order():
    for num_layers in range(1, 25):
        for pp in range(1, num_layers + 1):
            if num_layers % pp:
                continue
            part = partition_layers(num_layers, pp)
            layers = [i for r in range(pp) for i in part.layer_range(r)]
            assert layers == list(range(num_layers))
            assert part.pre_process(0) and part.post_process(pp - 1)
            assert sum(part.pre_process(r) for r in range(pp)) == 1
            assert sum(part.post_process(r) for r in range(pp)) == 1


def test_first_and_last_stage_flags_unbalance_the_ends():
    assert stage_layer_counts(10, 4, first_stage_layers=1, last_stage_layers=3) == [1, 3, 3, 3]
    assert stage_layer_counts(8, 3, first_stage_layers=2) == [2, 3, 3]
    assert stage_layer_counts(8, 3, last_stage_layers=4) == [2, 2, 4]
    assert stage_layer_counts(5, 2, first_stage_layers=2, last_stage_layers=3) == [2, 3]
    part = partition_layers(10, 4, first_stage_layers=1, last_stage_layers=3)
    assert [part.layer_range(r) for r in range(4)] == [range(0, 1), range(1, 4), range(4, 7),
                                                       range(7, 10)]


def test_virtual_chunks_follow_megatron_interleaved_assignment():
    # 8 layers, pp=2, 2 layers per virtual stage -> v=2; virtual stage c*pp + r.
    part = partition_layers(8, 2, num_layers_per_virtual_stage=2)
    assert part.virtual_chunks == 2
    assert part.layers == ((range(0, 2), range(4, 6)), (range(2, 4), range(6, 8)))
    assert part.pre_process(0, 0) and not part.pre_process(0, 1)
    assert part.post_process(1, 1) and not part.post_process(1, 0)
    part = partition_layers(12, 3, num_layers_per_virtual_stage=1)
    assert part.virtual_chunks == 4
    flat = sorted((part.layer_range(r, c).start, r, c) for r in range(3) for c in range(4))
    assert [(r, c) for _, r, c in flat] == [(r, c) for c in range(4) for r in range(3)]
    assert "chunk 1: layers 3-3" in part.describe()


def test_uneven_ends_with_virtual_chunks():
    part = partition_layers(12, 3, first_stage_layers=2, last_stage_layers=2,
                            num_layers_per_virtual_stage=4)
    # middle stage has 8 layers -> v = 2; first/last have 1 layer per chunk.
    assert part.virtual_chunks == 2
    assert [[len(r) for r in chunks] for chunks in part.layers] == [[1, 1], [4, 4], [1, 1]]
    layers = sorted(i for chunks in part.layers for r in chunks for i in r)
    assert layers == list(range(12))


@pytest.mark.parametrize("kwargs,flag", [
    (dict(num_layers=6, pp_size=4), "--pipeline-model-parallel-size"),
    (dict(num_layers=3, pp_size=4), "larger than --num-layers"),
    (dict(num_layers=7, pp_size=3, first_stage_layers=2), "--decoder-first-pipeline-num-layers"),
    (dict(num_layers=8, pp_size=2, first_stage_layers=3, last_stage_layers=4),
     "--decoder-last-pipeline-num-layers"),
    (dict(num_layers=8, pp_size=1, first_stage_layers=3), "--decoder-first-pipeline-num-layers"),
    (dict(num_layers=8, pp_size=2, num_layers_per_virtual_stage=3),
     "--num-layers-per-virtual-pipeline-stage"),
    (dict(num_layers=8, pp_size=1, num_layers_per_virtual_stage=2),
     "--num-layers-per-virtual-pipeline-stage"),
    (dict(num_layers=12, pp_size=3, first_stage_layers=3, last_stage_layers=1,
          num_layers_per_virtual_stage=4), "--num-layers-per-virtual-pipeline-stage"),
    (dict(num_layers=8, pp_size=2, first_stage_layers=0), "--decoder-first-pipeline-num-layers"),
])
def test_bad_partitions_raise_errors_naming_the_flags(kwargs, flag):
    with pytest.raises(ValueError, match=flag):
        partition_layers(**kwargs)
