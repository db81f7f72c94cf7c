"""pretrain_gpt.py's flags: Megatron names map to config objects; every bad flag gets its line,
and every problem of a command line is reported at once."""
import re

import pytest
import torch

from gigatron.data.tokenizer import NullTokenizer
from gigatron.training.config.arguments import build_run_config, parse_args, parse_flags

BASE = ("--num-layers 4 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
        "--micro-batch-size 2 --global-batch-size 8 --train-iters 10 --lr 1e-3 "
        "--mock-data --vocab-size 100")


def run(extra: str = "", world: int = 1, base: str = BASE):
    return parse_args((base + " " + extra).split(), world)


def test_flags_map_to_config_objects():
    cfg = run("--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --swiglu "
              "--normalization RMSNorm --position-embedding-type rope --disable-bias-linear "
              "--untie-embeddings-and-output-weights --group-query-attention "
              "--num-query-groups 2 --hidden-dropout 0 --attention-dropout 0 --bf16 "
              "--sequence-parallel --use-distributed-optimizer --lr-warmup-fraction 0.1 "
              "--lr-decay-style cosine --min-lr 1e-5", world=8)
    m = cfg.model
    assert (m.num_layers, m.hidden_size, m.num_attention_heads, m.seq_length) == (4, 32, 4, 16)
    assert m.activation == "swiglu" and m.ffn_hidden_size == 64  # Megatron: 4h*2/3 -> x64
    assert (m.normalization, m.position_embedding_type) == ("RMSNorm", "rope")
    assert not m.add_bias_linear and m.untie_embeddings_and_output_weights
    assert m.num_query_groups == 2 and m.hidden_dropout == 0.0
    assert m.params_dtype == torch.bfloat16 and m.sequence_parallel
    p = cfg.parallel
    assert (p.tp, p.pp, p.dp, cfg.zero.zero_stage, p.sequence_parallel) == (2, 2, 2, 1, True)
    assert cfg.train.num_microbatches == 8 // (2 * 2)
    s = cfg.lr_schedule
    assert (s.decay_steps, s.warmup_steps, s.decay_style) == (80, 8, "cosine")
    assert cfg.data.mock_data and cfg.data.vocab_size == 100


def test_defaults_follow_megatron():
    cfg = run(world=2)
    assert cfg.parallel.dp == 2 and cfg.zero.zero_stage == 0
    assert cfg.model.max_position_embeddings == 16 and cfg.model.ffn_hidden_size == 128
    assert cfg.zero.clip_grad == 1.0 and cfg.zero.weight_decay == 0.01
    assert cfg.lr_schedule.decay_style == "linear" and cfg.lr_schedule.decay_steps == 10 * 8
    assert cfg.logging.log_interval == 100 and cfg.train.eval_interval == 1000
    assert not cfg.parallel.sequence_parallel  # --sequence-parallel is a no-op at tp=1


def test_global_batch_defaults_to_micro_batch_times_dp():
    base = BASE.replace("--global-batch-size 8 ", "")
    cfg = run(world=4, base=base)
    assert cfg.train.global_batch_size == 8 and cfg.train.num_microbatches == 1


def test_tokenizer_vocab_overrides_flag_vocab():
    assert run().model.vocab_size == 100
    run_config = build_run_config(parse_flags(BASE.split()), 1, NullTokenizer(300))
    assert run_config.model.vocab_size == 300


def test_model_flag_loads_zoo_config_and_flags_override_it():
    cfg = parse_args("--model llama3-8b --seq-length 2048 --num-layers 4 --micro-batch-size 1 "
                     "--train-iters 1 --lr 1e-4 --mock-data".split(), 1)
    m = cfg.model
    assert (m.num_layers, m.seq_length, m.hidden_size, m.num_query_groups) == (4, 2048, 4096, 8)
    assert m.activation == "swiglu" and m.vocab_size == 128256 and cfg.model_name == "llama3-8b"


def test_zero_stage_flag():
    assert run("--zero-stage 3", world=2).zero.zero_stage == 3


