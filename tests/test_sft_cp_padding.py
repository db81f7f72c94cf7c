"""--sft under context parallelism: each conversation padded (pad id, no loss) to a multiple of
2 x cp, as Megatron-LM's --sft does, so every document splits per document over the cp ranks
(parallel/context/split.py's rule holds)."""
import numpy as np
import pytest

from gigatron.data.sft.packing import pack_conversations
from gigatron.parallel.context.split import document_split_applies

EOD, PAD = 1, 0


def _conversation(n, first=10):
    ids = np.arange(first, first + n, dtype=np.int64)
    return ids, np.arange(n) >= n // 2  # the second half is the assistant's


def test_each_conversation_is_padded_to_a_multiple_of_2cp_without_loss():
    convs = [_conversation(5), _conversation(2, first=20)]  # 6 and 3 tokens with the eod
    plain, _ = pack_conversations(convs, 24, EOD, PAD)
    sample, stats = pack_conversations(convs, 24, EOD, PAD, pad_multiple=4)
    assert plain["cu_seqlens"][:3].tolist() == [0, 6, 9]
    assert not document_split_applies(plain["cu_seqlens"], 2)
    assert sample["cu_seqlens"][:4].tolist() == [0, 8, 12, 24]
    assert document_split_applies(sample["cu_seqlens"], 2)
    assert sample["tokens"][:12].tolist() == [10, 11, 12, 13, 14, EOD, PAD, PAD,
                                              20, 21, EOD, PAD]
    assert sample["position_ids"][:12].tolist() == list(range(8)) + list(range(4))
    assert sample["loss_mask"][5:8].tolist() == [0, 0, 0]  # eod input and padding
    # the real tokens' loss is unchanged
    assert sample["loss_mask"][:5].tolist() == plain["loss_mask"][:5].tolist()
    assert sample["loss_mask"][8:11].tolist() == plain["loss_mask"][6:9].tolist()
    assert (stats.truncated, stats.dropped) == (0, 0)


def test_cutting_only_the_padding_truncates_nothing():
    sample, stats = pack_conversations([_conversation(6), _conversation(3)], 8, EOD, PAD,
                                       pad_multiple=4)  # 7 tokens padded to 8 fill it
    assert sample["cu_seqlens"].tolist()[:2] == [0, 8]
    assert (stats.truncated, stats.dropped) == (0, 1)
    _, stats = pack_conversations([_conversation(9)], 8, EOD, PAD, pad_multiple=4)
    assert (stats.truncated, stats.dropped) == (1, 0)


def test_the_sft_datasets_pad_under_cp(tmp_path):
    pytest.importorskip("transformers")
    from gigatron.data.builder import GPTDataConfig, build_train_valid_test_datasets
    from gigatron.data.sft.chat_template import ChatTemplateTokenizer
    from tests.sft_fixtures import conversation, make_chat_tokenizer, write_jsonl

    folder = make_chat_tokenizer(tmp_path / "tok")
    chat = ChatTemplateTokenizer(folder)
    data = write_jsonl(tmp_path / "c.jsonl", [conversation(i) + conversation(i + 1)
                                              for i in range(4)])
    lengths = {}
    for cp in (1, 2):
        config = GPTDataConfig(seq_length=128, data_path=[data], split="1,0,0", sft=True,
                               tokenizer_model=folder, eod=chat.tokenizer.eos_token_id,
                               vocab_size=len(chat.tokenizer), context_parallel_size=cp)
        train, _, _ = build_train_valid_test_datasets(config, [4, 0, 0])
        lengths[cp] = [np.diff(train[i]["cu_seqlens"]) for i in range(4)]
    assert all(document_split_applies(np.cumsum([0, *d]), 2) for d in lengths[2])
    assert not all(document_split_applies(np.cumsum([0, *d]), 2) for d in lengths[1])


def test_the_run_hands_cp_to_the_data(tmp_path):
    pytest.importorskip("transformers")
    from gigatron.training.config.arguments import parse_args
    from tests.sft_fixtures import conversation, make_chat_tokenizer, write_jsonl

    folder = make_chat_tokenizer(tmp_path / "tok")
    data = write_jsonl(tmp_path / "c.jsonl", [conversation(i) for i in range(4)])
    run = parse_args(("--num-layers 2 --hidden-size 32 --num-attention-heads 4 "
                      "--seq-length 16 --micro-batch-size 2 --train-iters 10 --lr 1e-3 "
                      "--context-parallel-size 2 --attention-dropout 0 --sft "
                      f"--tokenizer-type HuggingFaceTokenizer --tokenizer-model {folder} "
                      f"--data-path {data}").split(), 2)
    assert run.data.context_parallel_size == 2
