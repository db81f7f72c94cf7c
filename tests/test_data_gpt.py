"""GPT samples: every token in order, one-token overlap, disjoint splits, exact blending,
resume from any consumed-sample count, one index build shared by all ranks."""
import os

import numpy as np
import pytest
from multirank import run_on_ranks

import gigatron.data.gpt_dataset as gpt_dataset_module
import gigatron.data.sample_index as sample_index
from gigatron.data import (GPTDataConfig, GPTDataset, IndexedDataset, IndexedDatasetBuilder,
                               PretrainingSampler, blend_indices, build_pretraining_data_loader,
                               build_train_valid_test_datasets, parse_data_path)
from gigatron.data.sample_index import build_gpt_indices, num_epochs_needed, samples_in_epochs
from gigatron.data.splits import split_ranges

SEQ = 16


def _unique_token_data(path, n_docs=60, seed=0, start=0, max_len=40):
    """Documents whose tokens are distinct numbers (token = its global position + start)."""
    rng = np.random.default_rng(seed)
    sizes = rng.integers(0, max_len, n_docs)  # includes empty documents
    builder = IndexedDatasetBuilder(path + ".bin", np.int32)
    pos = start
    for n in sizes:
        builder.add_document(np.arange(pos, pos + n), [n])
        pos += n
    builder.finalize(path + ".idx")
    return IndexedDataset(path)


def _unshuffled(ds):
    """Samples in stream order (undo the shuffle)."""
    order = np.argsort(np.asarray(ds.shuffle_index))
    return [ds.sample_tokens(int(i)) for i in order]


def test_every_token_of_the_split_appears_in_order_within_an_epoch(tmp_path):
    data = _unique_token_data(str(tmp_path / "d"))
    docs = np.arange(10, 50)
    tokens_per_epoch = int(data.sequence_lengths[docs].sum())
    n = samples_in_epochs(1, tokens_per_epoch, SEQ)
    ds = GPTDataset(data, docs, n, SEQ, seed=3, cache_dir=None)
    assert len(ds) == n
    samples = _unshuffled(ds)
    stream = np.concatenate([samples[0]] + [s[1:] for s in samples[1:]])
    epoch0 = np.asarray(ds.document_index[:len(docs)])
    assert sorted(epoch0.tolist()) == docs.tolist()  # each document once per epoch
    expected = np.concatenate([data.get(int(d)) for d in epoch0])
    # the epoch's tokens, in document order, then the start of the next epoch
    np.testing.assert_array_equal(stream[:tokens_per_epoch], expected)
    assert len(stream) >= tokens_per_epoch and len(stream) - tokens_per_epoch <= SEQ


def test_sample_boundaries_overlap_by_exactly_one_token(tmp_path):
    data = _unique_token_data(str(tmp_path / "d"))
    ds = GPTDataset(data, np.arange(60), 300, SEQ, seed=1, cache_dir=None)
    samples = _unshuffled(ds)
    assert all(len(s) == SEQ + 1 for s in samples)
    for a, b in zip(samples, samples[1:]):
        assert a[-1] == b[0]
        assert not set(a[:-1].tolist()) & set(b[1:].tolist())
    item = ds[0]
    np.testing.assert_array_equal(item["tokens"][1:], item["labels"][:-1])
    assert item["position_ids"].tolist() == list(range(SEQ))