BAD_FLAGS = [  # (extra flags, world size, message)
    ("--bogus-flag 3", 1, r"unknown flag\(s\) --bogus-flag 3"),
    ("--num-layer 3", 1, r"did you mean --num-layers\?"),
    ("--tensor-model-parallel-size 3", 8, r"world size 8 is not divisible by tensor x "
                                          r"pipeline = 3 x 1 = 3: launch a multiple of "
                                          r"3 ranks or change --tensor-model-parallel-size"),
    ("--global-batch-size 6", 2, r"--global-batch-size 6 is not a multiple of "
                                 r"--micro-batch-size 2 x data-parallel size 2"),
    ("--micro-batch-size 0", 1, r"--micro-batch-size must be > 0"),
    ("--fp16 --bf16", 1, r"--fp16 and --bf16 are exclusive"),
    ("--lr-warmup-iters 2 --lr-warmup-fraction 0.1", 1,
     r"--lr-warmup-fraction and --lr-warmup-iters are exclusive"),
    ("--lr-warmup-iters 20", 1, r"warm-up \(160 samples\) is not shorter than the decay"),
    ("--min-lr 1", 1, r"--min-lr 1.0 is larger than --lr 0.001"),
    ("--lr-warmup-fraction 1.5", 1, r"--lr-warmup-fraction must be in \[0, 1\)"),
    ("--lr-decay-style WSD", 1, r"--lr-decay-style WSD needs --lr-wsd-decay-iters"),
    ("--lr-decay-style WSD --lr-wsd-decay-iters 20", 1, r"--lr-wsd-decay-iters is longer"),
    ("--lr-decay-style bogus", 1, r"argument --lr-decay-style: invalid choice"),
    ("--use-distributed-optimizer --zero-stage 0", 1,
     r"--use-distributed-optimizer .* contradicts --zero-stage 0"),
    ("--zero-stage 4", 1, r"argument --zero-stage: invalid choice"),
    ("--optimizer-cpu-offload", 1, r"--optimizer-cpu-offload needs a sharded optimizer"),
    ("--pipeline-model-parallel-size 8", 8,
     r"--pipeline-model-parallel-size=8 is larger than --num-layers=4"),
    ("--pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 3", 2,
     r"--num-layers-per-virtual-pipeline-stage=3 must divide the 2 layers"),
    ("--num-layers-per-virtual-pipeline-stage 1", 1, r"needs --pipeline-model-parallel-size > 1"),
    ("--pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 1 "
     "--global-batch-size 6", 2, r"interleaved schedule .* multiple of "
                                 r"--pipeline-model-parallel-size=2"),
    ("--train-iters 0", 1, r"--train-iters must be > 0"),
    ("--log-interval 0", 1, r"--log-interval must be > 0"),
    ("--eval-iters -1", 1, r"--eval-iters must be >= 0"),
    ("--finetune", 1, r"--finetune needs --load DIR"),
    ("--clip-grad -1", 1, r"--clip-grad must be >= 0"),
    ("--adam-beta2 1.0", 1, r"--adam-beta2 must be in \[0, 1\)"),
    ("--group-query-attention --num-query-groups 3", 1,
     r"--num-attention-heads \(4\) must be divisible by --num-query-groups \(3\)"),
    ("--num-query-groups 2", 1, r"--num-query-groups is used only with --group-query-attention"),
    ("--num-attention-heads 3", 1, r"--hidden-size \(32\) must be divisible by "
                                   r"--num-attention-heads"),
    ("--tensor-model-parallel-size 8 --global-batch-size 2", 8,
     r"--num-attention-heads \(4\) must be divisible by the tensor-parallel size \(8\)"),
    ("--data-path foo", 1, r"--data-path and --mock-data are exclusive"),
    ("--split 1,2,3,4", 1, r"--split 1,2,3,4: give up to three non-negative weights"),
    ("--hidden-size -32", 1, r"--hidden-size must be > 0"),
    ("--distributed-timeout-minutes 0", 1, r"--distributed-timeout-minutes must be > 0"),
    ("--zero-stage 3 --pipeline-model-parallel-size 2", 2,
     r"--zero-stage 3 needs --pipeline-model-parallel-size 1"),
    ("--fp16 --initial-loss-scale 1000", 1, r"--initial-loss-scale 1000.0 must be a power of 2"),
    ("--model gpt5", 1, r"--model gpt5 is not in the zoo: choose one of .*gpt2-124m"),
]


@pytest.mark.parametrize("extra,world,message", BAD_FLAGS, ids=[b[0] for b in BAD_FLAGS])
def test_bad_flag_gives_one_clear_line(extra, world, message):
    with pytest.raises(ValueError) as err:
        run(extra, world=world)
    text = str(err.value)
    lines = getattr(err.value, "problems", [text])  # several problems: one line each
    assert all("\n" not in line for line in lines) and len(lines) == len(set(lines))
    assert re.search(message, text), text


