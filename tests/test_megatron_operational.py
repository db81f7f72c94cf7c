"""Megatron's operational flags: optional logging packages checked before any rank starts,
overlap/backend/parallel combinations Megatron refuses, the banner's note for each accepted
flag that maps to something else here, Weights & Biases logging, --local-rank, every unknown
flag and bad value reported at once with nearest spellings, and Megatron-DeepSpeed's flags."""
import contextlib
import io
import sys
import types

import pytest

from gigatron.training.config.arguments import parse_args
from gigatron.training.observe.logger import MetricsLogger
from gigatron.training.config.features import check_local_rank, flag_notes
from gigatron.training.config.validation import ConfigError

BASE = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
        "--micro-batch-size 2 --train-iters 4 --lr 1e-3 --mock-data --vocab-size 100")


def run(extra: str, world: int = 1):
    return parse_args((BASE + " " + extra).split(), world)


@pytest.fixture
def nothing_installed(monkeypatch):
    monkeypatch.setattr("gigatron.training.config.features.installed", lambda name: False)


def test_missing_tensorboard_and_wandb_are_configuration_problems(nothing_installed):
    with pytest.raises(ConfigError) as err:
        run("--tensorboard-dir tb --wandb-project p --fp16 --bf16")
    text = str(err.value)
    assert len(err.value.problems) == 4, text
    assert "--tensorboard-dir needs the tensorboard package, which is not installed: pip " \
           "install tensorboard" in text
    assert "--wandb-project needs the wandb package, which is not installed: pip install " \
           "wandb, or drop --wandb-project" in text
    assert "--wandb-project needs --wandb-exp-name NAME" in text
    assert "--fp16 and --bf16 are exclusive" in text


def test_missing_tensorboard_stops_the_program_before_any_process_group(nothing_installed):
    import torch.distributed as dist
    from gigatron.training.run import pretrain

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = pretrain.main((BASE + " --tensorboard-dir tb").split())
    assert code == 2 and not dist.is_initialized()
    assert err.getvalue().startswith("pretrain_gpt.py: error: --tensorboard-dir needs the "
                                     "tensorboard package")


@pytest.mark.parametrize("extra,message", [
    ("--overlap-param-gather --overlap-grad-reduce",
     r"--overlap-param-gather needs the distributed optimizer"),
    ("--overlap-param-gather --use-distributed-optimizer",
     r"--overlap-param-gather needs --overlap-grad-reduce"),
    ("--context-parallel-size 2 --attention-dropout 0.1",
     r"--attention-dropout 0.1 with --context-parallel-size 2: attention dropout under context "
     r"parallelism is not supported"),
    ("--cp-comm-type a2a+p2p",
     r"--cp-comm-type a2a\+p2p needs --hierarchical-context-parallel-sizes A P"),
    ("--no-pipeline-parallel --pipeline-model-parallel-size 2 --num-layers 2",
     r"--no-pipeline-parallel contradicts --pipeline-model-parallel-size 2"),
    ("--use-legacy-models", r"--use-legacy-models is not supported"),
])
def test_combinations_megatron_refuses_are_reported(extra, message):
    with pytest.raises(ConfigError, match=message):
        run(extra, world=2)


def test_overlap_flags_and_backends_that_are_accepted():
    cfg = run("--overlap-grad-reduce --overlap-param-gather --use-distributed-optimizer "
              "--distributed-backend nccl --log-throughput --exit-duration-in-mins 5")
    assert cfg.zero.overlap_comm and cfg.zero.zero_stage == 1
    assert cfg.parallel.distributed_backend == "nccl" and cfg.train.exit_duration_in_mins == 5


def test_gloo_with_gpus_is_refused():
    from gigatron.training.config.features import check_operational
    from gigatron.training.config.arguments import parse_flags
    from gigatron.training.config.table import build_settings
    from gigatron.training.config.validation import Problems

    settings = build_settings(parse_flags((BASE + " --distributed-backend gloo").split()))
    p = Problems()
    check_operational(settings, p, has_cuda=True)
    assert p.lines == ["--distributed-backend gloo with GPUs is not supported (gloo has no "
                       "reduce-scatter of GPU tensors, which ZeRO and tensor parallelism "
                       "need): drop it (GPUs use nccl)"]
    p = Problems()
    check_operational(settings, p, has_cuda=False)
    assert not p


