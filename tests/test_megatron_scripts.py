"""Real Megatron-LM and Megatron-DeepSpeed launch scripts, as written: their flags and values
(tests/data/megatron_scripts/*.json, each naming its source repository, path and commit) go
through pretrain_gpt.py's validation at the scripts' own sizes and world size, with only the
data, tokenizer, checkpoint and log paths replaced by files made here. Scripts that validate
then train 2 iterations on the CPU (forked ranks) with the model shrunk and the run's layout,
batch and length made CPU-sized (`shrunk`).

KNOWN_FAILURES names the scripts that do not validate yet and why (a match of the error):
when one starts to pass, its entry must go (the test says so).
"""
import contextlib
import glob
import io
import json
import os
import re

import numpy as np
import pytest

from multirank import run_on_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = sorted(glob.glob(os.path.join(ROOT, "tests", "data", "megatron_scripts", "*.json")))
NAMES = [os.path.basename(p)[:-5] for p in SCRIPTS]
KNOWN_FAILURES: dict = {
    # AMD's ROCm fork (a pull-request ref): --tensorboard-log-interval (a TensorBoard series
    # cadence gigatron does not have), --moe-use-legacy-grouped-gemm (Transformer Engine's
    # grouped MLP vs the legacy one) and --eval-iters -1 (that fork's "no evaluation") are
    # refused
    "mlm_mixtral_moe_rocm": r"--tensorboard-log-interval is a Megatron flag gigatron does not",
}
STDLIB = os.path.dirname(os.__file__)


