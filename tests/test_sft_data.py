"""--sft data: conversations from JSON lines, tokenized with the tokenizer's chat template,
the loss on the assistant's tokens (transformers' assistant mask of {% generation %} blocks,
or the stated rule without them), a line's conversations packed as documents (cu_seqlens,
restarting positions), what the sequence length cuts counted, bad data in one line each."""
import numpy as np
import pytest

pytest.importorskip("transformers")

from gigatron.data.builder import (GPTDataConfig, build_train_valid_test_datasets,  # noqa: E402
                                   describe_datasets)
from gigatron.data.sft.chat_template import FALLBACK_RULE, ChatTemplateTokenizer  # noqa: E402
from gigatron.data.sft.conversations import SFTDataError, read_conversations  # noqa: E402
from gigatron.data.sft.dataset import SFTDataset  # noqa: E402
from gigatron.data.sft.packing import pack_conversations  # noqa: E402
from tests.sft_fixtures import (CHATML, CHATML_PLAIN, conversation,  # noqa: E402
                                make_chat_tokenizer, write_jsonl)


@pytest.fixture(scope="module")
def chat(tmp_path_factory):
    return ChatTemplateTokenizer(make_chat_tokenizer(tmp_path_factory.mktemp("chatml")))


def _decode(chat, ids):
    return chat.tokenizer.decode([int(i) for i in ids])


def test_the_loss_is_on_the_assistant_replies_and_their_end_of_turn(chat):
    conv = conversation(3, turns=2)
    ids, assistant = chat.tokenize(conv)
    hf = chat.tokenizer.apply_chat_template(conv, return_dict=True,
                                            return_assistant_tokens_mask=True)
    assert ids.tolist() == hf["input_ids"] and assistant.tolist() == hf["assistant_masks"]
    sample, stats = pack_conversations([(ids, assistant)], 128, chat.tokenizer.eos_token_id,
                                       chat.pad)
    learned = sample["labels"][sample["loss_mask"] > 0]
    assert _decode(chat, learned) == "".join(m["content"] + "<|im_end|>" for m in conv
                                             if m["role"] == "assistant")
    assert (stats.truncated, stats.dropped) == (0, 0)


def test_a_template_without_generation_blocks_counts_each_rendered_assistant_turn(tmp_path):
    plain = ChatTemplateTokenizer(make_chat_tokenizer(tmp_path / "plain", CHATML_PLAIN))
    # the rule's tokens: the reply, its end-of-turn token and the newline the template adds
    with_newline = CHATML.replace("{% endgeneration %}{{ '\n' }}",
                                  "{{ '\n' }}{% endgeneration %}")
    assert with_newline != CHATML
    marked = ChatTemplateTokenizer(make_chat_tokenizer(tmp_path / "marked", with_newline))
    assert not plain.has_generation_blocks and marked.has_generation_blocks
    for i in range(4):
        conv = conversation(i, turns=1 + i % 3)
        ids, assistant = plain.tokenize(conv)
        ids2, assistant2 = marked.tokenize(conv)
        assert ids.tolist() == ids2.tolist() and assistant.tolist() == assistant2.tolist()
        assert assistant.any()
    data = write_jsonl(tmp_path / "c.jsonl", [conversation(i) for i in range(10)])
    config = GPTDataConfig(seq_length=64, data_path=[data], split="8,2,0", sft=True,
                           tokenizer_model=str(tmp_path / "plain"), eod=0)
    lines = describe_datasets(build_train_valid_test_datasets(config, [8, 2, 0]))
    assert [line for line in lines if "generation" in line] == [f"data: {FALLBACK_RULE}"]


def test_a_line_packs_its_conversations_as_documents(chat):
    eod, convs = chat.tokenizer.eos_token_id, [conversation(1), conversation(2, turns=2)]
    parts = [chat.tokenize(c) for c in convs]
    sample, _ = pack_conversations(parts, 160, eod, chat.pad)
    n = [len(ids) + 1 for ids, _ in parts]  # the template ends with "\n": eod appended
    assert sample["cu_seqlens"].tolist() == [0, n[0], n[0] + n[1]] + [160] * 158
    stream = np.concatenate([parts[0][0], [eod], parts[1][0], [eod]])
    assert sample["tokens"][:len(stream)].tolist() == stream.tolist()
    assert (sample["tokens"][len(stream):] == chat.pad).all()
    assert sample["position_ids"][:n[0] + 2].tolist() == list(range(n[0])) + [0, 1]
    # no loss across a boundary, on the appended eod or on padding
    last = [n[0] - 1, n[0] - 2, n[0] + n[1] - 1, n[0] + n[1] - 2]
    assert (sample["loss_mask"][last] == 0).all()
    assert (sample["loss_mask"][n[0] + n[1]:] == 0).all()
    want = [a[1:] for _, a in parts]  # per conversation: label t+1 is an assistant token
    got = sample["loss_mask"]
    assert got[:n[0] - 2].tolist() == want[0].astype(np.float32).tolist()
    assert got[n[0]:n[0] + n[1] - 2].tolist() == want[1].astype(np.float32).tolist()


def test_what_the_sequence_length_cuts_is_counted_and_said_once(chat):
    eod = chat.tokenizer.eos_token_id
    line = [chat.tokenize(conversation(i, turns=3)) for i in range(3)]
    seq = len(line[0][0]) + 5  # the second conversation is cut, the third left out
    dataset = SFTDataset([line, line[:1]], 4, seq, eod, chat.pad, "convs.jsonl")
    assert (dataset.stats.truncated, dataset.stats.dropped) == (1, 1)
    assert "truncates 1 and drops 1 conversation(s)" in dataset.describe()
    assert describe_datasets([dataset, None, None])[0].startswith(
        "data train: 4 samples from 2 lines, 4 conversations, ")
    sample = dataset[0]
    assert sample["cu_seqlens"][:3].tolist() == [0, len(line[0][0]) + 1, seq]
    assert dataset[1]["tokens"].tolist() == dataset[3]["tokens"].tolist()  # lines cycle