BAD_DATA = [
    ("--micro-batch-size 2 --train-iters 1 --lr 1 --num-layers 1 --hidden-size 8 "
     "--num-attention-heads 2 --seq-length 8 --vocab-size 10", r"no training data"),
    ("--micro-batch-size 2 --train-iters 1 --lr 1 --num-layers 1 --hidden-size 8 "
     "--num-attention-heads 2 --seq-length 8 --data-path d --vocab-size 10",
     r"--tokenizer-type GPT2BPETokenizer \(Megatron's default when --tokenizer-type is not "
     r"given\) needs --vocab-file, --merge-file"),
    ("--micro-batch-size 2 --train-iters 1 --lr 1 --num-layers 1 --hidden-size 8 "
     "--num-attention-heads 2 --seq-length 8 --data-path d --vocab-size 10 "
     "--tokenizer-type SentencePieceTokenizer", r"needs --tokenizer-model"),
    ("--micro-batch-size 2 --train-iters 1 --lr 1 --num-layers 1 --hidden-size 8 "
     "--num-attention-heads 2 --seq-length 8 --data-path 0.5 a 0.5 --vocab-size 10 "
     "--tokenizer-type NullTokenizer", r"weight/prefix pairs"),
    ("--micro-batch-size 2 --train-iters 1 --lr 1 --num-layers 1 --hidden-size 8 "
     "--num-attention-heads 2 --seq-length 8 --mock-data", r"vocabulary size is unknown"),
    ("--micro-batch-size 2 --train-iters 1 --lr 1 --mock-data --vocab-size 10",
     r"--num-layers, --hidden-size, --num-attention-heads, --seq-length required"),
    ("--train-iters 1 --lr 1 --mock-data --vocab-size 10 --num-layers 1 --hidden-size 8 "
     "--num-attention-heads 2 --seq-length 8", r"--micro-batch-size is required"),
    ("--micro-batch-size 2 --lr 1 --mock-data --vocab-size 10 --num-layers 1 "
     "--hidden-size 8 --num-attention-heads 2 --seq-length 8",
     r"--train-iters or --train-samples is required"),
    ("--micro-batch-size 2 --train-iters 1 --mock-data --vocab-size 10 --num-layers 1 "
     "--hidden-size 8 --num-attention-heads 2 --seq-length 8", r"--lr is required"),
]


@pytest.mark.parametrize("argv,message", BAD_DATA, ids=[b[1] for b in BAD_DATA])
def test_missing_required_flag_is_named(argv, message):
    with pytest.raises(ValueError, match=message):
        parse_args(argv.split(), 1)


def test_a_wrong_batch_size_hides_only_what_depends_on_it():
    argv = ("--lr 1 --mock-data --vocab-size 10 --num-layers 1 --hidden-size 8 "
            "--num-attention-heads 2 --seq-length 8 --lr-warmup-iters -1").split()
    with pytest.raises(ValueError) as err:
        parse_args(argv, 1)
    assert err.value.problems == ["--micro-batch-size is required",
                                  "--train-iters or --train-samples is required",
                                  "--lr-warmup-iters must be >= 0, got -1"]


def test_missing_data_files_are_named_before_launch(tmp_path):
    base = ("--micro-batch-size 2 --train-iters 1 --lr 1 --num-layers 1 --hidden-size 8 "
            "--num-attention-heads 2 --seq-length 8 --tokenizer-type NullTokenizer "
            "--vocab-size 10 ").split()
    with pytest.raises(ValueError, match=r"--data-path nope: nope.idx does not exist "
                                         r"\(the prefix tools/preprocess_data.py wrote"):
        parse_args(base + ["--data-path", "nope"], 1)
    (tmp_path / "a.idx").write_bytes(b"")
    with pytest.raises(ValueError, match=r"--data-path \S*/a: \S*/a.bin does not exist"):
        parse_args(base + ["--data-path", "0.5", str(tmp_path / "a"), "0.5", "b"], 1)
    with pytest.raises(ValueError, match=r"x.bin.idx does not exist \(give the prefix "
                                         r"without .bin/.idx\)"):
        parse_args(base + ["--train-data-path", "x.bin"], 1)


def test_parse_flags_rejects_abbreviations():
    with pytest.raises(ValueError, match="unknown flag"):
        parse_flags(["--num-lay", "2"])


EXAMPLES = {"gpt2_124m_single_gpu.sh": 1, "gpt3_1.3b_8gpu.sh": 8,
            "llama3_8b_multinode_torchrun.sh": 32, "llama3_8b_slurm.sbatch": 32}


def example_flags(name: str) -> list:
    """The pretrain_gpt.py flags of an example script (mock data in place of DATA_FLAGS)."""
    import os
    import shlex
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    text = open(os.path.join(root, "examples", name)).read().replace("\\\n", " ")
    command = next(line for line in text.splitlines() if "pretrain_gpt.py " in line and
                   not line.lstrip().startswith("#"))
    command = command.split("pretrain_gpt.py", 1)[1]
    command = command.replace('"${DATA_FLAGS[@]}"', "--mock-data").replace('"$@"', "")
    return [w.replace("$OUT", "/tmp/out") for w in shlex.split(command)]


@pytest.mark.parametrize("name,world", EXAMPLES.items())
def test_example_commands_are_valid_at_their_world_size(name, world):
    cfg = parse_args(example_flags(name), world)
    assert cfg.parallel.world_size == world and cfg.data.mock_data
    assert cfg.model_name in ("gpt2-124m", "gpt3-1.3b", "llama3-8b")


def test_save_or_load_pointing_at_a_file_fails_before_training(tmp_path):
    """--save at an existing file would fail only at the first save, after training time
    was spent; it is refused with the other flag problems instead."""
    afile = tmp_path / "ckpt"
    afile.write_text("not a folder")
    with pytest.raises(ValueError, match=r"--save .*ckpt is a file, not a checkpoint directory"):
        run(f"--save {afile}")
    with pytest.raises(ValueError, match=r"--load .*ckpt is a file"):
        run(f"--load {afile}")
    run(f"--save {tmp_path / 'new-folder'}")  # a missing folder is fine: save creates it