def test_multiple_epochs_use_each_token_once_per_epoch_and_shuffle_within_epochs(tmp_path):
    data = _unique_token_data(str(tmp_path / "d"), n_docs=12)
    docs = np.arange(12)
    t = int(data.sequence_lengths.sum())
    ds = GPTDataset(data, docs, 5 * t // SEQ, SEQ, seed=0, cache_dir=None)
    epochs = num_epochs_needed(5 * t // SEQ, t, SEQ)
    stream = np.concatenate([s[:-1] for s in _unshuffled(ds)])
    for e in range(epochs):
        np.testing.assert_array_equal(np.sort(stream[e * t:(e + 1) * t]), np.arange(t))
    bounds = [samples_in_epochs(e, t, SEQ) for e in range(epochs + 1)]
    shuffle = np.asarray(ds.shuffle_index)
    for e in range(epochs):  # samples starting in epoch e stay in epoch e's block
        block = shuffle[bounds[e]:bounds[e + 1]]
        assert sorted(block.tolist()) == list(range(bounds[e], bounds[e + 1]))
    assert not np.array_equal(shuffle[:bounds[1]], np.arange(bounds[1]))


@pytest.mark.parametrize("few_documents", [1 << 16, 10])  # both document-shuffle paths
def test_sample_sequence_is_prefix_stable_and_a_pure_function_of_its_inputs(monkeypatch,
                                                                            few_documents):
    monkeypatch.setattr(sample_index, "FEW_DOCUMENTS", few_documents)
    sizes = np.random.default_rng(0).integers(1, 50, 200)
    docs = np.arange(200)
    small = build_gpt_indices(sizes, docs, SEQ, 100, seed=5)
    big = build_gpt_indices(sizes, docs, SEQ, 5000, seed=5)
    again = build_gpt_indices(sizes, docs, SEQ, 5000, seed=5)
    for a, b in zip(big, again):
        np.testing.assert_array_equal(a, b)
    n = len(small[2])
    np.testing.assert_array_equal(small[2], big[2][:n])  # same first samples
    np.testing.assert_array_equal(small[1][:n + 1], big[1][:n + 1])
    np.testing.assert_array_equal(small[0], big[0][:len(small[0])])
    other_seed = build_gpt_indices(sizes, docs, SEQ, 100, seed=6)
    assert not np.array_equal(other_seed[2], small[2])


def test_splits_do_not_overlap_and_cover_all_documents(tmp_path):
    assert split_ranges([949, 50, 1], 1000) == [(0, 949), (949, 999), (999, 1000)]
    assert split_ranges([98, 2], 10) == [(0, 10), (10, 10), (10, 10)]
    prefix = str(tmp_path / "d")
    _unique_token_data(prefix, n_docs=100)
    config = GPTDataConfig(seq_length=SEQ, seed=2, data_path=[prefix], split="80,15,5")
    train, valid, test = build_train_valid_test_datasets(config, [200, 30, 10])
    seen = []
    for ds in (train, valid, test):
        seen.append(set(np.concatenate([ds.sample_tokens(i) for i in range(len(ds))]).tolist()))
        assert set(np.asarray(ds.document_index).tolist()) <= set(range(100))
    assert not seen[0] & seen[1] and not seen[0] & seen[2] and not seen[1] & seen[2]
    docs = [set(np.asarray(ds.document_index).tolist()) for ds in (train, valid, test)]
    assert docs[0] | docs[1] | docs[2] == set(range(100))
    assert [len(d) for d in docs] == [80, 15, 5]
    assert max(docs[0]) < min(docs[1]) and max(docs[1]) < min(docs[2])


def test_blending_proportions_within_one_percent_in_every_1000_sample_window():
    for weights in ([0.3, 0.7], [0.5, 0.25, 0.125, 0.125], [0.91] + [0.01] * 9, [1, 2, 3]):
        w = np.asarray(weights, float) / np.sum(weights)
        dataset_index, sample_index = blend_indices(weights, 20_000)
        onehot = np.eye(len(w))[dataset_index]
        csum = np.concatenate([np.zeros((1, len(w))), np.cumsum(onehot, axis=0)])
        window = csum[1000:] - csum[:-1000]  # every window of 1000 consecutive samples
        assert np.abs(window / 1000 - w).max() <= 0.01, weights
        for d in range(len(w)):  # each dataset's samples are used in order, none skipped
            np.testing.assert_array_equal(sample_index[dataset_index == d],
                                          np.arange((dataset_index == d).sum()))


def test_blended_datasets_from_data_path_weights(tmp_path):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    _unique_token_data(a, n_docs=50, start=0)
    _unique_token_data(b, n_docs=50, seed=1, start=1_000_000)
    prefixes, weights = parse_data_path(["3", a, "7", b])
    assert prefixes == [a, b] and weights == pytest.approx([0.3, 0.7])
    with pytest.raises(ValueError, match="weight prefix"):
        parse_data_path(["0.3", a, b])
    config = GPTDataConfig(seq_length=SEQ, data_path=["0.3", a, "0.7", b], split="1,0,0")
    train, valid, test = build_train_valid_test_datasets(config, [2000, 0, 0])
    assert valid is None and test is None and len(train) == 2000
    from_b = np.array([train[i]["tokens"][0] >= 1_000_000 for i in range(2000)])
    for lo in range(0, 1001, 250):
        assert abs(from_b[lo:lo + 1000].mean() - 0.7) <= 0.01


def test_resume_from_consumed_samples_yields_exactly_the_following_samples():
    total, mbs, dp = 103, 2, 3
    full = [list(PretrainingSampler(total, 0, mbs, r, dp)) for r in range(dp)]
    order = [i for step in zip(*full) for batch in step for i in batch]
    assert order == list(range(len(order))) and len(order) == (total // (mbs * dp)) * mbs * dp
    for k in (0, 6, 12, 48, 96):
        resumed = [list(PretrainingSampler(total, k, mbs, r, dp)) for r in range(dp)]
        seq = [i for step in zip(*resumed) for batch in step for i in batch]
        assert seq == order[k:]
    with pytest.raises(ValueError, match="consumed_samples"):
        PretrainingSampler(10, 11, 1, 0, 1)


def test_global_batch_contents_do_not_depend_on_data_parallel_size(tmp_path):
    config = GPTDataConfig(seq_length=SEQ, mock_data=True, eod=99, vocab_size=100, split="1,0,0")
    train, _, _ = build_train_valid_test_datasets(config, [64, 0, 0])
    global_batch = 8

    def global_batches(dp, consumed):
        loaders = [iter(build_pretraining_data_loader(train, consumed, global_batch // dp // 2,
                                                      r, dp)) for r in range(dp)]
        out = []
        for _ in range(2):  # two micro-batches per rank make one global batch
            out += [next(loader)["tokens"] for loader in loaders]
        return sorted(map(tuple, np.concatenate([t.numpy() for t in out]).tolist()))

    for consumed in (0, 16):
        assert global_batches(1, consumed) == global_batches(2, consumed) == \
            global_batches(4, consumed)
    resumed = iter(build_pretraining_data_loader(train, 8, 4, 0, 1))
    for step in range(3):  # resuming at 8 consumed samples reads samples 8, 9, 10, ...
        batch = next(resumed)["tokens"].numpy()
        for row in range(4):
            np.testing.assert_array_equal(batch[row], train[8 + 4 * step + row]["tokens"])


def test_loader_workers_megatron_default_two_give_the_same_batches_and_none_in_daemons():
    import itertools
    import multiprocessing

    from gigatron.data.samplers import usable_workers

    config = GPTDataConfig(seq_length=SEQ, mock_data=True, eod=99, vocab_size=100, split="1,0,0")
    train, _, _ = build_train_valid_test_datasets(config, [40, 0, 0])
    batches = {n: [b["tokens"].tolist() for b in itertools.islice(
        build_pretraining_data_loader(train, 4, 4, 0, 1, num_workers=n), 9)] for n in (0, 2)}
    assert batches[0] == batches[2] and len(batches[0]) == 9
    assert usable_workers(2) == 2
    with multiprocessing.get_context("fork").Pool(1) as pool:  # pool workers are daemons
        assert pool.apply(usable_workers, (2,)) == 0


def test_eod_mask_loss_zeroes_loss_on_eod_inputs():
    config = GPTDataConfig(seq_length=64, mock_data=True, eod=7, vocab_size=50, split="1,0,0",
                           eod_mask_loss=True)
    train, _, _ = build_train_valid_test_datasets(config, [50, 0, 0])
    items = [train[i] for i in range(50)]
    assert any((it["tokens"] == 7).any() for it in items)
    for it in items:
        np.testing.assert_array_equal(it["loss_mask"] == 0, it["tokens"] == 7)


def test_mock_data_is_deterministic_and_in_vocab():
    config = GPTDataConfig(seq_length=SEQ, mock_data=True, eod=255, vocab_size=256, seed=4)
    a = build_train_valid_test_datasets(config, [100, 10, 0])
    b = build_train_valid_test_datasets(config, [100, 10, 0])
    for i in range(100):
        np.testing.assert_array_equal(a[0][i]["tokens"], b[0][i]["tokens"])
        assert 0 <= a[0][i]["tokens"].min() and a[0][i]["tokens"].max() <= 255
    assert a[2] is None


def test_separate_train_valid_test_paths_use_whole_files(tmp_path):
    t, v = str(tmp_path / "t"), str(tmp_path / "v")
    _unique_token_data(t, n_docs=30)
    _unique_token_data(v, n_docs=10, start=10_000_000)
    config = GPTDataConfig(seq_length=SEQ, train_data_path=[t], valid_data_path=[v])
    train, valid, test = build_train_valid_test_datasets(config, [100, 20, 5])
    assert test is None
    assert set(np.asarray(train.document_index).tolist()) == set(range(30))
    assert valid[0]["tokens"].min() >= 10_000_000
    with pytest.raises(ValueError, match="exclusive"):
        GPTDataConfig(seq_length=SEQ, data_path=[t], train_data_path=[t]).validate()
    with pytest.raises(ValueError, match="--mock-data"):
        GPTDataConfig(seq_length=SEQ).validate()


def test_indices_are_cached_next_to_the_data_and_reused(tmp_path, monkeypatch):
    prefix = str(tmp_path / "d")
    _unique_token_data(prefix)
    config = GPTDataConfig(seq_length=SEQ, data_path=[prefix], split="1,0,0")
    first = build_train_valid_test_datasets(config, [100, 0, 0])[0]
    files = sorted(f for f in os.listdir(tmp_path) if f.endswith(".npy"))
    assert len(files) == 3 and all(f.startswith("d_train_") for f in files)

    def must_not_build(*args, **kwargs):
        raise AssertionError("indices rebuilt although cached")

    monkeypatch.setattr(gpt_dataset_module, "build_gpt_indices", must_not_build)
    second = build_train_valid_test_datasets(config, [100, 0, 0])[0]
    np.testing.assert_array_equal(first.shuffle_index, second.shuffle_index)
    original_seed, config.seed = config.seed, 99  # a different key: must build anew
    with pytest.raises(AssertionError, match="rebuilt"):
        build_train_valid_test_datasets(config, [100, 0, 0])
    config.seed = original_seed
    build_train_valid_test_datasets(config, [100, 0, 0])  # still cached
    _unique_token_data(prefix, seed=5)  # same name, different documents: stale cache unused
    with pytest.raises(AssertionError, match="rebuilt"):
        build_train_valid_test_datasets(config, [100, 0, 0])


def _ranks_share_one_build(rank, world_size, prefix):
    import hashlib

    import gigatron.data.gpt_dataset as module
    from gigatron.data import GPTDataConfig, build_train_valid_test_datasets

    calls = []
    real = module.build_gpt_indices
    module.build_gpt_indices = lambda *a, **k: (calls.append(1), real(*a, **k))[1]
    config = GPTDataConfig(seq_length=SEQ, data_path=[prefix], split="90,10,0", seed=11)
    train, valid, _ = build_train_valid_test_datasets(config, [300, 40, 0], group=None)
    digest = hashlib.md5(np.concatenate([train.sample_tokens(i) for i in range(300)] +
                                        [valid.sample_tokens(i) for i in range(40)]).tobytes())
    return len(calls), digest.hexdigest()


def test_indices_built_once_by_rank_zero_while_other_ranks_wait(tmp_path):
    prefix = str(tmp_path / "d")
    _unique_token_data(prefix, n_docs=200)
    results = run_on_ranks(_ranks_share_one_build, 4, prefix)
    assert [calls for calls, _ in results] == [2, 0, 0, 0]  # train and valid, on rank 0 only
    assert len({digest for _, digest in results}) == 1
    single = GPTDataConfig(seq_length=SEQ, data_path=[prefix], split="90,10,0", seed=11)
    train, valid, _ = build_train_valid_test_datasets(single, [300, 40, 0])
    import hashlib
    digest = hashlib.md5(np.concatenate([train.sample_tokens(i) for i in range(300)] +
                                        [valid.sample_tokens(i) for i in range(40)]).tobytes())
    assert digest.hexdigest() == results[0][1]


def test_index_cache_files_respect_the_umask(tmp_path):
    """A shared cache folder: the .npy files get the mode a plain open() would (0666 minus the
    umask), not mkstemp's 0600 that locks other users out."""
    import stat

    from gigatron.data.index_cache import cached_indices

    old = os.umask(0o022)
    try:
        cached_indices(["a"], lambda: {"a": np.arange(3)}, {"k": 1}, str(tmp_path), "t")
    finally:
        os.umask(old)
    files = [f for f in os.listdir(tmp_path) if f.endswith(".npy")]
    assert files and all(stat.S_IMODE(os.stat(tmp_path / f).st_mode) == 0o644 for f in files)