def test_bad_lines_are_one_line_each_naming_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"messages": [{"role": "user", "content": "hi"}, '
                    '{"role": "assistant", "content": "yo"}]}\n'
                    '{"text": "no messages here"}\n'
                    '{"messages": [{"role": "user", "content": "hi"}, '
                    '{"role": "bot", "content": "yo"}]}\n'
                    'not json\n')
    with pytest.raises(SFTDataError) as err:
        read_conversations(str(path))
    assert err.value.problems == [
        f'{path}:2: no "messages" (each line is {{"messages": [{{"role": ..., "content": ...}}'
        f', ...]}})',
        f"{path}:3: turn 1 has the unknown role 'bot' (roles: system, user, assistant)",
        f"{path}:4: not JSON (Expecting value at column 1)"]


def test_a_tokenizer_without_chat_template_is_one_line(tmp_path):
    folder = make_chat_tokenizer(tmp_path / "bare", template=None)
    with pytest.raises(ValueError) as err:
        ChatTemplateTokenizer(folder)
    assert str(err.value) == (
        f"--tokenizer-model {folder}: the tokenizer has no chat template (--sft tokenizes "
        f"conversations with it): add chat_template.jinja, or 'chat_template' in "
        f"tokenizer_config.json, to {folder}")


def test_split_holds_out_lines_for_validation(tmp_path, chat):
    folder = make_chat_tokenizer(tmp_path / "tok")
    data = write_jsonl(tmp_path / "c.jsonl", [conversation(i) + conversation(i + 1)
                                              for i in range(10)])
    config = GPTDataConfig(seq_length=64, data_path=[data], split="8,2,0", sft=True,
                           tokenizer_model=folder, eod=chat.tokenizer.eos_token_id,
                           vocab_size=len(chat.tokenizer))
    train, valid, test = build_train_valid_test_datasets(config, [12, 4, 0])
    assert (len(train), len(valid), test) == (12, 4, None)
    assert len(train.lines) == 8 and len(valid.lines) == 2
    first_valid = chat.tokenize(conversation(8))[0]
    assert valid[0]["tokens"][:len(first_valid)].tolist() == first_valid.tolist()


def test_sft_flag_problems_are_one_line_each(tmp_path):
    from gigatron.training.config.arguments import parse_args
    from gigatron.training.config.validation import ConfigError

    base = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
            "--micro-batch-size 2 --train-iters 10 --lr 1e-3 --vocab-size 100").split()
    missing = str(tmp_path / "missing.jsonl")
    with pytest.raises(ConfigError) as err:
        parse_args(base + ["--sft", "--data-path", missing, "--tokenizer-type",
                           "NullTokenizer", "--reset-position-ids"], 1)
    assert err.value.problems == [
        "--sft already restarts positions and attention at each conversation: drop "
        "--reset-position-ids",
        "--sft tokenizes with a chat template: give --tokenizer-type HuggingFaceTokenizer "
        "--tokenizer-model DIR (a Hugging Face tokenizer folder), not NullTokenizer",
        f"--data-path {missing}: no such file (--sft reads JSON-lines conversation files, "
        f"e.g. data/chat.jsonl)"]


def test_every_pipeline_stage_reads_the_conversations_boundaries():
    """A middle pipeline stage (neither inputs nor labels) still attends within the packed
    conversations: its micro-batches carry cu_seqlens and the restarting positions."""
    from types import SimpleNamespace

    import torch

    from gigatron.training.run.builders import micro_batches

    conv = (np.arange(1, 9, dtype=np.int64), np.arange(8) % 2 == 0)
    dataset = SFTDataset([[conv, conv]], 4, 24, 0, 0, "convs.jsonl")
    run = SimpleNamespace(data=GPTDataConfig(seq_length=24, sft=True),
                          train=SimpleNamespace(micro_batch_size=2, num_workers=0, seed=1),
                          parallel=SimpleNamespace(dp=1, context_parallel_size=1,
                                                    cp_comm_type="p2p"))
    middle = SimpleNamespace(needs_inputs=False, needs_labels=False)
    batch = next(iter(micro_batches(run, dataset, 0, 0, torch.device("cpu"), middle)))
    assert batch["cu_seqlens"][0, :4].tolist() == [0, 9, 18, 24]
    assert batch["position_ids"][0, 9:12].tolist() == [0, 1, 2]


def test_a_checkpoint_records_the_conversation_files_themselves(tmp_path):
    """gigatron evaluate/generate of an --sft checkpoint: the recorded --data-path is a
    file, not a .bin/.idx prefix."""
    from gigatron.training.checkpoint.recorded_paths import missing_recorded_paths

    data = write_jsonl(tmp_path / "c.jsonl", [conversation(0)])
    flags = {"sft": True, "data_path": [data], "tokenizer_type": "HuggingFaceTokenizer"}
    assert missing_recorded_paths(flags, {"tokenizer_type"}, "ckpt") == []
    gone = str(tmp_path / "gone.jsonl")
    assert missing_recorded_paths({**flags, "data_path": [gone]}, {"tokenizer_type"},
                                  "ckpt") == [
        f"checkpoint ckpt records --data-path prefix {gone}, but {gone} does not exist: give "
        f"--data-path PREFIX (or --train-data-path ...; a data flag replaces the checkpoint's "
        f"data)"]
