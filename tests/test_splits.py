"""--split: Megatron-Core's document boundaries for every share, and the quoted forms shell
scripts pass on. The reference below follows Megatron-Core's steps as its source states them
(NVIDIA/Megatron-LM d98e8a64, megatron/core/datasets: `normalize` in utils.py,
`parse_and_normalize_split` and `convert_split_vector_to_split_matrix` in
blended_megatron_dataset_config.py, the split indices of
`BlendedMegatronDatasetBuilder._build_megatron_dataset_splits`), written here on its own."""
import functools
import random
import re

import numpy as np
import pytest

from gigatron.data import GPTDataConfig, IndexedDatasetBuilder, build_train_valid_test_datasets
from gigatron.data.splits import parse_split, split_ranges


def megatron_core_split_indices(split: str, num_documents: int):
    """Per split: (begin, end) document indices, or None when its weight is 0."""
    vector = [float(x) for x in re.findall(r"[.0-9]+", split)]
    vector += [0.0] * (3 - len(vector))
    w = np.array(vector, dtype=np.float64)
    vector = (w / np.sum(w)).tolist()
    expansion = functools.reduce(lambda acc, x: acc + [acc[-1] + x], vector, [0])
    result = []
    for start, end in zip(expansion[:-1], expansion[1:]):
        if end <= start:
            result.append(None)
        else:
            result.append((int(round(start * float(num_documents))),
                           int(round(end * float(num_documents)))))
    return result


def legacy_split_indices(weights, num_documents):
    """Older Megatron's rounding: each share rounded, then shifted so the last bound is n."""
    total, bounds = sum(weights), [0]
    for w in weights:
        bounds.append(bounds[-1] + int(round(w / total * num_documents)))
    shift = bounds[-1] - num_documents
    return [(bounds[i] - shift * (i > 0), bounds[i + 1] - shift) for i in range(3)]


def _same(reference, ranges):
    return all((r is None and a == b) or (r is not None and r == (a, b))
               for r, (a, b) in zip(reference, ranges))


COMMON = ["969,30,1", "949,50,1", "98,2,0", "99,1,0", "90,5,5", "80,15,5", "1,1,1", "7,2,1",
          "100,0,0", "0,1,0", "1", "3,1", "0.7,0.2,0.1", "999,1,0", "95,4,1"]


def test_boundaries_equal_megatron_core_for_many_splits_and_document_counts():
    rng = random.Random(18)
    splits = COMMON + [",".join(str(rng.randint(0, 1000)) for _ in range(3)) for _ in range(60)]
    splits += [",".join(f"{rng.random():.4f}" for _ in range(3)) for _ in range(20)]
    counts = list(range(0, 300)) + [30_000] + [rng.randint(300, 10 ** 7) for _ in range(60)]
    checked = 0
    for split in splits:
        if sum(float(x) for x in split.split(",")) == 0:
            continue
        for n in counts:
            assert _same(megatron_core_split_indices(split, n),
                         split_ranges(parse_split(split), n)), (split, n)
            checked += 1
    assert checked > 30_000


def test_thirty_thousand_documents_where_the_legacy_rounding_differs():
    """The case that showed the bug: legacy rounding moves many boundaries; Core's does not."""
    rng, moved, total = random.Random(0), 0, 0
    for _ in range(500):
        weights = [rng.randint(1, 1000) for _ in range(3)]
        split = ",".join(map(str, weights))
        core = megatron_core_split_indices(split, 30_000)
        assert _same(core, split_ranges(weights, 30_000)), split
        moved += core != legacy_split_indices(weights, 30_000)
        total += 1
    assert moved > total // 10  # a test against the legacy formula would have caught it
    # by hand: 49 documents, 969,30,1: 0.969 * 49 = 47.48 -> 47; 0.999 * 49 = 48.95 -> 49
    assert split_ranges([969, 30, 1], 49) == [(0, 47), (47, 49), (49, 49)]
    assert legacy_split_indices([969, 30, 1], 49) == [(0, 48), (48, 49), (49, 49)]
    assert split_ranges([1, 1, 1], 1) == [(0, 0), (0, 1), (1, 1)]  # round(1/3) = 0


@pytest.mark.parametrize("text", ['"969,30,1"', "'969,30,1'", "969, 30, 1", "969/30/1",
                                  " 969,30,1 ", "969 30 1"])
def test_quoted_and_spaced_splits_read_as_megatron_reads_them(text):
    assert parse_split(text) == [969.0, 30.0, 1.0]


@pytest.mark.parametrize("text", ["1,2,3,4", "-1,2,0", "a,b", "0,0,0", "", "'inf,1'"])
def test_bad_splits_name_the_flag_and_the_form(text):
    with pytest.raises(ValueError, match=r"--split .*: give up to three non-negative weights "
                                         r"\(train,valid,test\) with a positive sum"):
        parse_split(text)


def test_a_quoted_split_from_a_shell_script_reaches_the_datasets(tmp_path):
    from gigatron.training.config.arguments import parse_flags
    from gigatron.training.config.table import build_settings
    from gigatron.training.config.validation import Problems, check_data

    prefix = str(tmp_path / "docs")
    builder = IndexedDatasetBuilder(prefix + ".bin", np.int32)
    for i in range(100):
        builder.add_document(np.arange(i, i + 20), [20])
    builder.finalize(prefix + ".idx")
    argv = ["--data-path", prefix, "--split", "'99,1,0'", "--tokenizer-type", "NullTokenizer",
            "--vocab-size", "200"]  # the argv element of "--split '99,1,0'" in a bash array
    data = build_settings(parse_flags(argv)).data
    p = Problems()
    check_data(data, p)
    assert not p, p.lines
    config = GPTDataConfig(seq_length=8, data_path=data.data_path, split=data.split,
                           eod=199, vocab_size=200)
    train, valid, test = build_train_valid_test_datasets(config, [10, 2, 0])
    assert train.num_documents == 99 and valid.num_documents == 1 and test is None