def _load(name):
    with open(os.path.join(ROOT, "tests", "data", "megatron_scripts", name + ".json")) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """The paths the scripts name, made here: tokenizers trained on standard-library sources
    and .bin/.idx data tokenized with them."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from gigatron.data.preprocess import main as preprocess
    from gigatron.data.sentencepiece_trainer import list_text_files, train_sentencepiece
    # 10 of the runs log to TensorBoard: imported here once, the forked ranks inherit it
    # (each run's rank importing it cost ~0.2 CPU-s); where it is missing the runs say so
    with contextlib.suppress(ImportError):
        import torch.utils.tensorboard  # noqa: F401

    root = tmp_path_factory.mktemp("scripts")
    corpus = list_text_files([os.path.join(STDLIB, "json"), os.path.join(STDLIB, "email")],
                             [".py"])
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train(corpus, trainers.BpeTrainer(
        vocab_size=600, special_tokens=["<|endoftext|>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    (root / "hf").mkdir()
    bpe.model.save(str(root))
    bpe.save(str(root / "hf" / "tokenizer.json"))
    (root / "hf" / "tokenizer_config.json").write_text('{"eos_token": "<|endoftext|>"}')
    spm = train_sentencepiece(corpus[:8], str(root / "spm"), vocab_size=500,
                              input_sentence_size=3000, max_bytes=200_000, suffixes=[".py"])
    paths = {"VOCAB": str(root / "vocab.json"), "MERGE": str(root / "merges.txt"),
             "HF_TOKENIZER": str(root / "hf"), "SPM": spm, "CKPT": str(root / "ckpt"),
             "TB": str(root / "tb"), "CACHE": str(root / "cache")}
    gpt2 = ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", paths["VOCAB"],
            "--merge-file", paths["MERGE"]]
    sp = ["--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", spm]
    documents = _documents(corpus)  # enough that a 0.1% split has some
    for key, part, tokenizer in (("DATA", slice(None), gpt2), ("DATA1", slice(0, 700), gpt2),
                                 ("DATA2", slice(700, 1400), gpt2),
                                 ("DATA3", slice(1400, None), gpt2), ("SPM_DATA", slice(None), sp)):
        jsonl = root / f"{key}.jsonl"
        jsonl.write_text("".join(documents[part]))
        prefix = str(root / key.lower())
        assert preprocess(["--input", str(jsonl), "--output-prefix", prefix, "--append-eod",
                           "--log-interval", "100000"] + tokenizer) == 0
        paths[key] = prefix + "_text_document"
    # a --data-args-path file as Megatron-LM reads it: --data-path's words, weights and prefixes
    (root / "data_args.txt").write_text(f"1.0 {paths['DATA1']} 1.0 {paths['DATA2']} ")
    paths["DATA_ARGS"] = str(root / "data_args.txt")
    return root, paths


def _documents(files):
    """JSON lines of 4-line pieces of the files (a few thousand documents)."""
    documents = []
    for name in files:
        lines = open(name, encoding="utf-8").read().splitlines(keepends=True)
        documents += [json.dumps({"text": "".join(lines[i:i + 4])}) + "\n"
                      for i in range(0, len(lines), 4)]
    assert len(documents) > 2000
    return documents


def argv_of(name, files, batch=None):
    """The script's argv with its paths replaced (the DeepSpeed JSON it writes, written; with
    `batch` = (micro, global), its batch sizes shrunk alike)."""
    root, paths = files
    script = _load(name)
    paths = dict(paths)
    if name.startswith("mds_pretrain_llama2"):  # its data was tokenized with its tokenizer
        paths["DATA"] = paths["SPM_DATA"]
    if "deepspeed_config" in script:
        paths["DS_CONFIG"] = str(root / f"{name}_ds_config.json")
        config = dict(script["deepspeed_config"])
        if batch is not None:
            config.update(train_micro_batch_size_per_gpu=batch[0], train_batch_size=batch[1])
        with open(paths["DS_CONFIG"], "w") as f:
            json.dump(config, f)
    return [re.sub(r"\{(\w+)\}", lambda m: paths[m.group(1)], a) for a in script["argv"]]


def validate(argv, world_size):
    """What pretrain_gpt.py checks before any rank starts work (its own entry: every flag and
    value, the tokenizer and data files, the model and batch arithmetic for this world
    size)."""
    from gigatron.training.config.arguments import build_run, read_settings

    run, _ = build_run(read_settings(argv, world_size), world_size)
    return run


@pytest.mark.parametrize("name", NAMES)
def test_script_validates_at_its_own_sizes_or_fails_for_its_known_reason(name, files):
    script = _load(name)
    assert set(script["source"]) == {"repo", "path", "commit"}
    try:
        run = validate(argv_of(name, files), script["world_size"])
    except ValueError as err:
        if name in KNOWN_FAILURES and re.search(KNOWN_FAILURES[name], str(err)):
            pytest.xfail(f"known: {err}")
        raise
    assert name not in KNOWN_FAILURES, f"{name} validates now: remove it from KNOWN_FAILURES"
    assert run.parallel.world_size == script["world_size"]


# model sizes -> CPU sizes; the layout, batch and length of the run -> 1-2 ranks, 2 iterations
SHRINK = {"--num-layers": "2", "--hidden-size": "64", "--ffn-hidden-size": "128",
          "--num-attention-heads": "4", "--num-query-groups": "2", "--num-key-value-heads": "2",
          "--kv-channels": "16", "--seq-length": "32", "--max-position-embeddings": "64",
          "--vocab-size": "512", "--tensor-model-parallel-size": "1",
          "--pipeline-model-parallel-size": "1", "--micro-batch-size": "2",
          "--global-batch-size": "4", "--train-iters": "2", "--train-samples": "8",
          "--lr-decay-samples": "8", "--lr-warmup-samples": "2", "--lr-decay-iters": "2",
          "--lr-warmup-iters": "1", "--eval-iters": "1", "--eval-interval": "2",
          "--save-interval": "1000", "--log-interval": "1", "--rampup-batch-size": "2 2 4",
          "--exit-interval": "1000", "--train-tokens": "256", "--lr-decay-tokens": "256",
          "--lr-warmup-tokens": "64",
          # experts keep their number; ep 1 divides any shrunk tp x dp and expert count (a run
          # that wants expert parallelism sets ep in RUNS)
          "--moe-ffn-hidden-size": "128", "--moe-shared-expert-intermediate-size": "128",
          "--expert-model-parallel-size": "1", "--expert-tensor-parallel-size": "1"}


def shrunk(argv, extra=None):
    """argv with SHRINK's values (a flag's value(s) replaced, whatever form it was given in);
    a flag of `extra` the script does not set is added."""
    values = {**SHRINK, **(extra or {})}
    out, i, seen = [], 0, set()
    while i < len(argv):
        name = argv[i].split("=")[0]
        if name in values:
            seen.add(name)
            out += [name] + values[name].split()
            i += 1
            while "=" not in argv[i - 1] and i < len(argv) and not argv[i].startswith("--"):
                i += 1  # the old value(s)
            continue
        out.append(argv[i])
        i += 1
    out += [a for name in extra or {} if name not in seen for a in [name] + extra[name].split()]
    return out + ["--no-progress", "--hidden-dropout", "0", "--attention-dropout", "0"]


def _main(rank, world, argv):
    from gigatron.training.run import pretrain

    err, out = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        code = pretrain.main(argv)
    return code, err.getvalue(), out.getvalue()


# script -> (ranks, flags set on top of SHRINK): a few runs, each a different kind of script
RUNS = {"mlm_pretrain_gpt": (1, {}),
        # the ramp: a batch of 2, then the full 4 (Megatron counts 2 iterations for 6 samples)
        "mlm_pretrain_gpt3_175B": (2, {"--micro-batch-size": "1", "--rampup-batch-size": "2 2 2",
                                       "--train-samples": "6", "--lr-decay-samples": "6",
                                       "--lr-warmup-samples": "1"}),
        "mds_pretrain_llama2_distributed": (1, {}),
        # token lengths (256 tokens = 8 samples of 32: 2 iterations of 4), fp16, a DeepSpeed
        # JSON, the optimizer-state series
        "mds_ds_pretrain_gpt_125M": (1, {}),
        # its --global-batch-size and --log-interval win over its JSON (as its loop does)
        "mds_run_deepspeed_example": (1, {}),
        "mlm_gpt3_175b_distributed": (1, {"--micro-batch-size": "1",
                                          "--rampup-batch-size": "2 2 2"}),
        "mlm_pretrain_gpt_distributed_with_mp": (1, {}),
        "mds_uc_run_bf16": (1, {}),
        # FP8, --decoupled-lr, --calculate-per-token-loss, --profile (nsys: a note)
        "mlm_llama3_8b_h100_fp8": (2, {}),
        "mlm_llama3_8b_h100_fp8_real": (1, {}),
        # 8 experts, top-2, aux loss, grouped GEMM, alltoall at ep 2 x edp 1 on 2 ranks (its
        # pp 4 shrunk to 1), distributed optimizer, bf16; its split's 0.008% valid share of
        # our 2879 documents is empty
        # gpt-oss: sinks, alternating sliding windows, clamped quick-GEGLU, 4 experts, FP8
        # emulation with --recompute-activations, NullTokenizer mock data (its pp 4 -> 1)
        "mlm_gptoss_train": (1, {}),
        # DeepSeek-V3: MLA (its latents shrunk), 16 of its 256 experts in its 8 groups, MTP,
        # the benchmark router's random logits, recomputed up-projections and norms, the
        # "num zeros" series
        "mlm_deepseek_v3_mfsdp": (1, {"--moe-layer-freq": "[0]+[1]", "--num-experts": "16",
                                      "--q-lora-rank": "32", "--kv-lora-rank": "16",
                                      "--qk-head-dim": "16", "--qk-pos-emb-head-dim": "8",
                                      "--v-head-dim": "16"}),
        # DeepSeek-V2-Lite as a user wrote it for Megatron-LM: MLA without query compression
        # (latents shrunk), 16 of its 64 experts with its shared ones, its dense first layer of
        # a --moe-layer-freq list, --data-args-path, an HF tokenizer, and its pp2 with two
        # virtual stages per rank (Megatron-Core's newer spelling) on 2 ranks; it leaves
        # --eval-iters at its default, 100: the test evaluation at the end ran 100 iterations
        # (3.3 of the run's 4.5 CPU-s); 1 still runs it
        "user_mlm_deepseek_v2_lite": (2, {"--num-layers": "4", "--moe-layer-freq": "([0]+[1]*3)",
                                          "--eval-iters": "1",
                                          "--num-experts": "16",
                                          "--pipeline-model-parallel-size": "2",
                                          "--kv-lora-rank": "16", "--qk-head-dim": "16",
                                          "--qk-pos-emb-head-dim": "8", "--v-head-dim": "16"}),
        "mlm_mixtral_8x7b_distributed": (2, {"--expert-model-parallel-size": "2",
                                             "--split": "98,1,1"})}


@pytest.mark.parametrize("name", sorted(RUNS))
def test_script_trains_two_iterations_on_the_cpu(name, files, tmp_path):
    if name in KNOWN_FAILURES:
        pytest.skip("does not validate yet (see KNOWN_FAILURES)")
    ranks, extra = RUNS[name]
    values = {**SHRINK, **extra}
    batch = (int(values["--micro-batch-size"]), int(values["--global-batch-size"]))
    argv = shrunk(argv_of(name, files, batch), extra)
    argv = [a.replace(files[1]["CKPT"], str(tmp_path / "ckpt")) for a in argv]
    metrics = str(tmp_path / "metrics.jsonl")
    results = run_on_ranks(_main, ranks, argv + ["--metrics-file", metrics], timeout=300)
    for code, err, out in results:
        assert code == 0, err[-3000:] + out[-2000:]
    with open(metrics) as f:
        train = [r for r in map(json.loads, f) if r["type"] == "train"]
    assert [r["iteration"] for r in train] == [1, 2]
    assert all(np.isfinite(r["lm loss"]) for r in train)
    if "--fp8-format" in argv:  # rank 0's banner says what runs instead of TE's FP8
        assert "FP8 through torch._scaled_mm" in results[0][2], results[0][2][-3000:]
    if "--rampup-batch-size" in argv:  # the batch grows as Megatron's ramp says
        assert [r["global_batch_size"] for r in train] == [2, 4]
    if "--num-experts" in argv:  # the MoE layers ran and logged their balancing loss
        assert all(np.isfinite(r["load_balancing_loss"]) for r in train), train
    if "--log-num-zeros-in-grad" in argv:
        assert all(r["num zeros"] >= 0 for r in train), train
