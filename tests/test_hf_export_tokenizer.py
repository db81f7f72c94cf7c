"""`gigatron convert gigatron-to-hf` of a run's checkpoint gives a folder transformers uses as
is: `AutoTokenizer.from_pretrained` encodes real text to the ids pretraining used (a
SentencePiece and a GPT-2 BPE tokenizer, as the checkpoint's flags name them), config.json
holds the tokenizer's bos/eos ids, `pipeline("text-generation", folder)` generates gigatron's
greedy tokens, and the weights file is readable by others (the umask's mode, not 0600)."""
import json
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")

from gigatron.data.sentencepiece_trainer import list_text_files, train_sentencepiece  # noqa: E402
from gigatron.data.tokenizer import build_tokenizer  # noqa: E402
from gigatron.models.config import TransformerConfig  # noqa: E402
from gigatron.models.generation import generate  # noqa: E402
from gigatron.models.gpt import GPTModel  # noqa: E402
from gigatron.models.hf_common import ConversionError  # noqa: E402
from gigatron.training.checkpoint.convert import (  # noqa: E402
    gigatron_to_hf, hf_to_gigatron, model_flags, parse_model_flags)

STDLIB = os.path.dirname(os.__file__)
CORPUS_DIRS = [os.path.join(STDLIB, d) for d in ("json", "email", "http")]
UNUSUAL = (" leading space, two  spaces\tand a tab\n\nGrüße, 東京! naïve — ünïcödé 🙂 12345 "
           "</s> <s> <|endoftext|> trailing ")


@pytest.fixture(scope="module")
def real_text():
    """Text the tokenizers were not trained on, with leading spaces and special-token text."""
    with open(os.path.join(STDLIB, "textwrap.py"), encoding="utf-8") as f:
        return f.read() + UNUSUAL


@pytest.fixture(scope="module")
def tokenizers_of_runs(tmp_path_factory):
    """{name: the tokenizer flags of a run}: SentencePiece (gigatron train-tokenizer) and a
    GPT-2-style byte-level BPE (vocab.json + merges.txt)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    folder = tmp_path_factory.mktemp("tokenizers")
    spm = train_sentencepiece(CORPUS_DIRS, str(folder / "spm"), vocab_size=700,
                              input_sentence_size=20000, max_bytes=1_000_000, suffixes=[".py"])
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train(list_text_files(CORPUS_DIRS, [".py"]), trainers.BpeTrainer(
        vocab_size=700, special_tokens=["<|endoftext|>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    vocab, merges = bpe.model.save(str(folder))
    return {"sentencepiece": {"tokenizer_type": "SentencePieceTokenizer",
                              "tokenizer_model": spm},
            "gpt2_bpe": {"tokenizer_type": "GPT2BPETokenizer", "vocab_file": vocab,
                         "merge_file": merges}}


def _model_config(vocab, family):
    common = dict(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=vocab,
                  seq_length=64, max_position_embeddings=64, hidden_dropout=0.0,
                  attention_dropout=0.0)
    if family == "llama":
        return TransformerConfig(**common, position_embedding_type="rope",
                                 normalization="RMSNorm", activation="swiglu",
                                 add_bias_linear=False, num_query_groups=2,
                                 untie_embeddings_and_output_weights=True)
    return TransformerConfig(**common, activation="gelu_tanh")


def _run_checkpoint(root, tokenizer_flags, family):
    """A checkpoint as pretraining saves it: the weights (vocabulary rows unpadded) and the
    run's flags, tokenizer included; returns (model, tokenizer)."""
    import gigatron.training.checkpoint.torch_dist.save_load as dist_checkpoint

    tokenizer = build_tokenizer(**tokenizer_flags)
    config = _model_config(tokenizer.vocab_size, family)
    torch.manual_seed(0)
    model = GPTModel(config).eval()
    with torch.no_grad():  # confident, far-apart logits: greedy choices are not near-ties
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    state = {k: v[:config.vocab_size] if k.endswith(("word_embeddings.weight",
                                                      "output_layer.weight")) else v
             for k, v in model.state_dict().items()}
    flags = {**parse_model_flags(model_flags(config)), **tokenizer_flags, "vocab_size": None}
    dist_checkpoint.save_global_model(state, root, 10, {"flags": flags})
    return model, tokenizer