def test_local_rank_must_agree_with_the_launcher():
    check_local_rank(1, 1, "torchrun")
    check_local_rank(None, 3, "torchrun")
    check_local_rank(1, 0, "none")  # no launcher: nothing to agree with
    with pytest.raises(ValueError, match=r"--local-rank 1 disagrees with the launcher's local "
                                         r"rank 0 \(torchrun\): drop --local-rank"):
        check_local_rank(1, 0, "torchrun")
    assert run("--local_rank=0").parallel.local_rank == 0  # DeepSpeed's launcher spelling


def test_launch_problems_come_with_the_others_and_hide_only_their_consequences():
    from gigatron.parallel.world import read_launch_env
    from gigatron.training.config.arguments import build_run, read_settings

    torchrun = read_launch_env({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"})
    argv = (BASE + " --local-rank 1 --fp16 --bf16").split()
    with pytest.raises(ConfigError) as err:
        build_run(read_settings(argv, 2), 2, launch=torchrun)
    assert [line.split(" ")[0] for line in err.value.problems] == ["--local-rank", "--fp16"]
    # no launcher and a layout of 4 ranks: how to launch, not also "world size 1 is not
    # divisible by 2 x 2"; the other mistakes still show
    argv = (BASE + " --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 "
                   "--eval-iters -1").split()
    with pytest.raises(ConfigError) as err:
        build_run(read_settings(argv, 1), 1, launch=read_launch_env({}))
    assert len(err.value.problems) == 2, err.value.problems
    assert "torchrun --nproc-per-node 4" in err.value.problems[0]
    assert err.value.problems[1] == "--eval-iters must be >= 0, got -1"


def test_banner_notes_say_what_each_accepted_flag_maps_to():
    settings = (run("--transformer-impl transformer_engine --use-mcore-models "
                     "--attention-backend fused --ckpt-format torch_dist --distributed-backend "
                     "nccl --deepspeed --deepspeed-activation-checkpointing --openai-gelu "
                     "--overlap-grad-reduce --overlap-param-gather --zero-stage 1").settings)
    notes = flag_notes(settings, "gloo", has_package=lambda name: False)
    text = "\n".join(notes)
    for expected in ("--transformer-impl transformer_engine: Transformer Engine is not "
                     "installed; gigatron's own layers run",
                     "--use-mcore-models: gigatron's model is laid out as Megatron-Core's",
                     "--attention-backend fused: core attention is torch "
                     "scaled_dot_product_attention",
                     "--distributed-backend nccl: no GPU here, gloo is used",
                     "--deepspeed: gigatron's own engine runs",
                     "--deepspeed-activation-checkpointing", "--openai-gelu: no effect",
                     "--overlap-param-gather: ZeRO gathers"):
        assert expected in text, text
    installed = flag_notes(settings, "nccl", has_package=lambda name: True)
    assert "Transformer Engine is installed but not used" in "\n".join(installed)
    assert not any("no GPU here" in n for n in installed)
    assert flag_notes(run("").settings, "gloo") == []
    bf16 = flag_notes(run("--bf16 --loss-scale 12").settings, "gloo")
    assert bf16 == ["--loss-scale without --fp16: no effect (bf16 and fp32 train unscaled, as "
                    "DeepSpeed's bf16 does; Megatron-LM's bf16 would multiply by the constant, "
                    "which changes only rounding)"]


def test_wandb_gets_the_logged_scalars(monkeypatch, tmp_path):
    calls = []

    class FakeRun:
        def log(self, values, step):
            calls.append(("log", values, step))

        def finish(self):
            calls.append(("finish",))

    fake = types.ModuleType("wandb")
    fake.init = lambda **kw: calls.append(("init", kw)) or FakeRun()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    options = {"project": "p", "name": "n", "dir": str(tmp_path / "w"), "config": {"lr": 1}}
    logger = MetricsLogger(True, 10, stream=io.StringIO(), wandb=options, progress=False)
    logger.train({"iteration": 2, "consumed_samples": 8, "lm loss": 3.5, "lr": 0.1,
                  "grad norm": None, "global_batch_size": 4})
    logger.evaluation({"split": "valid", "iteration": 2, "lm loss": 3.0})
    logger.close()
    assert calls[0] == ("init", options) and (tmp_path / "w").is_dir()
    assert calls[1] == ("log", {"lm loss": 3.5, "lr": 0.1}, 2)
    assert calls[2] == ("log", {"valid lm loss": 3.0}, 2) and calls[3] == ("finish",)


def test_every_unknown_flag_and_every_problem_are_reported_at_once():
    with pytest.raises(ConfigError) as err:
        parse_args("--num-layers x --hiden-size 32 --num-attention-heads 4 --seq-length 16 "
                   "--micro-batch-size 2 --train-iter 10 --lr 1e-3 --mock-data --vocab-size 100 "
                   "--fp16 --bf16 --bogus 3 --zero-stage 5".split(), 1)
    problems = err.value.problems
    assert problems[0] == ("unknown flag(s) --hiden-size 32 --train-iter 10 --bogus 3; did you "
                           "mean --hidden-size for --hiden-size, --train-iters for "
                           "--train-iter?; see pretrain_gpt.py --help")
    assert problems[1:] == ["argument --num-layers: invalid int value: 'x'",
                            "argument --zero-stage: invalid choice: 5 (choose from 0, 1, 2, 3)",
                            "--fp16 and --bf16 are exclusive: pick one"]


# Megatron-DeepSpeed's examples_deepspeed/pretrain_llama2_distributed.sh (flags of the model,
# ZeRO and DeepSpeed; sizes shrunk, data mocked)
MDS_LLAMA2 = ("--tensor-model-parallel-size 1 --pipeline-model-parallel-size 1 --num-layers 2 "
              "--hidden-size 32 --ffn-hidden-size 64 --num-attention-heads 4 "
              "--micro-batch-size 2 --global-batch-size 4 --seq-length 16 "
              "--max-position-embeddings 16 --train-iters 2 --distributed-backend nccl "
              "--lr 3e-4 --lr-decay-style cosine --min-lr 3e-5 --weight-decay 0.1 "
              "--clip-grad 1.0 --lr-warmup-iters 1 --optimizer adam --adam-beta1 0.9 "
              "--adam-beta2 0.95 --log-interval 1 --save ckpt --save-interval 10000 "
              "--eval-interval 1000 "
              "--eval-iters 1 --bf16 --no-query-key-layer-scaling --attention-dropout 0 "
              "--hidden-dropout 0 --use-rotary-position-embeddings "
              "--untie-embeddings-and-output-weights --swiglu --normalization rmsnorm "
              "--disable-bias-linear --num-key-value-heads 2 --deepspeed --zero-stage=1 "
              "--deepspeed-activation-checkpointing --recompute-granularity full "
              "--recompute-method uniform --mock-data --vocab-size 100")


def test_megatron_deepspeed_llama2_flags_build_the_llama_model():
    cfg = parse_args(MDS_LLAMA2.split(), 2)
    m = cfg.model
    assert (m.position_embedding_type, m.normalization, m.activation, m.num_query_groups) == \
        ("rope", "RMSNorm", "swiglu", 2)
    assert m.untie_embeddings_and_output_weights and not m.add_bias_linear
    assert cfg.zero.zero_stage == 1 and m.recompute_granularity == "full"


def test_megatron_deepspeed_checkpoint_activations_is_full_uniform_recomputation():
    m = run("--checkpoint-activations --checkpoint-num-layers 2").model
    assert (m.recompute_granularity, m.recompute_method, m.recompute_num_layers) == \
        ("full", "uniform", 2)
    assert run("--recompute-activations").model.recompute_granularity == "selective"
