"""The run's config: `RunConfig`, and the concerns whose settings are its configs as they are.

A field declared with `setting(default, doc, flag..., ds=key)` is one row of the config table
(`training/config/table.py`): its Megatron flag, DeepSpeed key, default and doc live only
here. Fields without it are derived (dp from the world size, micro-batches from the batch
sizes). Concerns with an owner elsewhere keep the owner's config, resolved by
`arguments.build_run`: the model's `gigatron.models.config.TransformerConfig`, the ZeRO
wrapper's `gigatron.parallel.zero.ZeroConfig`, the data's `gigatron.data.GPTDataConfig`;
their settings are declared in `settings.py`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Dict, List, Optional

from gigatron.training.config.field import setting

if TYPE_CHECKING:  # the run's parts are built by their own packages, imported lazily
    from gigatron.data import GPTDataConfig
    from gigatron.models.config import TransformerConfig
    from gigatron.parallel.zero import ZeroConfig
    from gigatron.training.config.table import Settings


@dataclass(frozen=True)
class ParallelConfig:
    """How the ranks split the work (Megatron's parallelism flags; dp = world / (tp x pp))."""

    tp: int = setting(1, "tensor-parallel size: ranks that split each layer",
                      "--tensor-model-parallel-size", dest="tensor_model_parallel_size")
    pp: int = setting(1, "pipeline-parallel size: ranks that split the layer stack",
                      "--pipeline-model-parallel-size", dest="pipeline_model_parallel_size")
    dp: int = 1
    ep: int = setting(
        1, "expert-parallel size: ranks that split the experts of each MoE layer", "--expert-model-parallel-size",
        dest="expert_model_parallel_size")
    etp: Optional[int] = setting(
        None, "tensor-parallel size of the expert layers (default --tensor-model-parallel-size, "
        "as in Megatron)",
        "--expert-tensor-parallel-size", dest="expert_tensor_parallel_size")
    sequence_parallel: bool = setting(
        False, "split norms and dropout along the sequence over tp (no-op at tp 1)",
        "--sequence-parallel")
    num_layers_per_virtual_pipeline_stage: Optional[int] = setting(
        None, "layers per virtual stage: interleaved 1F1B schedule",
        "--num-layers-per-virtual-pipeline-stage")
    num_virtual_stages_per_pipeline_rank: Optional[int] = setting(
        None, "virtual stages (model chunks) per pipeline rank: interleaved 1F1B schedule; "
        "each stage's layers (--decoder-first/last-pipeline-num-layers' too) split evenly "
        "into them (Megatron-Core's newer spelling of the virtual pipeline size; exclusive "
        "with --num-layers-per-virtual-pipeline-stage)",
        "--num-virtual-stages-per-pipeline-rank")
    pipeline_schedule: str = setting(
        "1f1b", "pipeline schedule: 1f1b (interleaved 1F1B when virtual stages are given, "
        "as Megatron), interleaved, zb-h1 (zero bubble H1: split backward; 1F1B's activations "
        "plus, on stage r, r micro-batches' deferred weight-gradient inputs) or "
        "zbv (zero bubble V: 2 chunks per stage in a V, set by "
        "--num-layers-per-virtual-pipeline-stage, untied embeddings)",
        "--pipeline-schedule", choices=("1f1b", "interleaved", "zb-h1", "zbv"))
    delay_wgrad_compute: bool = setting(
        False, "accepted with --pipeline-schedule zb-h1 or zbv, which always delay the "
        "weight-gradient computation to its own step W (Megatron-Core's split backward): no "
        "further effect; refused with 1f1b and interleaved, which compute weight gradients "
        "in the backward", "--delay-wgrad-compute")
    decoder_first_pipeline_num_layers: Optional[int] = setting(
        None, "layers of the first pipeline stage (the rest split evenly)",
        "--decoder-first-pipeline-num-layers")
    decoder_last_pipeline_num_layers: Optional[int] = setting(
        None, "layers of the last pipeline stage (the rest split evenly)",
        "--decoder-last-pipeline-num-layers")
    distributed_timeout_minutes: float = setting(
        10.0, "timeout of collectives before a hung rank is reported",
        "--distributed-timeout-minutes")
    context_parallel_size: int = setting(
        1, "context-parallel size: ranks that split each sequence (Megatron-Core's causal "
        "load-balanced split, rank i holding chunks i and 2cp-1-i); they share the model, "
        "whose gradients are reduced over data x context parallel ranks",
        "--context-parallel-size")
    cp_comm_type: str = setting(
        "p2p", "attention under context parallelism: p2p (ring of key/value blocks), "
        "all_gather (gather the keys/values), a2a (DeepSpeed-Ulysses: all-to-all to a "
        "split of the heads; heads per tensor-parallel rank divisible by cp) or a2a+p2p "
        "(a2a within groups of A cp ranks, p2p ring across P of them: "
        "--hierarchical-context-parallel-sizes A P)", "--cp-comm-type",
        choices=("p2p", "all_gather", "a2a", "a2a+p2p"))
    hierarchical_context_parallel_sizes: Optional[List[int]] = setting(
        None, "A P for --cp-comm-type a2a+p2p (A x P = --context-parallel-size): a2a within "
        "groups of A consecutive cp ranks, p2p across the P groups, as Megatron-Core",
        "--hierarchical-context-parallel-sizes", metavar="N")
    no_pipeline_parallel: bool = setting(
        False, "Megatron-DeepSpeed's non-pipeline engine: accepted with "
        "--pipeline-model-parallel-size 1 (gigatron runs pp 1 without pipelining)",
        "--no-pipeline-parallel")
    distributed_backend: Optional[str] = setting(
        None, "nccl (Megatron's default) or gloo; default: nccl on GPUs, gloo on CPUs. nccl "
        "without a GPU runs on gloo (the banner says so); gloo with GPUs is refused (no "
        "reduce-scatter on GPU tensors)", "--distributed-backend", choices=("nccl", "gloo"))
    local_rank: Optional[int] = setting(
        None, "accepted for launchers that pass it; the local rank is read from the "
        "launcher's environment (LOCAL_RANK, SLURM_LOCALID, OMPI_COMM_WORLD_LOCAL_RANK), and "
        "a --local-rank that disagrees is an error", "--local-rank", "--local_rank")

    @property
    def world_size(self) -> int:
        return self.tp * self.context_parallel_size * self.pp * self.dp


@dataclass(frozen=True)
class LRScheduleConfig:
    """Learning-rate schedule in Megatron's units: steps count samples, not iterations."""

    max_lr: float
    min_lr: float = 0.0
    decay_style: str = "linear"  # linear|cosine|constant|inverse-square-root|WSD
    warmup_steps: float = 0  # a float: --lr-warmup-fraction x decay is not rounded (Megatron)
    decay_steps: float = 1  # a float: --lr-decay-tokens / --seq-length is not rounded
    init_lr: float = 0.0  # lr at step 0 of warm-up (Megatron's --lr-warmup-init)
    wsd_decay_steps: Optional[int] = None
    wsd_decay_style: str = "exponential"  # linear|cosine|exponential|minus_sqrt


@dataclass(frozen=True)
class TrainConfig:
    """The loop: iterations, batches, evaluation cadence and exit conditions."""

    train_iters: Optional[int] = setting(
        None, "iterations to train (this or --train-samples is required)", "--train-iters")
    train_samples: Optional[int] = setting(
        None, "samples to train instead of --train-iters: iterations = samples / global batch "
        "(with --rampup-batch-size: counted through the ramp, as Megatron)", "--train-samples")
    train_tokens: Optional[int] = setting(
        None, "Megatron-DeepSpeed: also stop once this many tokens are consumed (samples x "
        "--seq-length), whichever of it and --train-iters/--train-samples comes first",
        "--train-tokens")
    rampup_batch_size: Optional[List[int]] = setting(
        None, "START INCREMENT SAMPLES: the global batch grows from START by INCREMENT over "
        "SAMPLES samples to --global-batch-size, as Megatron computes it (with --train-iters, "
        "which Megatron refuses, it ramps the same way: the banner says so)",
        "--rampup-batch-size", metavar="N")
    micro_batch_size: Optional[int] = setting(
        None, "samples per rank per micro-batch (required)", "--micro-batch-size",
        ds="train_micro_batch_size_per_gpu")
    global_batch_size: Optional[int] = setting(
        None, "samples per iteration over all data-parallel ranks (default micro x dp)",
        "--global-batch-size", ds="train_batch_size")
    num_microbatches: int = setting(
        1, "micro-batches per iteration; train_batch_size = micro x this x dp (JSON only)",
        dest="gradient_accumulation_steps", ds="gradient_accumulation_steps", ds_default=None,
        ds_doc="gigatron.initialize infers it as DeepSpeed does")
    seed: int = setting(1234, "random seed of weights, data order and dropout", "--seed")
    eval_interval: int = setting(1000, "iterations between validation runs",
                                 "--eval-interval")
    eval_iters: int = setting(100, "iterations per validation run (0: none)", "--eval-iters")
    skip_test: bool = setting(False, "skip the test-split evaluation at the end",
                              "--skip-train-test")
    exit_interval: Optional[int] = setting(None, "stop when the iteration is a multiple of "
                                           "this", "--exit-interval")
    exit_signal_handler: bool = setting(False, "save and stop on SIGTERM",
                                        "--exit-signal-handler")
    exit_duration_in_mins: Optional[float] = setting(
        None, "save and stop after this many minutes since the start (checked every "
        "iteration, agreed by all ranks)", "--exit-duration-in-mins")
    num_workers: int = setting(2, "data loader worker processes per rank (Megatron's "
                               "default 2; 0 loads in the training process)", "--num-workers")
    check_for_nan_in_loss_and_grad: bool = setting(
        True, "stop at the first non-finite loss or grad norm (checked on the device, read at "
        "each log line and before each save)", "--check-for-nan-in-loss-and-grad",
        negative="--no-check-for-nan-in-loss-and-grad")


@dataclass(frozen=True)
class CheckpointConfig:
    """--save/--load and what a load restores."""

    save: Optional[str] = setting(None, "directory to save checkpoints to", "--save",
                                  metavar="DIR")
    load: Optional[str] = setting(None, "directory to load the latest checkpoint from",
                                  "--load", metavar="DIR")
    save_interval: Optional[int] = setting(None, "iterations between saves (needs --save)",
                                           "--save-interval")
    ckpt_step: Optional[int] = setting(
        None, "checkpoint step to load model from: the iteration --load reads instead of the "
        "one its tracker names (resume, gigatron evaluate and generate)", "--ckpt-step")
    no_load_optim: bool = setting(False, "do not load the optimizer state", "--no-load-optim")
    no_load_rng: bool = setting(False, "do not load the RNG state", "--no-load-rng")
    finetune: bool = setting(False, "load weights only and start at iteration 0",
                             "--finetune")
    use_checkpoint_args: bool = setting(
        False, "take the model's shape flags (layers, sizes, heads, query groups, sequence "
        "length, positions, norm, activation, biases, untied output, vocabulary) from the "
        "--load checkpoint's saved args: gigatron's, or Megatron-LM's torch or torch_dist",
        "--use-checkpoint-args")
    exit_on_missing_checkpoint: bool = setting(
        False, "stop with an error when --load holds no checkpoint, instead of training from "
        "scratch", "--exit-on-missing-checkpoint")
    no_save_optim: bool = setting(False, "do not save the optimizer state", "--no-save-optim")
    no_save_rng: bool = setting(False, "do not save the RNG state", "--no-save-rng")
    ckpt_format: str = setting(
        "torch_dist", "checkpoint format: torch_dist writes one layout-free checkpoint "
        "through torch.distributed.checkpoint that any tp/pp/dp/ZeRO layout loads; torch and "
        "safetensors write one file per rank, loadable only by the layout that wrote it "
        "(docs/CHECKPOINTS.md); --load reads the format from the folder",
        "--ckpt-format", choices=("torch", "safetensors", "torch_dist"))
    async_save: bool = setting(
        False, "write checkpoints in the background while training goes on (staged to CPU "
        "memory first; the tracker names a checkpoint once every rank finished it; needs "
        "--ckpt-format torch_dist)", "--async-save")
    non_persistent_save_interval: Optional[int] = setting(
        None, "iterations between non-persistent checkpoints: cheap, only the newest is kept, "
        "and --load resumes from it when it is newer than the persistent one (needs --save "
        "and --non-persistent-ckpt-type; docs/CHECKPOINTS.md)", "--non-persistent-save-interval")
    non_persistent_ckpt_type: Optional[str] = setting(
        None, "where non-persistent checkpoints go: global (a checkpoint as --save's, in "
        "--non-persistent-global-ckpt-dir), local (each rank its own state, no gather, in "
        "--non-persistent-local-ckpt-dir; loads only into the same layout), in_memory (each "
        "rank's state in host memory, /dev/shm, and a copy on a peer node's)",
        "--non-persistent-ckpt-type", choices=("global", "local", "in_memory"))
    non_persistent_global_ckpt_dir: Optional[str] = setting(
        None, "folder of global non-persistent checkpoints (default: --save/non_persistent)",
        "--non-persistent-global-ckpt-dir", metavar="DIR")
    non_persistent_local_ckpt_dir: Optional[str] = setting(
        None, "node-local folder of local non-persistent checkpoints (needed by local); for "
        "in_memory, the tmpfs folder (default /dev/shm)", "--non-persistent-local-ckpt-dir",
        metavar="DIR")
    non_persistent_local_ckpt_algo: str = setting(
        "fully_parallel", "accepted: each rank always writes its whole state, replicas "
        "included (as Megatron's atomic)", "--non-persistent-local-ckpt-algo",
        choices=("fully_parallel", "atomic"))
    override_opt_param_scheduler: bool = setting(
        False, "on --load, follow the flags' lr schedule, not the checkpoint's",
        "--override-opt_param-scheduler")
    use_checkpoint_opt_param_scheduler: bool = setting(
        False, "on --load, follow the checkpoint's lr schedule, not the flags' (neither: "
        "a difference is an error)", "--use-checkpoint-opt_param-scheduler")


@dataclass(frozen=True)
class LoggingConfig:
    """Where the metrics go: console every --log-interval, JSON lines, TensorBoard."""

    log_interval: int = setting(100, "iterations between log lines", "--log-interval",
                                ds="steps_per_print", ds_default=10)
    metrics_file: Optional[str] = setting(
        None, "JSON lines file, one line per logged iteration / eval", "--metrics-file")
    logging_level: Optional[int] = setting(
        None, "the Python root logger's level (10 DEBUG ... 50 CRITICAL), as Megatron-LM sets "
        "it (its MEGATRON_LOGGING_LEVEL environment variable when the flag is not given)",
        "--logging-level")
    tensorboard_dir: Optional[str] = setting(
        None, "write TensorBoard events here (needs the tensorboard package: checked before "
        "any rank starts)", "--tensorboard-dir")
    wandb_project: Optional[str] = setting(
        None, "log to this Weights & Biases project (needs wandb, checked before any rank "
        "starts, and --wandb-exp-name)", "--wandb-project")
    wandb_exp_name: Optional[str] = setting(None, "the Weights & Biases run name",
                                            "--wandb-exp-name")
    wandb_save_dir: Optional[str] = setting(
        None, "local Weights & Biases folder (default: --save/wandb)", "--wandb-save-dir")
    tensorboard_queue_size: int = setting(
        1000, "accepted: events are flushed by the TensorBoard writer's own queue",
        "--tensorboard-queue-size")
    log_timers_to_tensorboard: bool = setting(
        False, "accepted: the timers (timers_ms/*) are always written with --tensorboard-dir",
        "--log-timers-to-tensorboard")
    log_validation_ppl_to_tensorboard: bool = setting(
        False, "accepted: validation loss goes to TensorBoard, its perplexity to the metrics "
        "file", "--log-validation-ppl-to-tensorboard")
    log_batch_size_to_tensorboard: bool = setting(
        False, "accepted: the global batch size of each log line is in the metrics file",
        "--log-batch-size-to-tensorboard")
    log_optimizer_states_to_tensorboard: bool = setting(
        False, "Megatron-DeepSpeed's series: L2/L1 norm and largest |value| of Adam's moments "
        "and the master weights (optimizer/*), every log line, to TensorBoard and the metrics "
        "file; each element of the model counted once (parallel/zero/state_stats.py)",
        "--log-optimizer-states-to-tensorboard")
    log_params_norm: bool = setting(
        False, "log the L2 norm of the fp32 master weights, each element of the model counted "
        "once (Megatron's calc_params_l2_norm): 'params norm' on the console line, the "
        "metrics file and TensorBoard", "--log-params-norm")
    log_num_zeros_in_grad: bool = setting(
        False, "log the number of zero entries in the gradients of each step (after the "
        "reduction over data-parallel ranks, each element of the model counted once, as the "
        "grad norm counts it): Megatron's 'num zeros' on the console line, the metrics file "
        "and TensorBoard", "--log-num-zeros-in-grad")
    log_memory_to_tensorboard: bool = setting(
        False, "accepted: a logging switch; peak memory (peak_memory_mib) goes to TensorBoard "
        "on every log line anyway (Megatron's allocator series are not written)",
        "--log-memory-to-tensorboard")
    log_throughput: bool = setting(
        False, "accepted: gigatron logs tokens/s, TFLOP/s per device and MFU on every log "
        "line", "--log-throughput")
    peak_tflops: Optional[float] = setting(
        None, "device peak TFLOP/s for MFU (default: the per-device table)", "--peak-tflops")
    progress: Optional[bool] = setting(
        None, "progress bar (default: on when stderr is a terminal)", "--progress",
        negative="--no-progress")
    timing_log_level: int = setting(
        0, ">= 1: synchronise the accelerator around timed phases", "--timing-log-level",
        choices=(0, 1, 2), ds="wall_clock_breakdown", ds_as="timing",
        ds_doc="true = 1, false = 0")
    timeline: Optional[str] = setting(
        None, "write a Chrome/Perfetto trace of every rank's spans here (docs/TIMELINE.md; "
        "default: $GIGATRON_TIMELINE)", "--timeline", metavar="FILE")
    log_straggler: bool = setting(
        False, "each log line also shows the --straggler-minmax-count slowest and fastest "
        "ranks' working time per step (wall time less p2p and grad-sync waits) and names the "
        "slowest (one all-gather per log line; training/observe/straggler.py)",
        "--log-straggler")
    straggler_minmax_count: int = setting(
        1, "how many slowest and fastest ranks --log-straggler shows", "--straggler-minmax-count")
    straggler_ctrlr_port: int = setting(
        65535, "accepted: no control server is started (Megatron's turns the straggler report "
        "on and off at run time over this port); --log-straggler reports on every log line",
        "--straggler-ctrlr-port")
    disable_straggler_on_startup: bool = setting(
        False, "start with the --log-straggler report off, as Megatron; without its control "
        "server (--straggler-ctrlr-port) it then stays off", "--disable-straggler-on-startup")


@dataclass
class RunConfig:
    """Everything one run needs, built once from the settings (`arguments.build_run`) and
    handed down explicitly: the resolved configs its parts are built from, and `settings`,
    every setting as given (typed), which the features without a config of their own read."""

    model: "TransformerConfig"
    parallel: ParallelConfig  # dp from the world size; sequence parallelism only at tp > 1
    zero: "ZeroConfig"  # stage, optimizer, loss scaling, clipping
    lr_schedule: LRScheduleConfig
    data: "GPTDataConfig"  # eod and vocab filled from the tokenizer when datasets are built
    train: TrainConfig  # batch sizes and iterations resolved
    checkpoint: CheckpointConfig
    logging: LoggingConfig
    settings: "Settings"

    @property
    def model_name(self) -> Optional[str]:
        """The --model zoo name (None: a model described by its flags)."""
        return self.settings.model.model

    @property
    def flags(self) -> Dict[str, Any]:
        """Every setting by its flag's dest: the record checkpoint metadata and the Weights &
        Biases config keep (Megatron keeps its args)."""
        from gigatron.training.config.table import flag_values

        return flag_values(self.settings)
