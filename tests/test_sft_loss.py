"""--sft trains on exactly transformers' loss: the loss pretrain_gpt.py logs for a packed line
of conversations (a tiny random Llama converted with hf-to-gigatron, loaded with --finetune
--use-checkpoint-args) equals transformers' loss of the same model on each conversation alone
with labels on the assistant tokens only (1e-4), and tp2, pp2, dp2, cp2 (p2p), tp2 with
sequence parallelism, cp2 x tp2 with sequence parallelism and cp4 as a2a+p2p 2 x 2 (each
conversation split per document) log the one-rank losses."""
import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from multirank import run_on_ranks  # noqa: E402
from tests.sft_fixtures import CHATML, conversation, make_chat_tokenizer, write_jsonl  # noqa: E402

ITERS = 3
SEQ = 192


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """(folder: the HF model and tokenizer, gigatron checkpoint, conversations file, the
    transformers model)."""
    from gigatron.training.checkpoint.convert import hf_to_gigatron

    root = tmp_path_factory.mktemp("sft")
    folder = make_chat_tokenizer(root / "base", vocab_size=280)
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=len(tok), hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
        tie_word_embeddings=False, rope_theta=10000.0)).eval()
    with torch.no_grad():  # sharper attention than the initial std's: documents matter
        for p in hf.parameters():
            p.normal_(0.0, 0.3) if p.dim() == 2 else p.add_(0.1 * torch.randn_like(p))
    hf.save_pretrained(folder)
    hf_to_gigatron(folder, str(root / "ckpt"))
    # a line of two conversations (documents), then lines of one
    lines = [conversation(0) + conversation(1, turns=2)] + [conversation(i) for i in range(2, 8)]
    data = write_jsonl(root / "chat.jsonl", lines)
    return folder, str(root / "ckpt"), data, hf, lines


def _argv(base, metrics):
    folder, ckpt, data, _, _ = base
    return (f"--sft --load {ckpt} --finetune --use-checkpoint-args --data-path {data} "
            f"--split 100,0,0 --tokenizer-type HuggingFaceTokenizer --tokenizer-model {folder} "
            f"--seq-length {SEQ} --micro-batch-size 1 --global-batch-size 2 "
            f"--train-iters {ITERS} --lr 1e-2 --lr-warmup-iters 0 --eval-iters 0 "
            f"--hidden-dropout 0 --attention-dropout 0 --log-interval 1 --metrics-file {metrics}"
            ).split()


def _pretrain(rank, world, argv):
    from gigatron.training.run import pretrain

    assert pretrain.main(argv) == 0


def _losses(path):
    with open(path) as f:
        return [r["lm loss"] for r in map(json.loads, f) if r["type"] == "train"]


def _transformers_loss(hf, folder, conversations):
    """Token-weighted mean of transformers' loss over the conversations, each alone, labels
    on the assistant tokens only."""
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    total, count = 0.0, 0
    for conv in conversations:
        out = tok.apply_chat_template(conv, return_dict=True, return_assistant_tokens_mask=True)
        ids = torch.tensor([out["input_ids"]])
        labels = torch.where(torch.tensor([out["assistant_masks"]]) > 0, ids, -100)
        n = int((labels[0, 1:] != -100).sum())
        with torch.no_grad():
            total += hf(ids, labels=labels).loss.item() * n
        count += n
    return total / count


@pytest.fixture(scope="module")
def one_rank(base, tmp_path_factory):
    folder = tmp_path_factory.mktemp("one")
    metrics, save = str(folder / "metrics.jsonl"), str(folder / "sft")
    run_on_ranks(_pretrain, 1, _argv(base, metrics) + ["--save", save, "--save-interval",
                                                        str(ITERS)], timeout=300)
    return _losses(metrics), save


def test_sft_loss_equals_transformers_loss_on_assistant_tokens(base, one_rank):
    folder, _, _, hf, lines = base
    losses, _ = one_rank
    from gigatron.data.sft.conversations import split_conversations

    first_batch = split_conversations(lines[0]) + split_conversations(lines[1])
    # the logged loss is Megatron's: the global batch's loss sum over its loss tokens
    want = _transformers_loss(hf, folder, first_batch)
    assert len(first_batch) == 3 and len(losses) == ITERS
    assert abs(losses[0] - want) <= 1e-4 * abs(want), (losses[0], want)