@pytest.mark.parametrize("name, family", [("sentencepiece", "gpt2"), ("gpt2_bpe", "llama")])
def test_exported_folder_tokenizes_and_generates_as_gigatron(tmp_path, tokenizers_of_runs,
                                                             real_text, name, family):
    model, tokenizer = _run_checkpoint(str(tmp_path / "run"), tokenizers_of_runs[name], family)
    out = str(tmp_path / "hf")
    hf_config, line = gigatron_to_hf(str(tmp_path / "run"), out)
    assert line.startswith(f"tokenizer: {tokenizers_of_runs[name]['tokenizer_type']}")

    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    for text in (real_text, UNUSUAL):  # the second starts with a space
        ids = tokenizer.tokenize(text)
        assert hf_tokenizer.encode(text) == ids
        assert hf_tokenizer.decode(ids) == tokenizer.detokenize(ids) == text
    loaded = transformers.AutoConfig.from_pretrained(out)
    assert loaded.eos_token_id == hf_config["eos_token_id"] == tokenizer.eod
    assert loaded.bos_token_id == hf_config["bos_token_id"] == \
        (1 if name == "sentencepiece" else tokenizer.eod)  # <s>; GPT-2's <|endoftext|>

    umask = os.umask(0)
    os.umask(umask)
    assert os.stat(os.path.join(out, "model.safetensors")).st_mode & 0o777 == 0o666 & ~umask

    prompt = "def wrap(text, width):\n    "
    generator = transformers.pipeline("text-generation", model=out)
    (result,) = generator(prompt, max_new_tokens=10, do_sample=False, return_tensors=True)
    prompt_ids = tokenizer.tokenize(prompt)
    ours = generate(model, [prompt_ids], 10, stop_tokens=[tokenizer.eod]).tokens[0]
    assert result["generated_token_ids"] == prompt_ids + ours


def test_a_tokenizer_path_not_found_from_here_names_the_flags_that_point_elsewhere(
        tmp_path, tokenizers_of_runs, monkeypatch):
    spm = tokenizers_of_runs["sentencepiece"]["tokenizer_model"]
    monkeypatch.chdir(os.path.dirname(spm))
    flags = {"tokenizer_type": "SentencePieceTokenizer", "tokenizer_model": "spm.model"}
    _run_checkpoint(str(tmp_path / "run"), flags, "gpt2")  # a relative path, as runs save it
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConversionError, match="--tokenizer-model spm.model: no such file.*"
                                              "give --tokenizer-model"):
        gigatron_to_hf(str(tmp_path / "run"), str(tmp_path / "hf"))
    _, line = gigatron_to_hf(str(tmp_path / "run"), str(tmp_path / "hf"),
                             tokenizer_flags={"tokenizer_model": spm})
    assert line.startswith("tokenizer: SentencePieceTokenizer")


def test_a_converted_model_keeps_its_hugging_face_token_ids_and_says_it_has_no_tokenizer(
        tmp_path):
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=101, n_positions=32, n_embd=32, n_layer=2, n_head=4, bos_token_id=100,
        eos_token_id=99))
    hf.save_pretrained(tmp_path / "hf")
    hf_to_gigatron(str(tmp_path / "hf"), str(tmp_path / "gig"))
    hf_config, line = gigatron_to_hf(str(tmp_path / "gig"), str(tmp_path / "out"))
    assert (hf_config["bos_token_id"], hf_config["eos_token_id"]) == (100, 99)
    assert line.startswith("no tokenizer files") and "--tokenizer-type" in line
    assert not os.path.exists(tmp_path / "out" / "tokenizer.json")
    with open(tmp_path / "out" / "generation_config.json") as f:
        assert json.load(f) == {"bos_token_id": 100, "eos_token_id": 99}