LAYOUTS = {"tp2": (2, "--tensor-model-parallel-size 2"),
           "pp2": (2, "--pipeline-model-parallel-size 2"), "dp2": (2, ""),
           "cp2": (2, "--context-parallel-size 2"),
           "tp2_sp": (2, "--tensor-model-parallel-size 2 --sequence-parallel"),
           # each conversation padded to 2 x cp, split per document, then each cp rank's
           # tokens split over tp
           "cp2_tp2_sp": (4, "--context-parallel-size 2 --tensor-model-parallel-size 2 "
                             "--sequence-parallel"),
           "cp4_a2a_p2p_2x2": (4, "--context-parallel-size 4 --cp-comm-type a2a+p2p "
                                  "--hierarchical-context-parallel-sizes 2 2")}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_sft_layouts_log_the_one_rank_losses(base, one_rank, tmp_path, layout):
    ranks, flags = LAYOUTS[layout]
    metrics = str(tmp_path / "metrics.jsonl")
    run_on_ranks(_pretrain, ranks, _argv(base, metrics) + flags.split(), timeout=300)
    losses = _losses(metrics)
    error = max(abs(a - b) / abs(b) for a, b in zip(losses, one_rank[0]))
    assert len(losses) == ITERS and error <= 1e-5, (layout, losses, one_rank[0])


def test_the_sft_checkpoint_exports_with_its_chat_template(base, one_rank, tmp_path):
    """gigatron-to-hf writes the tokenizer's chat template: transformers loads the folder and
    answers a chat prompt (greedy) as gigatron's model of the checkpoint does."""
    from gigatron.models.generation import generate
    from gigatron.training.checkpoint.convert import gigatron_to_hf, load_model
    from gigatron.models.gpt import GPTModel

    out = str(tmp_path / "hf")
    gigatron_to_hf(one_rank[1], out)
    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert tok.chat_template == CHATML
    prompt = tok.apply_chat_template(conversation(9)[:2], add_generation_prompt=True,
                                     return_tensors="pt", return_dict=True)["input_ids"]
    assert prompt[0, -3:].tolist() == tok.encode("<|im_start|>assistant\n")[-3:]
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    hf_tokens = hf.generate(prompt, max_new_tokens=6, do_sample=False)[0, prompt.shape[1]:]
    config, state = load_model(one_rank[1])
    model = GPTModel(config)
    model.load_state_dict(state)
    ours = generate(model.eval(), [prompt[0].tolist()], max_new_tokens=6).tokens[0]
    assert len(hf_tokens) >= 1 and ours[:len(hf_tokens)] == hf_tokens.tolist()


def test_sft_gradient_equals_transformers_gradient(base):
    """One packed line's gradient (gigatron's GPTModel on the --sft sample, documents and
    loss mask as the data gives them) is transformers' gradient of the same conversations'
    assistant-token loss, tensor by tensor (relative 1e-5)."""
    from gigatron.data.builder import GPTDataConfig, build_train_valid_test_datasets
    from gigatron.data.sft.conversations import split_conversations
    from gigatron.models.gpt import GPTModel
    from gigatron.models.hf_convert import state_dict_from_hf
    from gigatron.training.checkpoint.convert import load_model

    folder, ckpt, data, hf, lines = base
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    config = GPTDataConfig(seq_length=SEQ, data_path=[data], split="100,0,0", sft=True,
                           tokenizer_model=folder, eod=tok.eos_token_id)
    sample = build_train_valid_test_datasets(config, [1, 0, 0])[0][0]
    batch = {k: torch.from_numpy(v)[None] for k, v in sample.items()}
    model_config, state = load_model(ckpt)
    model = GPTModel(model_config)
    model.load_state_dict(state)
    loss = model(batch["tokens"], position_ids=batch["position_ids"], labels=batch["labels"],
                 cu_seqlens=batch["cu_seqlens"])
    ((loss * batch["loss_mask"]).sum() / batch["loss_mask"].sum()).backward()

    hf.zero_grad()
    total, count = 0.0, 0
    for conv in split_conversations(lines[0]):
        out = tok.apply_chat_template(conv, return_dict=True, return_assistant_tokens_mask=True)
        ids = torch.tensor([out["input_ids"]])
        labels = torch.where(torch.tensor([out["assistant_masks"]]) > 0, ids, -100)
        n = int((labels[0, 1:] != -100).sum())
        total, count = total + hf(ids, labels=labels).loss * n, count + n
    (total / count).backward()
    with open(f"{folder}/config.json") as f:
        hf_grads = state_dict_from_hf({n: p.grad for n, p in hf.named_parameters()},
                                      json.load(f))[1]
    for name, p in model.named_parameters():
        want = hf_grads[name]
        got = p.grad[:want.shape[0]]  # the padded vocabulary's rows are not tokens
        assert ((got - want).norm() / want.norm()).item() <= 1e-5, name
